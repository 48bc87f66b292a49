"""Host time of a decode step: everything a step does besides the model's forward, at a large batch.

One rollout per configuration (the shipped tiny target, the arithmetic task, 128 prompts x 8 samples, 1024 slots,
temperature 1.0, one torch thread). A step's time is the wall time between two steps' reports (`on_step`): the step,
then releasing finished rows; the forward's comes from a timer around the target's (and a draft model's) `forward`.
Host time = step time - forward time: scheduling, drafting, layout, sampling set-up, verification, commit, release.
Prints ms per decode step over the steps with at least half the slots busy; with `--profile`, also the functions
that took the most host time (cProfile self time, outside the model; the profiler itself slows Python code, so take
the shares, not the times, from such a run).

`--padded` runs a GPU's decode path: the paged KV layout and the graph runner's padded forward, not captured (a CPU
cannot), the verification of chains inside it. Its "forward" is the padded body (what a replay runs on a GPU:
the decoder, the LM head and the verification); host time is the rest, the host's part of a GPU step.

    .venv/bin/python scripts/profile_step.py
    .venv/bin/python scripts/profile_step.py --padded --num-prompts 8 --batch-size 32 --only none suffix
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from rollout import Generator, SamplingParams
from rollout.engine.graph_runner import GraphRunner
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from specdec import SpecConfig


def timed_forward(model: torch.nn.Module, spent: list[float]) -> None:
    """Wrap the model's forward with a timer that adds to `spent[0]`."""
    inner = model.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    model.forward = forward


def timed_body(spent: list[float]):
    """Wrap the graph runners' padded body with a timer that adds to `spent[0]`; returns the undo."""
    inner = GraphRunner._body

    def body(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    GraphRunner._body = body
    return lambda: setattr(GraphRunner, "_body", inner)


def profile(name: str, spec: SpecConfig | None, args, prompts: list[list[int]], model) -> dict:
    layout = "paged" if args.padded else "auto"
    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len, spec=spec, kv_layout=layout)
    if args.padded:
        for runner in gen._runners():  # the target's, and a draft model's
            runner.use_graphs(gen.max_width, capture=False)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    gen.generate(prompts[:4], SamplingParams(n=2, max_new_tokens=8, seed=0))  # warm-up
    spent = [0.0]
    per_step: list[float] = []
    drafts = [p.runner.model for p in gen.proposers.proposers.values() if hasattr(p, "runner")] if spec else []
    models = [model, *drafts]
    undo = None
    if args.padded:  # the decode steps' forward is the padded body; prefills run the model's forward
        undo = timed_body(spent)
    for m in models:
        timed_forward(m, spent)
    last = [0.0, 0.0]
    loop: list[float] = []  # wall time since the previous step was reported: the step, releasing rows, admitting

    def on_step(record, done, total):
        now = time.perf_counter()
        per_step.append(spent[0] - last[0])
        loop.append(now - last[1])
        last[0], last[1] = spent[0], now

    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    last[1] = time.perf_counter()
    gen.generate(prompts, params, on_step=on_step)
    if profiler is not None:
        profiler.disable()
    for m in models:
        del m.forward  # back to the class's forward
    if undo is not None:
        undo()
    steps = [(r, f, w) for r, f, w in zip(gen.last_trace, per_step, loop) if r.kind != "prefill"]
    bulk = [(r, f, w) for r, f, w in steps if r.batch_size >= args.batch_size // 2]
    step_ms = 1e3 * sum(w for _, _, w in bulk) / len(bulk)
    forward_ms = 1e3 * sum(f for _, f, _ in bulk) / len(bulk)
    total_host = sum(w - f for _, f, w in steps)
    top = []
    if profiler is not None:  # self time of functions not called from inside a model's forward
        stats = pstats.Stats(profiler).stats
        inside = ("transformers/", "torch/nn/")
        for func, (_, _, self_time, _, callers) in stats.items():
            if any(part in func[0] for part in inside) or any(any(p in c[0] for p in inside) for c in callers):
                continue
            top.append((self_time, f"{func[0].split('/')[-1]}:{func[1]} {func[2]}"))
        top.sort(reverse=True)
    return {
        "name": name,
        "bulk_steps": len(bulk),
        "step_ms": step_ms,
        "forward_ms": forward_ms,
        "host_ms": step_ms - forward_ms,
        "host_share": (step_ms - forward_ms) / step_ms,
        "top": [(seconds / max(total_host, 1e-9), where) for seconds, where in top[: args.top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=320)
    parser.add_argument("--top", type=int, default=12, help="host functions listed per configuration")
    parser.add_argument("--only", nargs="+", help="configurations whose names start with one of these")
    parser.add_argument("--profile", action="store_true", help="also list the top host functions (cProfile: slower)")
    parser.add_argument("--padded", action="store_true", help="a GPU's decode path: paged, the padded graph forward")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model("tiny-target")
    data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in data]
    configs = {
        "none": None,
        "ngram K=4": SpecConfig(method="ngram", num_speculative_tokens=4),
        "suffix K=4": SpecConfig(method="suffix", num_speculative_tokens=4),
        "draft model K=4": SpecConfig(method="draft_model", model="tiny-draft", num_speculative_tokens=4),
    }
    rows = []
    for name, spec in configs.items():
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        rows.append(profile(name, spec, args, prompts, model))
        r = rows[-1]
        print(f"\n{name}: host {r['host_ms']:.1f} ms of {r['step_ms']:.1f} ms per bulk step", flush=True)
        for share, where in r["top"]:
            print(f"  {100 * share:5.1f}% of host time  {where}")
    print("\n| config | bulk steps | step ms | forward ms | host ms | host share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['name']} | {r['bulk_steps']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | {r['host_ms']:.2f} "
            f"| {100 * r['host_share']:.1f}% |"
        )


if __name__ == "__main__":
    main()
