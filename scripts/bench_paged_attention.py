"""Paged attention on its own: the kernel's time and KV bandwidth at the engine's shapes, per variant, side by side.

Shapes are `tiny-target-1b`'s (32 query heads, 8 KV heads, head dim 64, bf16, 16-token pages): a bulk decode step (175
rows at 263 keys), its verification (K = 4), a tail step (8 rows at 2k keys) and its verification, and a prefill. Each
variant runs eagerly once against the torch reference (relative error), then is captured in a CUDA graph (which also
shows the split path captures) whose replays are timed with CUDA events: warm-ups first, the median of the repeats,
rotating among input sets so that the KV is read from memory, not from L2. Variants: `page tiles` (16-key tiles, one
program a row and KV head: the kernel as it was before tiles left the page size), `64-key tiles` (one split), `auto`
(tiles and splits chosen by the launcher), `auto, 128 keys` (the launcher's splits over 128-key tiles).

    python scripts/bench_paged_attention.py                 # CUDA (about a minute)
    python scripts/bench_paged_attention.py --device cpu    # the Triton interpreter, tiny shapes (a smoke test)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from rollout_kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402

# name: rows, committed keys a row, new tokens a row (S)
CASES = {
    "bulk decode": (175, 263, 1),
    "bulk verify K=4": (175, 263, 5),
    "tail decode": (8, 2048, 1),
    "tail verify K=4": (8, 2048, 5),
    "prefill": (4, 0, 512),
}
VARIANTS = {
    "page tiles": dict(block_n=16, num_splits=1),
    "64-key tiles": dict(block_n=64, num_splits=1),
    "auto": {},
    "auto, 128 keys": dict(block_n=128),
}


def median_ms(fn, device: torch.device, num_warmup: int = 10, num_repeats: int = 50) -> float:
    """Median milliseconds of `fn()`: CUDA events around each call after `num_warmup` calls (CPU: perf_counter)."""
    for _ in range(num_warmup):
        fn()
    times = []
    for _ in range(num_repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph: returns (replay, the output tensor the replays write). Off CUDA, `fn` itself."""
    if device.type != "cuda":
        return fn, None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up: compiles outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def make_inputs(rows: int, cache_len: int, S: int, shape: tuple, device: torch.device, dtype, seed: int) -> dict:
    """Random queries and pools (never zeros), each row's pages scattered through the pool."""
    num_heads, num_kv_heads, head_dim, page = shape
    gen = torch.Generator().manual_seed(seed)
    pages = -(-(cache_len + S) // page)
    num_blocks = rows * pages + 1
    tables = torch.randperm(num_blocks, generator=gen)[: rows * pages].view(rows, pages)
    pool = (num_blocks, page, num_kv_heads, head_dim)
    longs = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return dict(
        query=torch.randn(rows, S, num_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2),
        k_pool=torch.randn(pool, generator=gen).to(device, dtype),
        v_pool=torch.randn(pool, generator=gen).to(device, dtype),
        block_tables=tables.to(device),
        cache_lens=longs([cache_len] * rows),
        query_start=longs([0] * rows),
        num_queries=longs([S] * rows),
    )


def time_variant(sets: list[dict], scale: float, options: dict, expected: torch.Tensor, device) -> tuple[float, float]:
    """(median ms of a graph replay, rotating among `sets`; relative error of the eager call on the first set)."""
    out = paged_attention(**sets[0], scale=scale, **options)
    error = float((out.double() - expected).norm() / expected.norm())
    calls = [
        graphed(lambda inputs=inputs: paged_attention(**inputs, scale=scale, **options), device) for inputs in sets
    ]
    if calls[0][1] is not None:
        calls[0][0]()
        assert torch.equal(calls[0][1], out), f"{options}: a graph replay differs from the eager call"
    turn = [0]

    def replay_next() -> None:
        calls[turn[0] % len(calls)][0]()
        turn[0] += 1

    repeats = dict(num_warmup=1, num_repeats=3) if device.type == "cpu" else {}
    return median_ms(replay_next, device, **repeats), error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--input-sets", type=int, default=4, help="input sets the timed calls rotate among")
    args = parser.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    shape = (4, 2, 16, 16) if cpu else (32, 8, 64, 16)  # heads, KV heads, head dim, page
    dtype = torch.float32 if cpu else torch.bfloat16
    print(f"device {torch.cuda.get_device_name(device) if not cpu else 'cpu (interpreter)'}, torch {torch.__version__}")
    print(f"{'case':18} {'variant':16} {'ms':>8} {'GB/s':>8} {'rel err':>9}")
    for name, (rows, cache_len, S) in CASES.items():
        if cpu:
            rows, cache_len, S = min(rows, 2), min(cache_len, 40), min(S, 8)
        sets = [make_inputs(rows, cache_len, S, shape, device, dtype, seed) for seed in range(args.input_sets)]
        kv_bytes = 2 * rows * (cache_len + S) * shape[1] * shape[2] * sets[0]["k_pool"].element_size()
        scale = shape[2] ** -0.5
        expected = paged_attention_ref(
            **{k: v.double() if v.is_floating_point() else v for k, v in sets[0].items()}, scale=scale
        )
        for variant, options in VARIANTS.items():
            ms, error = time_variant(sets, scale, options, expected, device)
            print(f"{name:18} {variant:16} {ms:8.4f} {kv_bytes / ms / 1e6:8.1f} {error:9.2e}")


if __name__ == "__main__":
    main()
