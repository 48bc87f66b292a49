"""Where a bulk decode step's time goes, and what replaying its forward as a CUDA graph would save.

One process, one device. A rollout of the task's prompts (`--prompts` x `--n` rows) is stepped `--warm-steps` decode
steps into its bulk; then, on the rows in flight:

- `step`: the wall time of whole `Generator.step()` calls (no speculation; CUDA graphs as the engine's default),
  median of `--repeats`;
- `profile`: three such steps under the torch profiler: kernels launched per step, the GPU's busy share, and the
  kernels that took the most time;
- `forward`: the bare model forward of a decode (width 1) and of a K = 4 verification (width 5) at `--tail-rows`
  rows and at 64, eager (host launch time, and device time by CUDA events) against the same forward captured once as
  a CUDA graph and replayed; the replayed logits are compared with the eager ones bit for bit.

Graph capture needs CUDA: on a CPU the script runs the eager parts at small sizes (a smoke test). The KV pool holds
the rollout's real keys and values; no timing runs on zeros.

    python scripts/probe_step.py --out outputs/probe_step           # CUDA: tiny-target-1b, bf16, 512 rows
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from statistics import median

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_gpu import build_prompts, device_busy_us, load_model, synchronize  # noqa: E402

from rollout import Generator, SamplingParams  # noqa: E402
from rollout.engine.attention import paged_attention_for  # noqa: E402
from rollout.engine.step_batch import StepBatch  # noqa: E402


def parse_args(argv):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--model", default="tiny-target-1b" if cuda else "tiny-target")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--prompts", type=int, default=64 if cuda else 4)
    parser.add_argument("--n", type=int, default=8 if cuda else 2)
    parser.add_argument("--warm-steps", type=int, default=128 if cuda else 4)
    parser.add_argument("--repeats", type=int, default=10 if cuda else 2)
    parser.add_argument("--tail-rows", type=int, default=64 if cuda else 2)
    parser.add_argument("--out", default="outputs/probe_step")
    return parser.parse_args(argv)


def timed(fn, device, repeats):
    """(median host ms to return from fn, median device ms by CUDA events or host ms off CUDA, last output)."""
    host, dev, out = [], [], None
    for _ in range(repeats):
        synchronize(device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        out = fn()
        host.append((time.perf_counter() - start) * 1e3)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            dev.append(begin.elapsed_time(end))
        else:
            dev.append(host[-1])
    return median(host), median(dev), out


def forward_probe(gen, num_rows, width, device, repeats):
    """The bare forward of `num_rows` rows feeding `width` tokens each (the pending one and width - 1 stand-ins for
    drafts), eager against a replayed CUDA graph."""
    model, cache = gen.runner.model, gen.runner.cache
    lens = gen.slots.cache_len[:num_rows].clone()
    pending = gen.slots.pending(num_rows)[:, None]
    ids = torch.cat([pending] + [pending] * (width - 1), 1).to(device)  # stand-in drafts: real tokens, any will do
    step = cache.prepare(StepBatch.build(0, ids, lens, torch.zeros_like(lens), torch.full_like(lens, width)))
    positions = (lens[:, None] + torch.arange(width)[None, :]).to(device)

    def forward():
        with paged_attention_for(model):
            return model(input_ids=ids, position_ids=positions, use_cache=False, rollout_step=step).logits

    with torch.inference_mode():
        host, dev, eager = timed(forward, device, repeats)
        result = {"rows": num_rows, "width": width, "eager_host_ms": host, "eager_device_ms": dev}
        if device.type != "cuda":
            return result
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = forward()
        except Exception as err:  # noqa: BLE001 - what stops a capture is the finding
            result["graph_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:400]
            return result
        g_host, g_dev, _ = timed(graph.replay, device, repeats)
        result.update(graph_host_ms=g_host, graph_device_ms=g_dev, graph_equal=bool(torch.equal(static_out, eager)))
        result["graph_max_abs_diff"] = float((static_out.float() - eager.float()).abs().max())
        del graph, static_out
    return result


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype, device)
    prompts = build_prompts(tokenizer, args.prompts)
    rows = args.prompts * args.n
    gen = Generator(model, max_batch_size=rows, max_seq_len=max(map(len, prompts)) + 1024, kv_layout="paged")
    gen.add_requests(prompts, SamplingParams(n=args.n, temperature=1.0, max_new_tokens=1024, seed=1))
    report = {"model": args.model, "dtype": args.dtype, "device": str(device), "kv_layout": gen.runner.kv_layout}
    graphs = gen.runner.graphs
    if graphs is not None:  # the engine's own graphs (the decode steps timed below replay them)
        report["graphs"] = {"captured": len(graphs.graphs), "seconds": graphs.capture_seconds}
        report["graphs"].update(memory_bytes=graphs.memory_bytes, error=graphs.error)
    if device.type == "cuda":
        report["card"] = torch.cuda.get_device_name(device)
    report["torch"] = torch.__version__
    with torch.inference_mode():
        decode = 0
        while decode < args.warm_steps and gen.has_unfinished:
            decode += gen.step().record.kind == "decode"
        report["rows_in_flight"] = gen.num_active
        report["mean_context"] = float(gen.slots.cache_len[: gen.num_active].float().mean())
        report["setup_s"] = time.perf_counter() - start
        walls = []
        for _ in range(args.repeats):
            begin = time.perf_counter()
            gen.step()
            synchronize(device)
            walls.append((time.perf_counter() - begin) * 1e3)
        report["step_wall_ms"] = median(walls)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        synchronize(device)
        with profile(activities=activities) as prof:
            begin = time.perf_counter()
            for _ in range(3):
                gen.step()
            synchronize(device)
            wall_us = (time.perf_counter() - begin) * 1e6
    busy = device_busy_us(prof)
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.events() if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]
    report["profile"] = {"kernels_per_step": len(kernels) / 3, "busy_share": busy / wall_us if busy else None}
    totals: dict[str, float] = {}
    for e in kernels:
        totals[e.name] = totals.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 3
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    report["profile"]["top_kernels_us_per_step"] = [[name[:90], round(us, 1)] for name, us in top]
    n = gen.num_active
    report["forward"] = []
    for num_rows in (n, min(args.tail_rows, n)):
        for width in (1, 5):
            result = forward_probe(gen, num_rows, width, device, args.repeats)
            print(json.dumps(result), flush=True)
            report["forward"].append(result)
    gen.abort()
    report["seconds"] = time.perf_counter() - start
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_step.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "forward"}, indent=1))
    return report


if __name__ == "__main__":
    main()
