"""Dynamic K over a whole rollout: no speculation, static K, a table and `auto`, side by side in one process.

The shipped tiny target and draft on the long-tail arithmetic task, n samples per prompt at temperature 1.0, enough
prompts that the batch starts at the slot count, one torch thread. Prints the rollout time and tokens/s per phase
(bulk / tail, DESIGN.md) with ratios to no speculation, the decode tokens/s of every config by batch-size range (which
static K is fastest where), checks the issue's targets, and writes the runs as JSON and a PNG of batch size and K over
time and of K against batch size. `--repeats` runs every config that many times, round-robin, and reports medians:
repeated rollouts on this machine differ by up to ~5%.

    .venv/bin/python scripts/bench_phases.py --repeats 3 --out bench_phases
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from statistics import median

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from rollout import Generator, SamplingParams  # noqa: E402
from rollout.models import zoo  # noqa: E402
from rollout.phases import PhaseLabeler, summarize  # noqa: E402
from rollout.tasks import arithmetic_dataset  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402


def configs(args) -> dict[str, SpecConfig | None]:
    draft = dict(method="draft_model", model="tiny-draft") if args.method == "draft_model" else dict(method="ngram")
    out: dict[str, SpecConfig | None] = {"none": None}
    # speculation configured but off for every row: what the machinery costs when it drafts nothing
    out["K=0 (table of zeros)"] = SpecConfig(
        **draft, num_speculative_tokens=8, num_speculative_tokens_per_batch_size=[[1, args.batch_size, 0]]
    )
    for k in args.ks:
        out[f"static K={k}"] = SpecConfig(**draft, num_speculative_tokens=k)
    b = args.batch_size
    table = json.loads(args.table) if args.table else [[1, b // 8, 8], [b // 8 + 1, b // 2, 4], [b // 2 + 1, b, 1]]
    out[f"table {table}"] = SpecConfig(
        **draft, num_speculative_tokens=max(1, *(k for _, _, k in table)), num_speculative_tokens_per_batch_size=table
    )
    out["auto"] = SpecConfig(**draft, num_speculative_tokens=max(args.ks), num_speculative_tokens_per_batch_size="auto")
    return out


def run(model, spec, prompt_ids, params, args) -> dict:
    start = time.perf_counter()
    gen = Generator(model, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len, spec=spec)
    build = time.perf_counter() - start
    # untimed: allocate the slot caches (auto's warm-up did already), so every row times decoding alone
    start = time.perf_counter()
    gen.generate(prompt_ids[:1], SamplingParams(max_new_tokens=2, seed=0))
    first_call = time.perf_counter() - start
    start = time.perf_counter()
    outs = gen.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    labeler = PhaseLabeler(args.tail_fraction)
    steps, elapsed = [], 0.0
    for record in gen.last_trace:
        step = record.to_dict()
        step["phase"] = labeler.label(step["kind"], step["batch_size"])
        elapsed += step["seconds"]
        step["elapsed"] = elapsed
        steps.append(step)
    keep = ("elapsed", "seconds", "batch_size", "num_draft_tokens", "num_emitted", "phase")
    return {
        "seconds": seconds,
        # set-up paid once per generator: the constructor (auto: its warm-up profile, which also allocates the
        # KV cache) plus the first call (the others allocate the cache there)
        "setup_seconds": build + first_call,
        "warm_up_seconds": gen.warm_up_seconds,
        "tokens": sum(len(o.token_ids) for o in outs),
        "phases": summarize(steps)["phases"],
        "steps": [{k: s[k] for k in keep} for s in steps],
    }


def buckets(batch_size: int) -> list[tuple[int, int]]:
    """Batch-size ranges (lo, hi], powers of four, the largest ending at the slot count."""
    edges = [0] + [4**i for i in range(1, 16) if 4**i < batch_size] + [batch_size]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:])]


def bucket_rates(runs: list[dict], ranges) -> list[tuple[float, float]]:
    """Per batch-size range: decode tokens/s pooled over the repeats, and the mean K chosen."""
    out = []
    for lo, hi in ranges:
        steps = [s for r in runs for s in r["steps"] if s["phase"] != "prefill" and lo < s["batch_size"] <= hi]
        seconds = sum(s["seconds"] for s in steps)
        tokens = sum(s["num_emitted"] for s in steps)
        mean_k = sum(s["num_draft_tokens"] for s in steps) / len(steps) if steps else 0.0
        out.append((tokens / seconds if seconds else 0.0, mean_k))
    return out


def plot(results: dict, best_k: list[tuple[float, int]], path: pathlib.Path, title: str) -> None:
    """Batch size and K over time (first repeat), and K against batch size with the best static K of each range."""
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 9))
    for name, runs in results.items():
        if name == "none" or name.startswith("K=0"):
            continue
        steps = [s for s in runs[0]["steps"] if s["phase"] != "prefill"]
        t = [s["elapsed"] for s in steps]
        top.plot(t, [s["batch_size"] for s in steps], label=name, lw=1)
        if name == "auto" or name.startswith("table"):
            middle.step(t, [s["num_draft_tokens"] for s in steps], label=name, where="post")
            every = [s for r in runs for s in r["steps"] if s["phase"] != "prefill"]
            jitter = 0.15 if name == "auto" else -0.15
            bottom.scatter(
                [s["batch_size"] for s in every],
                [s["num_draft_tokens"] + jitter for s in every],
                s=6,
                alpha=0.3,
                label=f"{name}: K of each step",
            )
    bottom.plot([b for b, _ in best_k], [k for _, k in best_k], "k*-", ms=12, label="fastest static K in the range")
    top.set_ylabel("rows in decode")
    top.set_xlabel("seconds of decoding")
    top.legend(fontsize=7)
    middle.set_ylabel("K")
    middle.set_xlabel("seconds of decoding")
    middle.legend(fontsize=7)
    bottom.set_xscale("log", base=2)
    bottom.invert_xaxis()  # a rollout runs from the full batch (left) to its tail (right)
    bottom.set_xlabel("rows in decode (log scale; the rollout runs left to right)")
    bottom.set_ylabel("K")
    bottom.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan  # a phase a short run never reached


def report_targets(results: dict, statics: list[str], batch_size: int, rate, seconds) -> list[tuple[float, int]]:
    """Prints decode tokens/s by batch-size range and the issue's targets; returns the fastest static K per range."""
    ranges = buckets(batch_size)
    per_range = {name: bucket_rates(runs, ranges) for name, runs in results.items()}
    print("\ndecode tokens/s by rows in decode (pooled over repeats); auto's mean K; the fastest static K")
    print(f"{'rows':<12}" + "".join(f"{n.replace('static ', ''):>9}" for n in ["none", *statics, "auto"]) + "  auto K")
    best_k = []
    for i, (lo, hi) in enumerate(ranges):
        cells = [per_range[n][i][0] for n in ["none", *statics, "auto"]]
        if not any(cells):
            continue
        fastest = max(statics, key=lambda n: per_range[n][i][0])
        best_k.append((math.sqrt((lo + 1) * hi), int(fastest.split("=")[1])))
        print(
            f"{f'{lo + 1}-{hi}':<12}" + "".join(f"{c:>9.0f}" for c in cells) + f"{per_range['auto'][i][1]:>8.2f}"
            f"   fastest {fastest}, auto {ratio(per_range['auto'][i][0], per_range[fastest][i][0]):.3f} of it"
        )

    setup = {n: median(r["setup_seconds"] for r in results[n]) for n in ("none", "auto")}
    print(
        f"set-up once per generator: auto {setup['auto']:.2f} s (warm-up profile "
        f"{median(r['warm_up_seconds'] for r in results['auto']):.2f} s, KV-cache allocation included) "
        f"vs {setup['none']:.2f} s without speculation; not in the rollout times"
    )
    for phase in ("bulk", "tail"):
        best = max(statics, key=lambda n: rate(n, phase))
        print(
            f"{phase}: auto/none {ratio(rate('auto', phase), rate('none', phase)):.3f} (target >= 1), "
            f"auto/best static ({best}) {ratio(rate('auto', phase), rate(best, phase)):.3f} (target >= 0.95)"
        )
    fastest = min(statics, key=seconds)
    print(
        f"whole rollout: fastest static ({fastest}) time / auto time "
        f"{seconds(fastest) / seconds('auto'):.3f} (target > 1)"
    )
    return best_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-seq-len", type=int, default=640)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--method", choices=["draft_model", "ngram"], default="draft_model", help="the proposer")
    parser.add_argument("--table", help="the table policy's rows as JSON, e.g. '[[1, 32, 2], [33, 1024, 0]]'")
    parser.add_argument("--repeats", type=int, default=1, help="rollouts per config, run round-robin; medians")
    parser.add_argument("--only", nargs="+", help="run only the configs whose names start with one of these")
    parser.add_argument("--tail-fraction", type=float, default=0.25)
    parser.add_argument("--out", default="bench_phases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = zoo.load_model("tiny-target")
    rows = arithmetic_dataset(args.num_prompts, split="eval", seed=0)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    specs = configs(args)
    if args.only:
        specs = {name: spec for name, spec in specs.items() if name.startswith(tuple(args.only))}
    results: dict[str, list[dict]] = {name: [] for name in specs}
    for repeat in range(args.repeats):  # round-robin: a slow spell of the machine hits every config alike
        for name, spec in specs.items():
            results[name].append(run(model, spec, prompt_ids, params, args))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1]['seconds']:.2f} s", flush=True)

    def rate(name: str, phase: str) -> float:
        return median(r["phases"][phase]["tokens_per_s"] for r in results[name])

    def seconds(name: str) -> float:
        return median(r["seconds"] for r in results[name])

    print(
        f"\n{len(prompt_ids)} prompts x {args.n} samples, {args.batch_size} slots, T=1.0, {args.method}, one thread, "
        f"median of {args.repeats} (spread: min-max rollout seconds)"
    )
    header = f"{'config':<34}{'seconds':>9}{'spread':>13}{'x none':>8}{'bulk tok/s':>12}{'x':>6}{'tail tok/s':>12}"
    print(header + f"{'x':>6}{'K bulk/tail':>13}")
    nan = float("nan")  # the ratios to `none` where --only left it out
    for name, runs in results.items():
        times = [r["seconds"] for r in runs]
        mean_k = [median(r["phases"][p]["mean_k"] for r in runs) for p in ("bulk", "tail")]
        x_none, x_bulk, x_tail = (
            (seconds("none") / seconds(name), *(ratio(rate(name, p), rate("none", p)) for p in ("bulk", "tail")))
            if "none" in results
            else (nan, nan, nan)
        )
        print(
            f"{name:<34}{seconds(name):>9.2f}{f'{min(times):.2f}-{max(times):.2f}':>13}"
            f"{x_none:>8.2f}{rate(name, 'bulk'):>12.0f}{x_bulk:>6.2f}{rate(name, 'tail'):>12.0f}"
            f"{x_tail:>6.2f}{f'{mean_k[0]:.2f}/{mean_k[1]:.2f}':>13}"
        )

    statics = [n for n in results if n.startswith("static")]
    best_k = []
    if "none" in results and "K=0 (table of zeros)" in results:
        off = seconds("K=0 (table of zeros)") / seconds("none")
        print(f"\nspeculation off (K = 0 every row) vs spec=None: time ratio {off:.3f} (target <= 1.03)")
    if {"none", "auto"} <= results.keys() and statics:  # the targets need the whole set
        best_k = report_targets(results, statics, args.batch_size, rate, seconds)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_phases.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    title = f"batch size and K over a rollout ({args.method}, tiny target, {args.batch_size} rows)"
    plot(results, best_k, out / "batch_and_k.png", title)
    print(f"wrote {out / 'bench_phases.json'} and {out / 'batch_and_k.png'}")


if __name__ == "__main__":
    main()
