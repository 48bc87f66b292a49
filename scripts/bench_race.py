"""Exact (exponential race) vs rejection verification, side by side in one process, one torch thread.

    .venv/bin/python scripts/bench_race.py                       # all three parts
    .venv/bin/python scripts/bench_race.py --parts sampler       # only the sampler cost at vocab 151936
    .venv/bin/python scripts/bench_race.py --parts verify        # verification cost by how far rows walk

Parts:
- `sampler`: the cost of drawing one token per row from random logits at vocab 151936 (a Qwen2-sized head), float32:
  today's inverse-CDF draw (`rejection_sample` with no drafts) vs the race (`race_sample`), each after the same
  processing (temperature, softmax); the torch references on a CPU, the Triton kernels on a GPU.
- `rollout`: the shipped tiny target on the arithmetic task (prompts x n samples, T = 1.0): acceptance and rollout
  tokens/s of n-gram and draft-model drafting at K = 4 under `verification="exact"` and `"rejection"`, and no
  speculation.
- `float32`: the fraction of samples that differ between speculation off and on with exact verification, float32
  (a batch shape changes the rounding of the logits, and a near-tie in the race can flip) vs float64.
- `verify`: one exact verification (`verify_exact`) of chains of W tokens per row at the tiny target's vocabulary (476),
  racing every node at once vs depth by depth, with every draft rejected vs every draft accepted: what a step's
  verification costs depends on how far its rows walk, which a warm-up fed drafts that are all rejected never sees.
  Not part of the default run.
- `fused`: one exact-verification draw of rows x (K + 1) nodes at vocab 476 and 151936, float32 logits: today's draw
  before the fused pass (gather the nodes' logits, `log_softmax`, `exp`, `race_sample_ref`, gather the log-prob) vs
  `race_logits_ref` (reads the logits in place), on a CPU; and how many of the draws pick another token (the two
  races agree up to rounding: p_t / E_t in float32 probabilities vs x_t / T - ln E_t in float64). Not part of the
  default run.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from rollout import Generator, SamplingParams
from rollout.models import zoo
from rollout.tasks import arithmetic_dataset
from rollout_kernels.race_logits import race_logits_ref
from rollout_kernels.race_sample import race_sample, race_sample_ref
from rollout_kernels.rejection_sample import rejection_sample, rejection_sample_ref
from specdec.config import SpecConfig
from specdec.processing import RowSampling
from specdec.tree import layout_drafts
from specdec.verify import RaceKeys, verify_exact


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` over `repeats` calls after one untimed call; on CUDA each call is timed from an
    idle device to its work's end (also `bench_keep_threshold.py`'s timer)."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def sampler_seconds(rows: int, vocab_size: int, device: str, repeats: int) -> tuple[float, float, float]:
    """Median seconds of the softmax, the inverse-CDF draw and the race for `rows` random rows."""
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab_size, generator=generator).to(device)
    probs = torch.softmax(logits, dim=-1)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    cu = torch.zeros(rows, dtype=torch.int64, device=device)
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator).to(device)
    seeds = torch.randint(0, 2**62, (rows,), generator=generator).to(device)
    positions = torch.randint(0, 1000, (rows,), generator=generator).to(device)
    inverse_cdf = rejection_sample if device == "cuda" else rejection_sample_ref
    race = race_sample if device == "cuda" else race_sample_ref
    return (
        median_seconds(lambda: torch.softmax(logits, dim=-1), repeats),
        median_seconds(lambda: inverse_cdf(empty, cu, None, probs, empty.double(), uniforms, 0), repeats),
        median_seconds(lambda: race(probs, seeds, positions), repeats),
    )


def bench_sampler(args) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab_size = 151936
    print(f"sampler at vocab {vocab_size}, float32 probabilities, {device} (ms per call; median of {args.repeats})")
    print(f"{'rows':>6s}{'softmax':>10s}{'inverse CDF':>13s}{'race':>10s}{'race / inverse CDF':>20s}")
    for rows in args.sampler_rows:
        softmax_s, cdf_s, race_s = sampler_seconds(rows, vocab_size, device, args.repeats)
        print(f"{rows:6d}{1e3 * softmax_s:10.1f}{1e3 * cdf_s:13.1f}{1e3 * race_s:10.1f}{race_s / cdf_s:20.2f}")


def shipped_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    data = arithmetic_dataset(num_prompts, split="eval", seed=0)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in data["prompt"]]


def rollout(model, spec, prompts, params, batch_size) -> dict:
    gen = Generator(model, max_batch_size=batch_size, max_seq_len=512, spec=spec)
    gen.generate(prompts[:2], SamplingParams(max_new_tokens=2, seed=0))  # allocate the caches: not timed
    start = time.perf_counter()
    outs = gen.generate(prompts, params)
    seconds = time.perf_counter() - start
    decode = [r for r in gen.last_trace if r.kind == "decode"]
    drafted = sum(r.num_drafted for r in decode)
    accepted = sum(r.num_accepted for r in decode)
    return {
        "outs": outs,
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
        "acceptance": accepted / drafted if drafted else 0.0,
        "emitted_per_row_step": sum(r.num_emitted for r in decode) / max(1, sum(r.batch_size for r in decode)),
    }


def bench_rollout(args) -> None:
    model, tokenizer = zoo.load_model("tiny-target")
    draft, _ = zoo.load_model("tiny-draft")
    prompts = shipped_prompts(tokenizer, args.num_prompts)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    batch_size = args.num_prompts * args.n
    configs = {"none": None}
    for method, extra in (("ngram", {}), ("draft_model", {"model": draft})):
        for verification in ("exact", "rejection"):
            configs[f"{method} K=4 {verification}"] = SpecConfig(
                method=method, num_speculative_tokens=4, verification=verification, **extra
            )
    results = {name: [] for name in configs}
    for repeat in range(args.rollout_repeats):  # round-robin: drift on the machine hits every config alike
        for name, spec in configs.items():
            results[name].append(rollout(model, spec, prompts, params, batch_size))
            print(f"repeat {repeat + 1} {name}: {results[name][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    base = sorted(r["tokens_per_s"] for r in results["none"])[args.rollout_repeats // 2]
    print(f"\n{args.num_prompts} prompts x {args.n}, T=1.0, {args.max_new_tokens} new tokens, {batch_size} slots")
    print(f"{'config':28s}{'tokens/s':>10s}{'x none':>8s}{'acceptance':>12s}{'tokens/row-step':>17s}")
    for name, runs in results.items():
        middle = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        print(
            f"{name:28s}{middle['tokens_per_s']:10.0f}{middle['tokens_per_s'] / base:8.2f}"
            f"{middle['acceptance']:12.3f}{middle['emitted_per_row_step']:17.3f}"
        )


def bench_float32(args) -> None:
    print("samples that differ from speculation off, exact verification (T=1.0)")
    for dtype in (torch.float32, torch.float64):
        model, tokenizer = zoo.load_model("tiny-target", dtype=dtype)
        draft, _ = zoo.load_model("tiny-draft", dtype=dtype)
        prompts = shipped_prompts(tokenizer, args.num_prompts)
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        batch_size = args.num_prompts * args.n
        plain = rollout(model, None, prompts, params, batch_size)["outs"]
        for name, spec in (
            ("ngram K=4", SpecConfig(method="ngram", num_speculative_tokens=4)),
            ("draft_model K=4", SpecConfig(method="draft_model", num_speculative_tokens=4, model=draft)),
        ):
            outs = rollout(model, spec, prompts, params, batch_size)["outs"]
            differ = sum(a.token_ids != b.token_ids for a, b in zip(plain, outs))
            print(f"  {str(dtype):15s} {name:16s} {differ}/{len(outs)} samples differ ({differ / len(outs):.1%})")


def bench_verify(args) -> None:
    """Exact verification of `rows` chains of `width` nodes, both ways of racing, drafts all rejected / all accepted."""
    vocab_size = 476
    print("exact verification, vocab 476, ms (median): racing every node at once | depth by depth")
    for rows in args.verify_rows:
        for width in args.verify_widths:
            generator = torch.Generator().manual_seed(rows * width)
            layout = layout_drafts([width - 1] * rows, None)
            logits = torch.randn(rows * width, vocab_size, generator=generator) * 3
            sampling = RowSampling(
                torch.ones(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows), False, False, False
            )
            race = RaceKeys(torch.arange(rows), torch.full((rows,), 100))
            rejected = torch.randint(0, vocab_size, (rows, width), generator=generator)
            # the race's own tokens as drafts: node j holds what the race draws at node j - 1: all accepted
            accepted = rejected.clone()
            for _ in range(width):
                drawn = verify_exact(logits, accepted.reshape(-1), layout, sampling, race).output_token_ids
                accepted[:, 1:] = drawn[:, : width - 1]
            for name, tokens in (("rejected", rejected), ("accepted", accepted)):
                flat = tokens.reshape(-1)
                result = verify_exact(logits, flat, layout, sampling, race)
                walked = float((result.num_emitted - 1).float().mean())
                every, by_depth = (
                    median_seconds(partial(verify_exact, logits, flat, layout, sampling, race, e), args.repeats)
                    for e in (True, False)
                )
                print(
                    f"rows {rows:5d} width {width}: drafts {name} ({walked:.1f} accepted per row): "
                    f"{1e3 * every:7.2f} | {1e3 * by_depth:7.2f}"
                )


def interleaved_min_seconds(fns, repeats: int) -> list[float]:
    """The fastest of `repeats` calls of each of `fns`, called in turn (a shared CPU's drift hits every one alike)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def previous_draw(logits: torch.Tensor, nodes: torch.Tensor, temperatures, seeds, positions):
    """Exact verification's draw before the fused pass: tokens and float64 log-probs."""
    logprobs = torch.log_softmax(logits[nodes].float() / temperatures[:, None], dim=-1)
    tokens = race_sample_ref(logprobs.exp(), seeds, positions)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0].double()


def bench_fused(args) -> None:
    print("one exact-verification draw, float32 logits, CPU, ms (fastest, calls interleaved): before | fused | ratio")
    for vocab_size in (476, 151936):
        for rows in args.fused_rows:
            num_nodes = rows * (args.fused_k + 1)
            if num_nodes * vocab_size > 1 << 26:  # a few hundred MB of logits and copies: left out
                continue
            generator = torch.Generator().manual_seed(rows)
            logits = 3 * torch.randn(num_nodes, vocab_size, generator=generator)
            nodes = torch.arange(num_nodes)
            temperatures = torch.ones(num_nodes)
            seeds = torch.randint(0, 2**62, (num_nodes,), generator=generator)
            positions = torch.randint(0, 1000, (num_nodes,), generator=generator)
            draw_args = (logits, nodes, temperatures, seeds, positions)
            before, fused = interleaved_min_seconds(
                [partial(previous_draw, *draw_args), partial(race_logits_ref, *draw_args)], args.repeats
            )
            print(
                f"vocab {vocab_size:6d} rows {rows:4d} x {args.fused_k + 1} nodes: "
                f"{1e3 * before:8.2f} | {1e3 * fused:8.2f} | {fused / before:5.2f}"
            )
    differ, total = 0, 0
    for seed in range(args.fused_agreement_batches):
        generator = torch.Generator().manual_seed(1000 + seed)
        logits = 3 * torch.randn(4096, 476, generator=generator)
        draw_args = (
            logits,
            torch.arange(4096),
            torch.ones(4096),
            torch.randint(0, 2**62, (4096,), generator=generator),
            torch.randint(0, 1000, (4096,), generator=generator),
        )
        differ += int((previous_draw(*draw_args)[0] != race_logits_ref(*draw_args)[0]).sum())
        total += 4096
    print(f"draws whose token differs between the two races (vocab 476, T = 1): {differ} of {total}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["sampler", "rollout", "float32"])
    parser.add_argument("--sampler-rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--rollout-repeats", type=int, default=2)
    parser.add_argument("--verify-rows", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--verify-widths", type=int, nargs="+", default=[5, 9])
    parser.add_argument("--fused-rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--fused-k", type=int, default=4)
    parser.add_argument("--fused-agreement-batches", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = {
        "sampler": bench_sampler,
        "rollout": bench_rollout,
        "float32": bench_float32,
        "verify": bench_verify,
        "fused": bench_fused,
    }
    for part in args.parts:
        parts[part](args)
        print()


if __name__ == "__main__":
    main()
