"""Exact verification's cost per drafted depth, on its own, at a real vocabulary (issue 42: at most 0.1 ms per drafted
depth at 175 rows).

    python3 scripts/bench_verify.py --out OUT          # on a GPU: 175 and 512 rows, widths 1-5, vocab 128256, bf16
    PYTHONPATH=. .venv/bin/python scripts/bench_verify.py --device cpu --rows 3 --vocab 1271 --repeats 3   # a check

Two paths, each as the engine runs it after a speculative step's forward, on random logits `[rows * width, vocab]`
(never zeros) in the model's dtype, every draft accepted (the race's own tokens):

- `chains`: `specdec.verify.verify_padded_chains`, what a replayed step verifies with (one race over every cell of
  `[rows, width]`, then the chains' walk); on a GPU timed as a replayed CUDA graph, and eagerly beside it;
- `filtered`: `verify_exact` with top-k 50 and top-p 0.95 (the keep thresholds, then the race), what a step whose rows
  filter runs eagerly after the forward.

Per width W: the median milliseconds of one verification (CUDA events around each call or replay on a GPU, after a
warm-up; perf_counter on a CPU), each call on the next of several input sets (one set would sit in the L2 cache);
per drafted depth: (t(W) - t(1)) / (W - 1). The floor beside them: the logits read once, `rows * vocab * itemsize`
bytes a depth, over the bandwidth a device copy measures. Before timing, each shape's replay is checked against its
eager call (the same tokens and log-probs, bit for bit) and the chains against `verify_exact` (the same tokens).
Writes `bench_verify.json` under `--out` (again after every shape: a run its time limit stops keeps what it measured)
and prints the table last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import shlex
import subprocess
import sys

import torch
from bench_gpu import card_name, copy_bandwidth  # this folder is on sys.path when a script runs
from bench_paged_attention import median_ms

from specdec.processing import RowSampling
from specdec.tree import layout_drafts
from specdec.verify import RaceKeys, verify_exact, verify_padded_chains

TIMED = ("chains_graph_ms", "chains_eager_ms", "filtered_eager_ms")  # each record's times, in ms
NUM_INPUT_SETS = 4  # inputs rotated call by call: 4 x 45 MB (175 rows x 128256 x bf16) is past an H200's 50 MB of L2


def make_inputs(rows: int, width: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """One input set: logits (random, scaled to a peaked distribution), drafts, temperatures and race keys."""
    generator = torch.Generator(device).manual_seed(seed)  # drawn where they are used: 0.6 GB a set at 512 x 5
    logits = (torch.randn(rows * width, vocab, generator=generator, device=device) * 4).to(dtype)
    token_ids = torch.randint(0, vocab, (rows, width), generator=generator, device=device)
    race = RaceKeys(
        torch.randint(0, 2**62, (rows,), generator=generator, device=device),
        torch.randint(0, 1000, (rows,), generator=generator, device=device),
    )
    return {"logits": logits, "token_ids": token_ids, "race": race}


def accept_all(inputs: dict, temperatures: torch.Tensor) -> None:
    """Make the drafts the race's own tokens (cell j + 1 holds what the race draws at cell j): every draft accepted,
    so that the checks compare whole chains. A verification shows the draws of its emitted cells only, so each pass
    accepts one more draft of every row."""
    token_ids = inputs["token_ids"]
    for _ in range(token_ids.shape[1] - 1):
        token_ids[:, 1:] = chains(inputs, temperatures).output_token_ids[:, :-1]


def chains(inputs: dict, temperatures: torch.Tensor):
    return verify_padded_chains(inputs["logits"], inputs["token_ids"], temperatures, inputs["race"])


def filtered(inputs: dict, sampling: RowSampling, width: int):
    rows = inputs["token_ids"].shape[0]
    layout = layout_drafts([width - 1] * rows, None)
    return verify_exact(inputs["logits"], inputs["token_ids"].reshape(-1), layout, sampling, inputs["race"])


def timed(calls: list, device: torch.device, repeats: int) -> float:
    """Median milliseconds of one call, the calls taken in turn (`repeats` of them after one round of warm-up)."""
    turn = itertools.cycle(calls)
    return median_ms(lambda: next(turn)(), device, num_warmup=len(calls), num_repeats=repeats)


def captured(inputs: dict, temperatures: torch.Tensor):
    """`chains` on `inputs` captured as a CUDA graph: (replay, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the warm-up a capture needs, on a side stream
        chains(inputs, temperatures)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chains(inputs, temperatures)
    return graph.replay, out


def measure_shape(rows: int, width: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    sets = [make_inputs(rows, width, args.vocab, dtype, device, 1000 * rows + 10 * width + s) for s in range(args.sets)]
    temperatures = torch.ones(rows, device=device)
    top_k, top_p = torch.full((rows,), 50, device=device), torch.full((rows,), 0.95, device=device)
    sampling = RowSampling(temperatures, top_k, top_p, True, False, False)
    plain = RowSampling(temperatures, torch.zeros_like(top_k), torch.ones_like(top_p), False, False, False)
    for inputs in sets:
        accept_all(inputs, temperatures)
    eager = chains(sets[0], temperatures)
    assert bool((eager.num_emitted == width).all()), "expected every draft accepted"
    reference = filtered(sets[0], plain, width)  # the engine's eager verification, without filters
    for name in ("num_emitted", "output_token_ids"):
        assert torch.equal(getattr(eager, name), getattr(reference, name)), f"the chains' {name} are not verify_exact's"
    record = {"rows": rows, "width": width}
    record["chains_eager_ms"] = timed([lambda s=s: chains(s, temperatures) for s in sets], device, args.repeats)
    record["chains_graph_ms"] = None
    if device.type == "cuda":
        replays = [captured(s, temperatures) for s in sets]
        replays[0][0]()
        torch.cuda.synchronize()
        again = chains(sets[0], temperatures)
        for name in ("output_token_ids", "num_emitted", "logprobs"):
            assert torch.equal(getattr(replays[0][1], name), getattr(again, name)), f"the replay's {name} differ"
        record["chains_graph_ms"] = timed([replay for replay, _ in replays], device, args.repeats)
    record["filtered_eager_ms"] = timed([lambda s=s: filtered(s, sampling, width) for s in sets], device, args.repeats)
    return record


def per_depth(records: list[dict], key: str) -> dict[int, float | None]:
    """For each rows: (t(W) - t(1)) / (W - 1) at the widest W measured, from the records' `key`."""
    out = {}
    for rows in sorted({r["rows"] for r in records}):
        mine = {r["width"]: r[key] for r in records if r["rows"] == rows and r[key] is not None}
        widest = max(mine, default=1)
        out[rows] = (mine[widest] - mine[1]) / (widest - 1) if 1 in mine and widest > 1 else None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[175, 512])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="K + 1; must include 1")
    parser.add_argument("--vocab", type=int, default=128256, help="tiny-target-1b's, Llama-3.2-1B's")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sets", type=int, default=NUM_INPUT_SETS, help="input sets rotated call by call")
    parser.add_argument("--commit", default=None, help="the commit, where the tree travels without .git")
    parser.add_argument("--out", default=".", help="folder for bench_verify.json")
    args = parser.parse_args(argv)
    if 1 not in args.widths:
        parser.error("--widths must include 1 (a step without drafts: the base of the per-depth cost)")
    torch.set_num_threads(1)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth, method = copy_bandwidth(device)
    commit = args.commit
    if commit is None:
        here = pathlib.Path(__file__).parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
        commit = commit or "unknown"
    command = [sys.executable, "scripts/bench_verify.py", *(sys.argv[1:] if argv is None else argv)]
    depth_bytes = {rows: rows * args.vocab * torch.empty(0, dtype=dtype).element_size() for rows in args.rows}
    header = {
        "card": card_name(device), "versions": {"torch": torch.__version__}, "commit": commit,
        "command": shlex.join(command), "vocab": args.vocab, "dtype": args.dtype, "repeats": args.repeats,
        "input_sets": args.sets, "copy_bandwidth_bytes_per_s": bandwidth, "copy_bandwidth_method": method,
        "floor_ms_per_depth": {rows: 1e3 * b / bandwidth for rows, b in depth_bytes.items()},
    }  # fmt: skip
    try:
        import triton

        header["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    records = []
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for rows in args.rows:
        for width in sorted(args.widths):
            records.append(measure_shape(rows, width, args, device, dtype))
            print(json.dumps(records[-1]), flush=True)
            summary = {f"{key}_per_depth_ms": per_depth(records, key) for key in TIMED}
            # written after every shape: a run its time limit stops keeps the shapes it measured
            report = {"header": header, "records": records, **summary}
            (out / "bench_verify.json").write_text(json.dumps(report, indent=1))
    print("\n".join(f"{key}: {value}" for key, value in header.items()))
    print(
        f"\nms per verification, median of {args.repeats} ({args.dtype} logits, vocab {args.vocab}): {header['card']}"
    )
    print(f"{'rows':>5s}{'width':>6s}{'chains, graph':>15s}{'chains, eager':>15s}{'filtered, eager':>17s}")
    fmt = lambda x: f"{x:.3f}" if x is not None else "n/a"  # noqa: E731
    for r in records:
        line = f"{r['rows']:5d}{r['width']:6d}{fmt(r['chains_graph_ms']):>15s}{fmt(r['chains_eager_ms']):>15s}"
        print(line + f"{fmt(r['filtered_eager_ms']):>17s}")
    print("ms per drafted depth, (t(W) - t(1)) / (W - 1), against the floor (the logits read once):")
    for rows in args.rows:
        parts = [f"{name} {fmt(summary[key][rows])}" for name, key in (
            ("chains graph", "chains_graph_ms_per_depth_ms"), ("chains eager", "chains_eager_ms_per_depth_ms"),
            ("filtered eager", "filtered_eager_ms_per_depth_ms"))]  # fmt: skip
        print(f"{rows:5d} rows: " + ", ".join(parts) + f"; floor {header['floor_ms_per_depth'][rows]:.4f}")


if __name__ == "__main__":
    main()
