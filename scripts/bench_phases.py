"""Dynamic K over a whole rollout: no speculation, static K, a table and `auto`, side by side in one process.

The shipped tiny target and draft on the long-tail arithmetic task, n samples per prompt at temperature 1.0, enough
prompts that the batch starts at the slot count, one torch thread. Prints the rollout time and tokens/s per phase
(bulk / tail, DESIGN.md) with ratios to no speculation, checks the issue's targets, writes the rows as JSON and a PNG
of batch size and K over time.

    .venv/bin/python scripts/bench_phases.py --num-prompts 32 --n 8 --out bench_phases
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from rollout import Generator, SamplingParams, zoo  # noqa: E402
from rollout.phases import PhaseLabeler, summarize  # noqa: E402
from rollout.tasks import arithmetic_dataset  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402


def configs(args) -> dict[str, SpecConfig | None]:
    draft = dict(method="draft_model", model="tiny-draft")
    out: dict[str, SpecConfig | None] = {"none": None}
    # speculation configured but off for every row: what the machinery costs when it drafts nothing
    out["K=0 (table of zeros)"] = SpecConfig(
        **draft, num_speculative_tokens=8, num_speculative_tokens_per_batch_size=[[1, args.batch_size, 0]]
    )
    for k in args.ks:
        out[f"static K={k}"] = SpecConfig(**draft, num_speculative_tokens=k)
    b = args.batch_size
    table = [[1, b // 8, 8], [b // 8 + 1, b // 2, 4], [b // 2 + 1, b, 1]]
    out[f"table {table}"] = SpecConfig(**draft, num_speculative_tokens=8, num_speculative_tokens_per_batch_size=table)
    out["auto"] = SpecConfig(**draft, num_speculative_tokens=max(args.ks), num_speculative_tokens_per_batch_size="auto")
    return out


def run(model, spec, prompt_ids, params, args) -> dict:
    start = time.perf_counter()
    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len, spec=spec)
    build = time.perf_counter() - start
    # untimed: allocate the slot caches (auto's warm-up did already), so every row times decoding alone
    gen.generate(prompt_ids[:1], SamplingParams(max_new_tokens=2, seed=0))
    start = time.perf_counter()
    outs = gen.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    labeler = PhaseLabeler(args.tail_fraction)
    steps, elapsed = [], 0.0
    for record in gen.last_trace:
        step = record.to_dict()
        step["phase"] = labeler.label(step["phase"], step["batch_size"])
        elapsed += step["seconds"]
        step["elapsed"] = elapsed
        steps.append(step)
    summary = summarize(steps)
    return {
        "seconds": seconds,
        "build_seconds": build,
        "warm_up_seconds": gen.warm_up_seconds,
        "tokens": sum(len(o.token_ids) for o in outs),
        "phases": summary["phases"],
        "token_ids": [o.token_ids for o in outs],
        "steps": [{k: s[k] for k in ("elapsed", "batch_size", "num_draft_tokens", "phase")} for s in steps],
    }


def plot(results: dict, path: pathlib.Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, row in results.items():
        if name == "none" or name.startswith("K=0"):
            continue
        t = [s["elapsed"] for s in row["steps"] if s["phase"] != "prefill"]
        top.plot(t, [s["batch_size"] for s in row["steps"] if s["phase"] != "prefill"], label=name, lw=1)
        if name == "auto" or name.startswith("table"):
            bottom.step(t, [s["num_draft_tokens"] for s in row["steps"] if s["phase"] != "prefill"], label=name)
    top.set_ylabel("rows in decode")
    top.legend(fontsize=7)
    bottom.set_ylabel("K")
    bottom.set_xlabel("seconds of decoding")
    bottom.legend(fontsize=7)
    fig.suptitle("batch size and K over a rollout (draft model, tiny target)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-seq-len", type=int, default=640)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tail-fraction", type=float, default=0.25)
    parser.add_argument("--out", default="bench_phases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model("tiny-target")
    rows = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    results = {name: run(model, spec, prompt_ids, params, args) for name, spec in configs(args).items()}

    base = results["none"]
    print(f"{len(prompt_ids)} prompts x {args.n} samples, {args.batch_size} slots, T=1.0, one thread")
    print(f"{'config':<34}{'seconds':>9}{'tok/s':>8}{'x none':>8}{'bulk tok/s':>12}{'x':>6}{'tail tok/s':>12}{'x':>6}")
    for name, row in results.items():
        bulk, tail = row["phases"]["bulk"]["tokens_per_s"], row["phases"]["tail"]["tokens_per_s"]
        b0, t0 = base["phases"]["bulk"]["tokens_per_s"], base["phases"]["tail"]["tokens_per_s"]
        print(
            f"{name:<34}{row['seconds']:>9.2f}{row['tokens'] / row['seconds']:>8.0f}"
            f"{base['seconds'] / row['seconds']:>8.2f}{bulk:>12.0f}{bulk / b0:>6.2f}{tail:>12.0f}{tail / t0:>6.2f}"
        )
    auto = results["auto"]
    statics = {n: r for n, r in results.items() if n.startswith("static")}
    off = results["K=0 (table of zeros)"]
    ratio = off["seconds"] / base["seconds"]
    print(f"speculation off (K = 0 every row) vs spec=None: time ratio {ratio:.3f} (target <= 1.03)")
    print(f"auto warm-up profile {auto['warm_up_seconds']:.2f} s (once per generator; not in its rollout time)")
    for phase in ("bulk", "tail"):
        best_name = max(statics, key=lambda n: statics[n]["phases"][phase]["tokens_per_s"])
        best = statics[best_name]["phases"][phase]["tokens_per_s"]
        mine = auto["phases"][phase]["tokens_per_s"]
        none = base["phases"][phase]["tokens_per_s"]
        print(f"{phase}: auto/none {mine / none:.3f} (target >= 1), auto/best static ({best_name}) {mine / best:.3f}")
    slowest_gap = min(r["seconds"] for r in statics.values()) / auto["seconds"]
    print(f"whole rollout: best static time / auto time {slowest_gap:.3f} (target > 1)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for row in results.values():
        del row["token_ids"]
    (out / "bench_phases.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "batch_and_k.png")
    print(f"wrote {out / 'bench_phases.json'} and {out / 'batch_and_k.png'}")


if __name__ == "__main__":
    main()
