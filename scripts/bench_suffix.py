"""Suffix drafting on RL rollouts, every alternative side by side in one process, one torch thread.

The shipped tiny target on the long-tail arithmetic task (64 held-out prompts x 8 samples, temperature 1.0, 384 new
tokens, 512 slots). Three scenarios, each timing one rollout (seed 2) of every config:

- first:  a fresh generator: no history.
- second: the generator's history holds a first rollout of the same prompts by the same model (seed 1).
- other:  the history holds a rollout of the same prompts by another model (the tiny draft, standing in for an
          older policy).

Configs: none; n-gram; suffix drafting only from the row's prompt trie (its prompt, its siblings, its prompt's
history); suffix without the second round for drafts that stop short (one round); suffix with auto's acceptance
estimate as it was before 2026-11-24 (old acceptance estimate; auto only); suffix (all rows + history); the
same with token trees of each row's 2 best drafts (K nodes); the draft model; suffix + draft model (suffix where its
calibrated score beats the draft model's measured acceptance, the draft model elsewhere); the same with the cascade's
rule before 2026-11-24 (first that drafts: suffix serves every row it has a draft for; auto only); each at K = 1, 2, 4,
8 and auto (K <= 8).
Printed per config: tokens per row-step (decode tokens emitted per row per step: 1 + accepted drafts), rollout
tokens/s and its ratio to none, bulk and tail tokens/s ratios, mean K, and the proposer's share of the rollout time.
`--repeats N` runs every config N times, round-robin, and prints the median ratios.
`--cost` prints the suffix proposer's time per step at 64, 256 and 1024 slots with a real history, next to the decode
step; `--memory N` the history's size and load time at N cached responses; `--kernels` the compiled proposer against
its numpy reference (`specdec/proposers/suffix_ref.py`) in lockstep on the same rollouts (256 slots, 32 prompts x 8,
static K = 4; a first rollout, then a second whose history holds the first), drafts checked identical at every step:
us per row-step of each over the bulk steps, and their ratio, median over `--repeats`.

    .venv/bin/python scripts/bench_suffix.py --out outputs/bench_suffix    # the three scenarios (~25 min)
    .venv/bin/python scripts/bench_suffix.py --cost --memory 10000         # cost per batch size, memory
    .venv/bin/python scripts/bench_suffix.py --kernels --repeats 3          # compiled vs numpy reference (~5 min)
    python3 scripts/bench_suffix.py --device cuda --ks --scenarios first second   # on a GPU, auto K rows only

The host side (proposers, scheduling) always runs with one torch thread; `--device` only moves the models (the draft
model follows the target) and so the KV caches and the verification kernels.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import pathlib
import statistics
import time

import torch

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.phases import PhaseLabeler, summarize
from rollout.tasks import arithmetic_dataset
from specdec.auto_policy import AcceptanceStats, AutoPolicy
from specdec.config import SpecConfig
from specdec.proposers.suffix_ref import Lockstep

OLD_ESTIMATE = "suffix (old acceptance estimate)"  # auto only: the estimate differs, the drafts do not
FIRST_DRAFTS = "suffix + draft (first that drafts)"  # auto only: the old cascade rule
HOOKS = ("propose", "update", "finish", "prefill", "copy_rows", "begin")


class ProposerClock:
    """Wall time spent in the generator's proposers, in total and per generator step."""

    def __init__(self, gen: Generator):
        self.total = 0.0
        self.since_step = 0.0
        self.per_step: list[float] = []
        if gen.proposers is None:
            return
        for name in HOOKS:
            method = getattr(gen.proposers, name)
            setattr(gen.proposers, name, self._timed(method))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.total += elapsed
                self.since_step += elapsed

        return timed

    def on_step(self, record, finished, total) -> None:
        self.per_step.append(self.since_step)
        self.since_step = 0.0


def spec_for(config: str, k: int | str) -> SpecConfig | None:
    if config == "none":
        return None
    method = {
        "ngram": "ngram",
        "suffix (prompt trie)": "suffix",
        "suffix": "suffix",
        "suffix (one round)": "suffix",
        OLD_ESTIMATE: "suffix",
        "draft model": "draft_model",
        "suffix + draft": ["suffix", "draft_model"],
        FIRST_DRAFTS: ["suffix", "draft_model"],
        "suffix, 2-branch trees": "suffix",
    }[config]
    auto = k == "auto"
    return SpecConfig(
        method=method,
        num_speculative_tokens=8 if auto else k,
        model="tiny-draft" if "draft" in config else None,
        num_speculative_tokens_per_batch_size="auto" if auto else None,
        num_candidates=2 if "trees" in config else 1,
    )


def warm_up(gen: Generator, prompt_ids: list[list[int]], history: tuple | None) -> None:
    """An untimed call that allocates the caches and, with the scenario's history loaded, runs the proposer's first
    drafting steps on it (two samples, 16 tokens: in a fresh process the first proposals on a loaded history took
    12-24 ms, 2.3x a short 64-row rollout's proposer time per row); then the history holds the scenario's responses
    only."""

    def load_history() -> None:
        if gen.draft_history is not None:
            gen.draft_history.clear()
            if history is not None:
                gen.draft_history.add_responses(*history)

    load_history()
    gen.generate(prompt_ids[:1], SamplingParams(n=2, max_new_tokens=16, seed=0))
    load_history()  # (the untimed call's response out)


def run(model, config, k, prompt_ids, history, args) -> dict:
    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len, spec=spec_for(config, k))
    if config == "suffix (prompt trie)":
        gen.draft_history.sources = (0,)
    if config == "suffix (one round)":
        gen.draft_history.continue_short = False
    if config == FIRST_DRAFTS:  # the cascade's rule before 2026-11-24: suffix serves every row it drafts for
        gen.proposers.pass_on = False
    if config == OLD_ESTIMATE:
        # auto's acceptance estimate as it was before 2026-11-24 (docs/design/dynamic-k.md): slower decay, heavier prior
        assert isinstance(gen.policy, AutoPolicy), f"expected the auto policy, got {type(gen.policy).__name__}"
        gen.policy.stats = {
            r: AcceptanceStats(s.max_k, prior_weight=1.0, decay=0.95) for r, s in gen.policy.stats.items()
        }
    warm_up(gen, prompt_ids, history)
    clock = ProposerClock(gen)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=2)
    start = time.perf_counter()
    outs = gen.generate(prompt_ids, params, on_step=clock.on_step)
    seconds = time.perf_counter() - start
    labeler = PhaseLabeler(0.25)
    steps = []
    for record in gen.last_trace:
        step = record.to_dict()
        step["phase"] = labeler.label(step["kind"], step["batch_size"])
        steps.append(step)
    decode = [s for s in steps if s["phase"] != "prefill"]
    row_steps = sum(s["batch_size"] for s in decode)
    served = collections.Counter()
    for s in decode:
        served.update(s.get("rows_by_method") or {})
    proposer_seconds = clock.total
    del gen, clock  # the clock's wrappers make a cycle: free the KV caches now, not at some later collection
    gc.collect()
    return {
        "config": config,
        "k": k,
        "seconds": seconds,
        "tokens": sum(len(o.token_ids) for o in outs),
        "tokens_per_row_step": sum(s["num_emitted"] for s in decode) / row_steps,
        "proposer_seconds": proposer_seconds,
        "proposer_us_per_row_step": 1e6 * proposer_seconds / row_steps,
        "mean_k": statistics.fmean(s["num_draft_tokens"] for s in decode),
        "suffix_rows": served["suffix"] / max(sum(served.values()), 1),  # of the rows drafted for
        "phases": summarize(steps)["phases"],
    }


def record_history(model, prompt_ids, args) -> tuple[list[list[int]], list[list[int]]]:
    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1)
    outs = gen.generate(prompt_ids, params)
    return [prompt_ids[o.prompt_index] for o in outs], [o.token_ids for o in outs]


def scenarios(args, model, draft, prompt_ids) -> list[dict]:
    histories = {"first": None}
    if "second" in args.scenarios:
        histories["second"] = record_history(model, prompt_ids, args)
    if "other" in args.scenarios:
        histories["other"] = record_history(draft, prompt_ids, args)
    configs = {
        "first": ["none", "ngram", "suffix (prompt trie)", "suffix (one round)", "suffix", OLD_ESTIMATE]
        + ["suffix, 2-branch trees", "draft model", "suffix + draft", FIRST_DRAFTS],
        "second": ["none", "suffix (prompt trie)", "suffix (one round)", "suffix", OLD_ESTIMATE]
        + ["suffix, 2-branch trees", "draft model", "suffix + draft", FIRST_DRAFTS],
        "other": ["none", "suffix", "draft model", "suffix + draft", FIRST_DRAFTS],
    }
    rows = []
    for scenario in args.scenarios:
        # round-robin over the configs, repeat after repeat: a slow spell of the machine hits every config alike
        for repeat in range(args.repeats):
            none = None
            for config in configs[scenario]:
                if args.only and config not in args.only and config != "none" or args.skip_none and config == "none":
                    continue
                only_auto = config in (OLD_ESTIMATE, FIRST_DRAFTS)
                for k in ["-"] if config == "none" else ["auto"] if only_auto else [*args.ks, "auto"]:
                    row = run(model, config, k, prompt_ids, histories[scenario], args)
                    row["scenario"], row["repeat"] = scenario, repeat
                    none = row if config == "none" else none
                    row["ratios"] = ratios(row, none)
                    print_row(row)
                    rows.append(row)
    if args.repeats > 1:
        print_medians(rows)
    return rows


def ratios(row: dict, none: dict | None) -> dict:
    """Rollout, bulk and tail tokens/s over the same repeat's `none` (nan without one)."""

    def tps(r, phase):
        return r["phases"].get(phase, {}).get("tokens_per_s", 0.0)

    nan = float("nan")
    return {
        "x_none": row["tokens"] / row["seconds"] / (none["tokens"] / none["seconds"]) if none else nan,
        "bulk": tps(row, "bulk") / tps(none, "bulk") if none and tps(none, "bulk") else nan,
        "tail": tps(row, "tail") / tps(none, "tail") if none and tps(none, "tail") else nan,
    }


def print_medians(rows: list[dict]) -> None:
    """Per (scenario, config, K): the median of each ratio over the repeats, with every repeat's rollout ratio."""
    print("\n| scenario | config | K | tok/row-step | x none (median) | each repeat | bulk | tail |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["config"], str(row["k"])), []).append(row)
    for (scenario, config, k), group in groups.items():
        if config == "none":
            continue
        median = {key: statistics.median(r["ratios"][key] for r in group) for key in ("x_none", "bulk", "tail")}
        each = ", ".join(f"{r['ratios']['x_none']:.3f}" for r in group)
        tokens = statistics.fmean(r["tokens_per_row_step"] for r in group)
        print(
            f"| {scenario} | {config} | {k} | {tokens:.3f} | {median['x_none']:.3f} | {each} | {median['bulk']:.3f} "
            f"| {median['tail']:.3f} |"
        )


def print_row(row: dict) -> None:
    rate = row["tokens"] / row["seconds"]
    r = row["ratios"]
    share = row["proposer_seconds"] / row["seconds"]
    us = row["proposer_us_per_row_step"]
    print(
        f"{row['scenario']:7s} {row['config']:21s} K={str(row['k']):5s} "
        f"tok/row-step {row['tokens_per_row_step']:.3f}  {row['seconds']:6.2f}s {rate:6.0f} tok/s  "
        f"x none {r['x_none']:.3f}  bulk {r['bulk']:.3f} tail {r['tail']:.3f}  mean K {row['mean_k']:.2f}  "
        f"proposer {100 * share:4.1f}% ({us:.1f} us/row-step)"
        + (f"  suffix served {100 * row['suffix_rows']:.0f}% of drafted rows" if "+" in row["config"] else ""),
        flush=True,
    )


def cost(args, model, tokenizer) -> list[dict]:
    """The suffix proposer's time per step vs the decode step at 64, 256 and 1024 rows, with a real history."""
    rows = []
    for batch_size in (64, 256, 1024):
        data = arithmetic_dataset(batch_size // args.n, split="eval", seed=0)
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
        longest = max(len(p) for p in prompt_ids) + args.max_new_tokens
        bench = argparse.Namespace(**{**vars(args), "batch_size": batch_size, "max_seq_len": longest})
        history = record_history(model, prompt_ids, bench)
        spec = SpecConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_max_tree_depth=args.depth)
        gen = Generator(model, max_batch_size=batch_size, max_seq_len=longest, spec=spec)
        warm_up(gen, prompt_ids, history)
        clock = ProposerClock(gen)
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=2)
        gen.generate(prompt_ids, params, on_step=clock.on_step)
        stats = gen.draft_history.stats()
        # the steps of the bulk (at least half the rows in flight), where the batch is about the size named
        bulk = [
            (p, r.seconds, r.batch_size, r.num_emitted)
            for p, r in zip(clock.per_step, gen.last_trace)
            if r.kind == "decode" and 2 * r.batch_size >= batch_size
        ]
        proposer, step, rows_per_step, emitted = (sum(x[i] for x in bulk) for i in range(4))
        row = {
            "rows": batch_size,
            "steps": len(bulk),
            "mean_rows": rows_per_step / len(bulk),
            "proposer_ms": 1e3 * proposer / len(bulk),
            "step_ms": 1e3 * step / len(bulk),
            "share": proposer / step,
            "us_per_row": 1e6 * proposer / rows_per_step,
            "tokens_per_row_step": emitted / rows_per_step,
            "us_per_token": 1e6 * proposer / emitted,
            "history_tokens": stats["tokens"],
        }
        print(
            f"cost {batch_size:5d} slots: proposer {row['proposer_ms']:7.2f} ms per step, decode step "
            f"{row['step_ms']:7.1f} ms ({100 * row['share']:.1f}%), {row['us_per_row']:.1f} us per row, "
            f"{row['us_per_token']:.1f} us per emitted token ({row['tokens_per_row_step']:.2f} per row-step) "
            f"({len(bulk)} bulk steps of {row['mean_rows']:.0f} rows on average, K=4, depth {args.depth}, history of "
            f"{stats['tokens']} tokens + rows in flight)",
            flush=True,
        )
        rows.append(row)
        del gen, clock
        gc.collect()
    return rows


def memory(args, model, tokenizer, num_responses: int) -> dict:
    """History size at `num_responses` distinct responses (train-split prompts x n samples), and its save/load."""
    num_prompts = -(-num_responses // args.n)
    data = arithmetic_dataset(num_prompts, split="train", seed=0)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
    longest = max(len(p) for p in prompt_ids) + args.max_new_tokens
    bench = argparse.Namespace(**{**vars(args), "batch_size": 1024, "max_seq_len": longest})
    start = time.perf_counter()
    prompts, responses = record_history(model, prompt_ids, bench)
    generate_seconds = time.perf_counter() - start
    spec = SpecConfig(method="suffix", suffix_decoding_max_cached_requests=num_responses)
    result = {}
    for depth in (24, 12):
        spec.suffix_decoding_max_tree_depth = depth
        gen = Generator(model, max_batch_size=8, max_seq_len=longest, spec=spec)
        start = time.perf_counter()
        gen.draft_history.add_responses(prompts[:num_responses], responses[:num_responses])
        add_seconds = time.perf_counter() - start
        stats = gen.draft_history.stats()
        path = pathlib.Path(args.out) / f"history_depth{depth}.npz"
        gen.draft_history.save(path)
        start = time.perf_counter()
        gen.draft_history.load(path)
        load_seconds = time.perf_counter() - start
        result[depth] = {
            **stats,
            "add_seconds": add_seconds,
            "load_seconds": load_seconds,
            "file_bytes": path.stat().st_size,
        }
        print(
            f"memory depth {depth}: {stats['responses']} responses, {stats['tokens']} tokens, "
            f"{stats['prompts']} prompts, {stats['nodes']} nodes, {stats['bytes'] / 2**20:.0f} MiB "
            f"({stats['bytes'] / stats['tokens']:.0f} B per token); added in {add_seconds:.1f} s, saved file "
            f"{path.stat().st_size / 2**20:.1f} MiB, loaded in {load_seconds:.1f} s (generating the responses "
            f"took {generate_seconds:.0f} s)",
            flush=True,
        )
    return result


def kernels(args, model, prompt_ids) -> list[dict]:
    """The compiled suffix proposer and its numpy reference on the same rollouts, side by side: us per row-step over
    the bulk steps (every hook's time, attributed to the step it precedes), first and second rollout."""
    prompt_ids = prompt_ids[: 256 // args.n]
    longest = max(len(p) for p in prompt_ids) + args.max_new_tokens
    spec = SpecConfig(method="suffix", num_speculative_tokens=4)
    rows = []
    for repeat in range(args.repeats):
        gen = Generator(model, max_batch_size=256, max_seq_len=longest, spec=spec)
        gen.generate(prompt_ids[:1], SamplingParams(max_new_tokens=2, seed=0))  # untimed: caches, compiled kernels
        gen.draft_history.clear()
        lockstep = Lockstep.replacing(gen.draft_history)
        gen.proposers.proposers["suffix"] = lockstep
        for scenario, seed in (("first", 1), ("second", 2)):  # the second's history holds the first
            per_step = []

            def on_step(record, finished, total, per_step=per_step, lockstep=lockstep):
                per_step.append(dict(lockstep.step_seconds))
                lockstep.step_seconds = {"new": 0.0, "ref": 0.0}

            lockstep.step_seconds = {"new": 0.0, "ref": 0.0}
            params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed)
            gen.generate(prompt_ids, params, on_step=on_step)
            labeler = PhaseLabeler(0.25)
            bulk = [
                (seconds, r.batch_size)
                for seconds, r in zip(per_step, gen.last_trace)
                if labeler.label(r.kind, r.batch_size) == "bulk"
            ]
            row_steps = sum(b for _, b in bulk)
            us = {who: 1e6 * sum(s[who] for s, _ in bulk) / row_steps for who in ("new", "ref")}
            row = {"scenario": scenario, "repeat": repeat, "row_steps": row_steps, **us, "ratio": us["ref"] / us["new"]}
            print(
                f"kernels {scenario:6s} repeat {repeat}: reference {us['ref']:.1f} us per row-step, compiled "
                f"{us['new']:.1f} ({row['ratio']:.2f}x), {row_steps} bulk row-steps, drafts identical",
                flush=True,
            )
            rows.append(row)
        del gen, lockstep
        gc.collect()
    for scenario in ("first", "second"):
        mine = [r for r in rows if r["scenario"] == scenario]
        median = {key: statistics.median(r[key] for r in mine) for key in ("ref", "new", "ratio")}
        print(
            f"kernels {scenario:6s} median of {len(mine)}: reference {median['ref']:.1f} us per row-step, compiled "
            f"{median['new']:.1f}, ratio {median['ratio']:.2f}x"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4, 8], help="static Ks (none given: auto only)")
    parser.add_argument("--scenarios", nargs="+", default=["first", "second", "other"])
    parser.add_argument("--repeats", type=int, default=1, help="rollouts per config, round-robin; prints medians")
    parser.add_argument("--only", nargs="+", help="configs to run besides none, e.g. suffix")
    parser.add_argument("--skip-none", action="store_true", help="no 'none' rows (ratios then read nan)")
    parser.add_argument("--cost", action="store_true", help="the proposer's time per step at 64, 256, 1024 rows")
    parser.add_argument("--memory", type=int, default=0, help="history size at this many cached responses")
    parser.add_argument("--depth", type=int, default=24, help="--cost: suffix_decoding_max_tree_depth")
    parser.add_argument("--kernels", action="store_true", help="compiled proposer vs its numpy reference, lockstep")
    parser.add_argument("--out", default="outputs/bench_suffix")
    parser.add_argument("--device", default="cpu", help="where the models run, e.g. cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    model, tokenizer = zoo.load_model("tiny-target")
    model.to(args.device)
    data = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]
    args.max_seq_len = max(len(p) for p in prompt_ids) + args.max_new_tokens
    results: dict = {}
    if args.kernels:
        results["kernels"] = kernels(args, model, prompt_ids)
        name = "kernels.json"
    elif args.cost or args.memory:
        if args.cost:
            results["cost"] = cost(args, model, tokenizer)
        if args.memory:
            results["memory"] = memory(args, model, tokenizer, args.memory)
        name = "cost.json"
    else:
        draft, _ = zoo.load_model("tiny-draft")
        draft.to(args.device)
        results["runs"] = scenarios(args, model, draft, prompt_ids)
        name = "runs.json"
    (pathlib.Path(args.out) / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
