"""Top-k / top-p thresholds without a sort vs the previous release's sort + cumsum, side by side in one process.

    PYTHONPATH=. .venv/bin/python scripts/bench_keep_threshold.py
    PYTHONPATH=. .venv/bin/python scripts/bench_keep_threshold.py --shapes 64x151936 --repeats 5

`specdec.processing.keep_thresholds` (the torch reference on a CPU, the Triton kernel on a GPU) against the sort it
replaced ("sort ms", `sorted_keep_thresholds` below: a stable sort of every row, softmax and cumsum of the sorted
probabilities, then the threshold), for random float32 logits (N(0, 1) x --scale, temperature 1), top_k=50 with
top_p=0.9, and top_p=0.9 alone. One torch thread; the median of --repeats runs; the ratio is old / new. On a GPU also
the torch reference run there ("reference ms": the same thresholds bit for bit, by torch.topk and cumulative sums)
and its ratio. Also prints how many rows' kept sets differ between the two, and of those, on how many the new count
is that of float64 probabilities summed in sorted order (the previous float32 sum drifts by a token in long
prefixes).
"""

from __future__ import annotations

import argparse

import torch
from bench_race import median_seconds  # this folder is on sys.path when a script runs

from rollout_kernels.keep_threshold import keep_threshold_ref
from specdec.processing import RowSampling, keep_thresholds


def sorted_keep_thresholds(logits: torch.Tensor, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous release's thresholds: sort each row, keep top-k, then the prefix whose float32 mass reaches
    top_p."""
    vocab_size = logits.shape[-1]
    scaled = logits.float() / sampling.divisors().float()[:, None]
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    sorted_logits = scaled.gather(1, order)
    rank = torch.arange(vocab_size, device=logits.device)
    top_k = torch.where(sampling.top_k > 0, sampling.top_k, vocab_size)
    keep = rank[None, :] < top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep &= (mass_before < sampling.top_p[:, None]) | (rank[None, :] == 0)
    num_kept = keep.sum(dim=1)
    last = order.gather(1, (num_kept - 1)[:, None])[:, 0]
    return logits.gather(1, last[:, None])[:, 0].double(), last


def reference_thresholds(logits: torch.Tensor, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """`keep_thresholds` through the torch reference wherever the logits are (on a GPU it takes the Triton kernel)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    args = (logits, rows, sampling.temperature, sampling.top_k, sampling.top_p)
    return keep_threshold_ref(*args, elements_per_chunk=1 << 22)


def kept(logits: torch.Tensor, keep_min: torch.Tensor, keep_last: torch.Tensor) -> torch.Tensor:
    x = logits.double()
    ids = torch.arange(logits.shape[1], device=logits.device)
    return (x > keep_min[:, None]) | ((x == keep_min[:, None]) & (ids <= keep_last[:, None]))


def float64_kept_counts(logits: torch.Tensor, top_k: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[rows]` the kept count with float64 softmax probabilities summed in sorted order (T = 1)."""
    probs = torch.softmax(logits.double(), dim=1).sort(dim=1, descending=True).values
    rank = torch.arange(logits.shape[1], device=logits.device)
    probs = probs.masked_fill(rank[None, :] >= torch.where(top_k > 0, top_k, logits.shape[1])[:, None], 0.0)
    cumulative = probs.cumsum(dim=1) / probs.sum(dim=1, keepdim=True)
    threshold = torch.tensor(top_p, dtype=torch.float32).double()  # top_p as the float32 settings hold it
    counts = (cumulative < threshold).sum(dim=1) + 1
    return torch.minimum(counts, torch.where(top_k > 0, top_k, logits.shape[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="256x32768,175x151936", help="rows x vocab, comma-separated")
    parser.add_argument("--scale", type=float, default=3.0, help="logits are N(0, 1) times this")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU, 1 thread"
    print(f"{name}, torch {torch.__version__}, float32 logits N(0, 1) x {args.scale}, median of {args.repeats}")
    print(
        "| rows x vocab | filter | sort ms | thresholds ms | ratio | reference ms | ratio | mean kept "
        "| rows that differ (new = f64) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    generator = torch.Generator(device=device).manual_seed(0)
    for shape in args.shapes.split(","):
        rows, vocab_size = (int(part) for part in shape.split("x"))
        logits = torch.randn(rows, vocab_size, generator=generator, device=device) * args.scale
        for label, top_k in (("top_k=50, top_p=0.9", 50), ("top_p=0.9", 0)):
            sampling = RowSampling(
                temperature=torch.ones(rows, device=device),
                top_k=torch.full((rows,), top_k, dtype=torch.long, device=device),
                top_p=torch.full((rows,), 0.9, device=device),
                needs_filter=True,
                all_greedy=False,
                any_greedy=False,
            )
            old = median_seconds(lambda x=logits, s=sampling: sorted_keep_thresholds(x, s), args.repeats)
            new = median_seconds(lambda x=logits, s=sampling: keep_thresholds(x, s), args.repeats)
            ref = new  # on a CPU the thresholds are the reference's
            if device == "cuda":  # the torch reference on the GPU: the same thresholds bit for bit, through torch.topk
                ref = median_seconds(lambda x=logits, s=sampling: reference_thresholds(x, s), args.repeats)
            old_kept = kept(logits, *sorted_keep_thresholds(logits, sampling))
            new_kept = kept(logits, *keep_thresholds(logits, sampling))
            differ = (old_kept != new_kept).any(dim=1)
            exact = float64_kept_counts(logits[differ], sampling.top_k[differ], 0.9)
            new_is_exact = int((new_kept[differ].sum(dim=1) == exact).sum())
            mean_kept = float(new_kept.sum(dim=1).double().mean())
            print(
                f"| {rows} x {vocab_size} | {label} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x "
                f"| {ref * 1e3:.1f} | {old / ref:.2f}x | {mean_kept:.0f} | {int(differ.sum())} ({new_is_exact}) |"
            )


if __name__ == "__main__":
    main()
