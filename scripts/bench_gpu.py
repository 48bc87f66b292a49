"""The GPU benchmark: every generation path side by side in one process, on the arithmetic task's GRPO groups.

Rows (`--rows`; run in this order, each at every `--sizes` entry, 64x8 = 64 held-out prompts x 8 samples, T = 1):

- `none`: this library's Generator without speculation; `hf_generate`: `model.generate` on left-padded batches
  (TRL without vLLM); `generate_batch`: transformers' continuous batching (paged attention, CUDA graphs as shipped);
- `suffix`, `suffix+draft` (the cascade), `draft`, `ngram` at auto K; `suffix_k4`, `suffix_k2`, `suffix_k1` static;
- a row's variants: `_lockstep` (the host never ahead of the device), `_eager` (no CUDA graphs), `_slots` (the slot
  KV layout), `_compiled` (the graphs capture a compiled forward), `_verify_after` (exact verification after the
  replayed forward instead of inside it), `_split` (a prompt's samples admitted as slots free up, not together);
- `trl`: GRPOTrainer steps with TRL's own generation vs `trl_rollout_func` (once, where TRL is installed);
- `standard`: the field's standard workload, the "nano-vllm benchmark" (once): `--standard-seqs` sequences of random
  token ids, input and output lengths each random in `--standard-lengths` (CUDA 256 and 100-1024), temperature 0.6,
  EOS ignored; tokens/s counts the output tokens, as nano-vllm's does. Its seed and lengths are in the JSON.

Generator rows run two rollouts on one generator (seeds 1, 2): the second drafts from the first's history (a repeat
where the proposer keeps none). Per row: tokens/s in total and per phase, mean K (overall and in the bulk), the bulk's
share of decode steps run ahead of the device (`ahead`), acceptance, ratios to hf_generate,
generate_batch and none of its size, the KV cache, the bulk's share of the memory roofline; on CUDA also the GPU's
idle share of a decode step, syncs per decode step and the peak memory. A failing row records its error and the run
goes on; `--out`/bench_gpu.json is rewritten after each row; the table comes last.

    python scripts/bench_gpu.py                 # CUDA: 64x8 and 256x8, 1024 new tokens, bf16 (8 minutes)
    python scripts/bench_gpu.py --quick         # CUDA: 64x8, the engine with and without graphs first (4 minutes)
    python scripts/bench_gpu.py --device cpu    # the shipped tiny models, 4x2, 32 new tokens (the CI smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import pathlib
import platform
import random
import shlex
import subprocess
import sys
import time
import warnings
from statistics import median

START = time.perf_counter()  # the budget counts from here: imports, model build, compiles and warm-ups included

import torch  # noqa: E402

from rollout import Generator, SamplingParams  # noqa: E402
from rollout.engine.step_timer import forced_steps  # noqa: E402
from rollout.models import zoo  # noqa: E402
from rollout.phases import PHASES, PhaseLabeler, summarize  # noqa: E402
from rollout.tasks import format_prompt, generate_problems  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402

ROWS = ("standard", "none", "none_lockstep", "none_eager", "hf_generate", "generate_batch")
ROWS += ("suffix", "suffix_lockstep", "suffix_eager", "suffix+draft", "draft", "none_compiled")
# the most wanted first: a run short of budget skips the last; *_eager: the same row without CUDA graphs; *_slots:
# on the slot KV layout (the engine before the paged work); *_lockstep: without the host one step ahead
# (async_scheduling=False); *_compiled: the graphs capture the decoder compiled by torch.compile (compile_forward)
ROWS += ("ngram", "suffix_k4", "none_slots", "suffix_slots", "suffix_k2", "suffix_k1", "trl")
# *_verify_after: exact verification after the replayed forward (the engine before it replayed with the forward)
ROWS += ("none_verify_after", "suffix_verify_after")
# *_split: admission as slots free up, a prompt's samples over several prefills (the engine before whole groups)
ROWS += ("none_split",)
QUICK_ROWS = ("standard", "none", "none_lockstep", "none_eager", "suffix", "suffix_lockstep", "suffix_eager")
QUICK_ROWS += ("generate_batch", "hf_generate", "draft", "none_compiled")  # compiling may take minutes: last
DEFAULTS = {  # per device; --quick on CUDA overrides with its own entry
    "cuda": dict(model="tiny-target-1b", draft="tiny-draft-150m", dtype="bfloat16", sizes="64x8,256x8",
                 max_new_tokens=1024, hf_batch_size=512, max_batch_size=1024, budget_s=440.0, row_cap_s=150.0,
                 trl_prompts=8, standard_seqs=256, standard_lengths="100-1024", probe_steps=4),
    # the H100 took 48 s for hf_generate's 512 rows and ran generate_batch to its cap: they come after the engine's
    "quick": dict(sizes="64x8", rows=QUICK_ROWS, budget_s=230.0, row_cap_s=40.0),
    "cpu": dict(model="tiny-target", draft="tiny-draft", dtype="float32", sizes="4x2", max_new_tokens=32,
                hf_batch_size=8, max_batch_size=1024, budget_s=600.0, row_cap_s=120.0, trl_prompts=2,
                standard_seqs=6, standard_lengths="8-40", probe_steps=1),
}  # fmt: skip
TRACE_FIELDS = (  # a row's trace
    "rows",
    "K",
    "tokens emitted",
    "ms",
    "ran ahead",
    "phase (p/b/t)",
    "predicted gain",
    "launch ms",
    "wait ms",
)
PREFILL_TRACE_FIELDS = ("prompts admitted", "first tokens emitted", "ms", "step index in the rollout")
RESERVE_S = 10.0  # of the budget, kept for the table and the JSON
SYNC_WARNING = "synchroniz"  # torch's sync-debug warning reads "called a synchronizing CUDA operation"


# ---- the parts that need CUDA, each with its CPU fallback ------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes moved per second (read + write) by a device-to-device `copy_` of random data: the median of 10 copies
    after 3 warm-ups, timed with CUDA events (CPU: perf_counter)."""
    src = torch.rand(2**28 if device.type == "cuda" else 2**24, device=device)  # 1 GiB: far past L2; never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(10):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(begin.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            start = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - start)
    assert torch.equal(dst, src), "expected the timed copies to copy"
    method = f"{'CUDA events' if device.type == 'cuda' else 'perf_counter'}, median of 10 copies of {src.nbytes} bytes"
    return 2 * src.nbytes / median(seconds), method


def memory_mark(device: torch.device) -> int | None:
    """Resets CUDA's peak-memory counter and returns the bytes allocated now; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_since(device: torch.device, mark: int | None) -> int | None:
    return None if mark is None else torch.cuda.max_memory_allocated(device) - mark


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def sync_debug(device: torch.device):
    """Inside, every synchronising CUDA call warns (`torch.cuda.set_sync_debug_mode`); a no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings():  # the first switch to "warn" in a process warns once itself (seen on the H100)
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def device_busy_us(prof) -> float | None:
    """Microseconds in which the GPU ran a kernel, copy or memset: the profiler's CUDA events, less the
    `record_function` ranges it mirrors onto the GPU timeline (they span gaps). None without any."""
    cuda = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.events() if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]
    return union_length([(e.time_range.start, e.time_range.end) for e in events]) if events else None


def card_name(device: torch.device) -> str:
    if device.type != "cuda":
        return f"CPU {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s)"
    free, total = torch.cuda.mem_get_info(device)
    return f"{torch.cuda.get_device_name(device)}, {total / 2**30:.0f} GiB ({free / 2**30:.0f} free at start)"


# ---- set-up ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CUDA: 64x8 and QUICK_ROWS only, 4 minutes")
    parser.add_argument("--rows", nargs="+", choices=ROWS, help="run in the order given (default: all, as in ROWS)")
    parser.add_argument("--sizes", help="prompts x samples, comma-separated (CUDA 64x8,256x8; CPU 4x2)")
    parser.add_argument("--model", help="zoo name of the target (CUDA tiny-target-1b; CPU tiny-target)")
    parser.add_argument("--draft", help="zoo name of the draft model (CUDA tiny-draft-150m; CPU tiny-draft)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="CUDA bfloat16; CPU float32")
    parser.add_argument("--max-new-tokens", type=int, help="CUDA 1024; CPU 32")
    parser.add_argument("--max-k", type=int, default=4, help="num_speculative_tokens of the auto-K rows")
    parser.add_argument(
        "--kv-layout", choices=("auto", "paged", "slots"), default="auto",
        help="the generator rows' KV layout (auto: paged on a GPU); the *_slots rows always take the slot layout",
    )  # fmt: skip
    parser.add_argument("--max-batch-size", type=int, help="generator slots at most (1024; lowered to fit memory)")
    parser.add_argument("--hf-batch-size", type=int, help="rows per model.generate call (CUDA 512; CPU 8)")
    parser.add_argument("--budget-s", type=float, help="the whole run (CUDA 440, quick 230): rows that won't fit skip")
    parser.add_argument(
        "--row-cap-s", type=float, help="a row's rollouts stop here, marked capped (CUDA 150, --quick 40)"
    )
    parser.add_argument("--probe-steps", type=int, help="decode steps profiled, and sync-counted (CUDA 4; CPU 1)")
    parser.add_argument("--trl-steps", type=int, default=2, help="GRPOTrainer optimiser steps per backend")
    parser.add_argument("--trl-prompts", type=int, help="prompts per TRL step (CUDA 8; CPU 2)")
    parser.add_argument("--standard-seqs", type=int, help="the standard row's sequences (CUDA 256; CPU 6)")
    parser.add_argument("--standard-lengths", help="its input and output lengths, lo-hi (CUDA 100-1024; CPU 8-40)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--commit", help="the git commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--out", default="outputs/bench_gpu", help="folder of bench_gpu.json")
    args = parser.parse_args(argv)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    for key, value in {**DEFAULTS[kind], **(DEFAULTS["quick"] if args.quick and kind == "cuda" else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    args.standard_lengths = tuple(int(x) for x in args.standard_lengths.split("-"))
    return args


def environment(args, device: torch.device, argv: list[str] | None) -> dict:
    """The card, versions, commit and command of the run."""
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    versions["transformers"] = transformers.__version__
    for name in ("triton", "trl", "accelerate"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    commit = args.commit
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(pathlib.Path(__file__).parent)]
        commit = commit or subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        commit += " + uncommitted changes" if dirty and not args.commit else ""
    command = [sys.executable, "scripts/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)]
    return {
        "card": card_name(device),
        "versions": versions,
        "commit": commit or "unknown",
        "command": shlex.join(command),
    }


def load_model(name: str, dtype: torch.dtype, device: torch.device):
    """A zoo model on `device` (built there where `zoo.load_model` takes `device=`)."""
    if "device" in inspect.signature(zoo.load_model).parameters:
        model, tokenizer = zoo.load_model(name, dtype, device=str(device))
    else:
        model, tokenizer = zoo.load_model(name, dtype)
    return model.to(device).eval(), tokenizer


def build_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """The task's held-out prompts as `arithmetic_dataset(n, split="eval", seed=0)` has them, built without
    `datasets` (which a GPU machine may lack)."""
    problems = generate_problems(num_prompts, split="eval", seed=0)
    return [tokenizer(format_prompt(p.problem), add_special_tokens=False)["input_ids"] for p in problems]


def kv_bytes_per_token(model) -> int:
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()


# other engine settings, one config
ROW_VARIANTS = ("_slots", "_eager", "_lockstep", "_compiled", "_verify_after", "_split")


def spec_for(row_id: str, args, draft) -> SpecConfig | None:
    # the same configuration, other engine settings
    for suffix in ROW_VARIANTS:
        row_id = row_id.removesuffix(suffix)
    if row_id == "none":
        return None
    if row_id.startswith("suffix_k"):
        return SpecConfig(method="suffix", num_speculative_tokens=int(row_id.removeprefix("suffix_k")))
    method = {"ngram": "ngram", "suffix": "suffix", "draft": "draft_model", "suffix+draft": ["suffix", "draft_model"]}
    return SpecConfig(
        method=method[row_id],
        model=draft if "draft" in row_id else None,
        num_speculative_tokens=args.max_k,
        num_speculative_tokens_per_batch_size="auto",
    )


def row_label(row_id: str) -> str:
    for suffix in ROW_VARIANTS:
        if row_id.endswith(suffix):
            return f"{row_label(row_id.removesuffix(suffix))} ({suffix[1:]})"
    if row_id.startswith("suffix_k"):
        return f"suffix K={row_id.removeprefix('suffix_k')}"
    return row_id if row_id in ("none", "hf_generate", "generate_batch") else f"{row_id} auto"


# ---- rows ------------------------------------------------------------------------------------------------------------


def hf_generate_row(ctx, row_id: str, prompts: list[list[int]], n: int, deadline: float) -> list[dict]:
    """(a) `model.generate` over left-padded batches of `--hf-batch-size` rows, each prompt repeated n times."""
    model, args, pad, eos = ctx["model"], ctx["args"], ctx["pad_id"], ctx["eos_ids"]
    rows = [p for p in prompts for _ in range(n)]
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=eos)

    def generate(batch: list[list[int]], max_new_tokens: int, max_time: float | None = None) -> list[int]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, max_time=max_time, **sampling)
        return [next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in out[:, width:].tolist()]

    generate(rows[:2], 8)  # warm-up
    torch.manual_seed(1)
    lengths: list[int] = []
    start = time.perf_counter()
    for i in range(0, len(rows), args.hf_batch_size):
        if time.perf_counter() < deadline:
            lengths += generate(rows[i : i + args.hf_batch_size], args.max_new_tokens, deadline - time.perf_counter())
    seconds = time.perf_counter() - start  # .tolist() waited for the device
    return [{"seconds": seconds, "tokens": sum(lengths), "capped": time.perf_counter() >= deadline}]


def generate_batch_row(ctx, row_id: str, prompts: list[list[int]], n: int, deadline: float) -> list[dict]:
    """(b) transformers' continuous batching through the manager `generate_batch` uses (so that a deadline stops it):
    n samples forked from each prompt's prefill; the cache sized as it ships on CUDA, to the workload on a CPU."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, args = ctx["model"], ctx["args"]
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    config = GenerationConfig(
        num_return_sequences=n, eos_token_id=ctx["eos_ids"], pad_token_id=ctx["pad_id"], **sampling
    )
    longest, num_requests = max(len(p) for p in prompts), len(prompts) * n
    hints = WorkloadHints(
        max_prompt_length=longest, max_generated_length=args.max_new_tokens, num_requests=num_requests
    )
    cb = ContinuousBatchingConfig()
    if ctx["device"].type != "cuda":  # sized from free memory it would take most of the host's RAM
        pages = -(-(longest + args.max_new_tokens) // 256)  # 256 tokens a page: the default of 5.17-5.24
        cb = ContinuousBatchingConfig(num_blocks=num_requests * pages + 16, max_batch_tokens=1024)
    attention, results = model.config._attn_implementation, {}  # the manager switches attention; put back below
    try:
        setup = time.perf_counter()
        manager_cm = model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
        )
        with manager_cm as manager:
            setup = time.perf_counter() - setup  # cache allocation and CUDA-graph capture
            torch.manual_seed(1)
            start = time.perf_counter()
            manager.add_requests(inputs=prompts, max_new_tokens=args.max_new_tokens)
            while len(results) < num_requests and time.perf_counter() < deadline:
                result = manager.get_result(timeout=0.05)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
            seconds = time.perf_counter() - start
    finally:
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
    failed = [r.error for r in results.values() if r.error is not None]
    capped = time.perf_counter() >= deadline
    if failed or (len(results) < num_requests and not capped):
        raise RuntimeError(f"{len(failed)} requests failed, {num_requests - len(results)} missing: {failed[:1]}")
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return [{"seconds": seconds, "tokens": tokens, "capped": capped, "setup_seconds": setup}]


def rollout(
    gen: Generator, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], deadline: float
) -> dict:
    """One rollout through the public engine (`add_requests`, then `step` until done or `deadline`), noting for each
    decode step the context of the rows in flight (their prompt and emitted tokens) for the roofline. `params`: shared,
    or one per prompt."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    prompt_of = [len(p) for p, own in zip(prompts, per_prompt) for _ in range(own.n)]  # in queue order: prompt-major
    labeler, steps = PhaseLabeler(0.25), []
    admitted = in_flight_prompt = emitted = finished_tokens = 0
    gen.add_requests(prompts, params)
    start = time.perf_counter()
    with torch.inference_mode():
        while gen.has_unfinished and time.perf_counter() < deadline:
            context = in_flight_prompt + emitted - finished_tokens
            out = gen.step()
            step = out.record.to_dict()
            step["phase"] = labeler.label(step["kind"], step["batch_size"])
            step["context_tokens"] = context if step["kind"] == "decode" else 0
            if step["kind"] == "prefill":  # a prefill emits each admitted sample's first token, in queue order
                in_flight_prompt += sum(prompt_of[admitted : admitted + step["num_emitted"]])
                admitted += step["num_emitted"]
            emitted += step["num_emitted"]
            for done in out.finished:
                in_flight_prompt -= len(prompts[done.prompt_index])
                finished_tokens += len(done.token_ids)
            steps.append(step)
    seconds, capped = time.perf_counter() - start, gen.has_unfinished
    gen.abort()
    return {"seconds": seconds, "tokens": emitted, "steps": steps, "capped": capped}


def step_metrics(steps: list[dict], ctx) -> dict:
    """Per-phase tokens/s, K and acceptance of one rollout's steps, and the bulk's share of the memory roofline."""
    summary = summarize(steps)
    bulk = [s for s in steps if s["phase"] == "bulk"]
    floor = sum(ctx["weight_bytes"] + ctx["kv_per_token"] * s["context_tokens"] for s in bulk) / ctx["bandwidth"]
    bulk_seconds = sum(s["seconds"] for s in bulk)
    decode = [s for s in steps if s["kind"] == "decode"]
    decode_seconds = sum(s["seconds"] for s in decode)
    return {
        "tokens_per_s_per_phase": {p: summary["phases"][p]["tokens_per_s"] for p in PHASES},
        "mean_k": summary["total"]["mean_k"],
        "mean_k_per_phase": {p: summary["phases"][p]["mean_k"] for p in PHASES},
        # decode steps launched before the one before them was read (the host one step ahead), per phase
        "ahead_share_per_phase": {
            p: sum(s.get("ran_ahead", False) for s in steps if s["phase"] == p and s["kind"] == "decode")
            / max(sum(s["phase"] == p and s["kind"] == "decode" for s in steps), 1)
            for p in PHASES
        },
        "acceptance_rate": summary["total"]["acceptance_rate"],
        "roofline_share": floor / bulk_seconds if bulk_seconds else None,
        "proposer_share": sum(s["propose_seconds"] for s in decode) / decode_seconds if decode_seconds else None,
        # the K policy's time over the decode steps' (its choosing is inside a step's seconds, its learning after)
        "policy_share": sum(s["policy_seconds"] for s in decode) / decode_seconds if decode_seconds else None,
        "num_steps": len(steps),
        # every decode step, for reading the K policy's choices against the step times (`TRACE_FIELDS`)
        "trace": [[s["batch_size"], s["num_draft_tokens"], s["num_emitted"], round(1e3 * s["seconds"], 3),
                   int(s.get("ran_ahead", False)), s["phase"][0], round(s.get("predicted_gain") or 0.0, 3),
                   round(1e3 * s.get("launch_seconds", 0.0), 3), round(1e3 * s.get("wait_seconds", 0.0), 3)]
                  for s in decode],
        # every prefill step (an admission: the first, then each refill), `PREFILL_TRACE_FIELDS`
        "prefill_trace": [[s["batch_size"], s["num_emitted"], round(1e3 * s["seconds"], 3), i]
                          for i, s in enumerate(steps) if s["kind"] == "prefill"],
    }  # fmt: skip


def probe(gen: Generator, prompts: list[list[int]], n: int, slots: int, ctx) -> dict:
    """Bulk decode steps of a third rollout (seed 3, after the timed ones): the GPU's idle share under the profiler,
    then device-to-host syncs per step under sync-debug mode. Both None off CUDA."""
    from torch.profiler import ProfilerActivity, profile

    device, num_steps = ctx["device"], ctx["args"].probe_steps
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=ctx["args"].max_new_tokens, seed=3)
    gen.add_requests(prompts[: max(1, slots // n)], params)  # every row in flight at once: a bulk step

    def decode_steps(count: int) -> int:
        done = 0
        while done < count and gen.has_unfinished:
            done += gen.step().record.kind == "decode"
        return done

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        decode_steps(2)  # the prefill and two warm decode steps
        synchronize(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            profiled = decode_steps(num_steps)
            synchronize(device)
            wall_us = (time.perf_counter() - start) * 1e6
        busy_us = device_busy_us(prof)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sync_debug(device):
                counted = decode_steps(num_steps)
    gen.abort()
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    method = f"torch.profiler: 1 - union of CUDA kernel/memcpy/memset intervals / wall, over {profiled} decode steps"
    return {
        "idle_share": 1 - busy_us / wall_us if busy_us is not None and profiled else None,
        "idle_method": f"{method} of {min(slots, len(prompts) * n)} rows (the profiler's overhead included)",
        "syncs_per_step": syncs / counted if device.type == "cuda" and counted else None,
    }


def warm_up(gen: Generator, prompts: list[list[int]], params, spec: SpecConfig | None, decode_steps: int = 3) -> None:
    """Untimed: the timed rollout's own requests (`params`: shared, or one per prompt) up to `decode_steps` decode
    steps, every one fed the largest K, then aborted: the KV cache is allocated and the kernels of the timed prefill
    and of a drafted step are compiled before the clock starts. (A warm-up of 2 prompts compiled other prefill shapes:
    on the H200 the first timed prefill of a fresh process still compiled, 0.4 s of a 2.4 s rollout.) The drafting
    history is cleared after: the first timed rollout drafts from nothing earlier."""
    k = spec.num_speculative_tokens if spec is not None else None
    gen.add_requests(prompts, params)
    decoded = 0
    with torch.inference_mode(), forced_steps(gen, k) if k is not None else contextlib.nullcontext():
        while gen.has_unfinished and decoded < decode_steps:
            decoded += gen.step().record.kind == "decode"
    gen.abort()
    if gen.draft_history is not None:
        gen.draft_history.clear()


def generator_rows(ctx, row_id: str, prompts: list[list[int]], n: int, deadline: float) -> list[dict]:
    """(c)/(d) One generator, two timed rollouts (seeds 1, 2: the second drafts from the first), then the probe."""
    args, device, model = ctx["args"], ctx["device"], ctx["model"]
    if "draft" in row_id and ctx["draft"] is None:
        raise RuntimeError(f"the draft model did not load: {ctx['draft_error']}")
    spec = spec_for(row_id, args, ctx["draft"])
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens
    slots = min(len(prompts) * n, args.max_batch_size)
    layout = "slots" if row_id.endswith("_slots") else args.kv_layout
    if layout == "slots" or (layout == "auto" and device.type != "cuda"):  # a paged pool admits by its blocks
        from rollout.engine.memory_plan import fitting_batch_size

        slots = fitting_batch_size(model, spec, max_seq_len, slots)
    mark, start = memory_mark(device), time.perf_counter()
    graphs = "auto" if not row_id.endswith("_eager") else False
    ahead = "auto" if not row_id.endswith("_lockstep") else False
    gen = Generator(
        model, max_batch_size=slots, max_seq_len=max_seq_len, spec=spec, kv_layout=layout, cuda_graphs=graphs,
        async_scheduling=ahead, compile_forward=row_id.endswith("_compiled") and device.type == "cuda",
    )  # fmt: skip
    if row_id.endswith("_verify_after") and gen.runner.graphs is not None:  # forward-only graphs, verified after
        gen.runner.verify_in_graph = False
        gen.runner.graphs.drop_graphs()  # a new pool: the old one cannot be captured into again
        gen.runner.graphs.capture_all(slots)
    gen.scheduler.whole_groups = not row_id.endswith("_split")
    shared_async = gen.config.async_scheduling
    warm_params = SamplingParams(n=n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    warm_up(gen, prompts, warm_params, spec)
    size = f"{len(prompts)}x{n}"
    if size not in ctx.setdefault("sizes_run", set()):  # the first generator row of a size: one whole rollout, untimed
        # the refills' prefills admit other numbers of prompts than the first: on the H200 the first rollout of the
        # first row at 256 x 8 still compiled kernels for them after the warm-up (1.6 s of 8.4), the rows after not
        rollout(gen, prompts, warm_params, start + 0.4 * (deadline - start))
        if gen.draft_history is not None:
            gen.draft_history.clear()
        ctx["sizes_run"].add(size)
    shared = {"slots": slots, "kv_cache_bytes": gen.kv_cache_bytes, "setup_seconds": time.perf_counter() - start}
    shared["kv_layout"] = gen.runner.kv_layout
    shared["async_scheduling"] = shared_async
    shared["whole_groups"] = gen.scheduler.whole_groups
    graphs = getattr(gen, "graph_runners", [])  # the target's, and a draft model's
    if graphs:
        shared["graphs"] = {
            "captured": sum(len(g.graphs) for g in graphs), "seconds": gen.graph_seconds,
            "memory_bytes": sum(g.memory_bytes for g in graphs),
            "compile_seconds": sum(g.compiled.seconds for g in graphs if g.compiled is not None),
            "compile_error": next((g.compiled.error for g in graphs if g.compiled and g.compiled.error), None),
            "error": next((g.error for g in graphs if g.error), None),
        }  # fmt: skip
    rows = []
    # each rollout its share of the row's time left after the set-up (on the H200 a 35 s set-up once took all of a
    # 60 s row's first share, and the first rollout never started): room for the probe
    begin = time.perf_counter()
    for seed, share in ((1, 0.45), (2, 0.9)):
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed)
        result = rollout(gen, prompts, params, begin + share * (deadline - begin))
        rows.append({"rollout": ("1st", "2nd")[seed - 1], **step_metrics(result.pop("steps"), ctx), **result})
    try:
        shared.update(probe(gen, prompts, n, slots, ctx))
    except Exception as err:  # noqa: BLE001 - the rollouts stand without the probe
        shared["probe_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    del gen
    shared["peak_memory_bytes"] = peak_since(device, mark)
    return [{**row, **shared} for row in rows]


def standard_row(ctx, row_id: str, prompts: None, n: int, deadline: float) -> list[dict]:
    """(f) The nano-vllm benchmark on this library's engine without speculation (graphs as on `none`): random token
    ids, random input and output lengths, EOS ignored, all sequences queued at once."""
    args, model = ctx["args"], ctx["model"]
    rng = random.Random(0)
    low, high = args.standard_lengths
    vocab = min(10_000, model.get_output_embeddings().weight.shape[0] - 1)
    inputs = [[rng.randint(0, vocab) for _ in range(rng.randint(low, high))] for _ in range(args.standard_seqs)]
    outputs = [rng.randint(low, high) for _ in range(args.standard_seqs)]
    params = [SamplingParams(temperature=0.6, max_new_tokens=m, ignore_eos=True, seed=0) for m in outputs]
    start = time.perf_counter()
    gen = Generator(model, max_batch_size=min(len(inputs), args.max_batch_size), max_seq_len=2 * high + 8)
    warm_up(gen, inputs, params, None)
    setup = time.perf_counter() - start
    result = rollout(gen, inputs, params, deadline)
    workload = {"seed": 0, "temperature": 0.6, "input_lengths": [len(p) for p in inputs], "output_lengths": outputs}
    graphs = gen.graph_runners
    del gen
    row = {**step_metrics(result.pop("steps"), ctx), **result, "setup_seconds": setup, "workload": workload}
    row["graphs"] = {"captured": sum(len(g.graphs) for g in graphs)} if graphs else None
    return [row]


def trl_rows(ctx, row_id: str, prompts: None, n: int, deadline: float) -> list[dict]:
    """(e) GRPOTrainer steps with TRL's own generation vs `trl_rollout_func` (suffix, auto K), through
    scripts/bench_trl.py on the GRPO recipe with this run's model, device, dtype and group size."""
    if importlib.util.find_spec("trl") is None:
        raise ImportError("skipped: trl is not installed")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_trl

    from rollout.cli.recipe import load_recipe
    from rollout.integrations.trl import trl_rollout_func

    args = ctx["args"]
    recipe = load_recipe(
        str(pathlib.Path(__file__).parents[1] / "recipes" / "grpo_quickstart.yaml"),
        [f"train.steps={args.trl_steps}", f"train.prompts_per_step={args.trl_prompts}", f"sampling.n={n}",
         f"sampling.max_new_tokens={args.max_new_tokens}", f"data.num_prompts={2 * args.trl_prompts}",
         f"model.name={args.model}", f"model.device={args.device}", f"model.dtype={args.dtype}",
         "logging.wandb_mode=disabled", f"output_dir={pathlib.Path(args.out) / 'trl'}"],
    )  # fmt: skip
    spec = SpecConfig(method="suffix", num_speculative_tokens=args.max_k, num_speculative_tokens_per_batch_size="auto")
    rows = []
    for name, func in (("TRL generate", None), ("trl_rollout_func suffix auto", trl_rollout_func(spec=spec))):
        if time.perf_counter() >= deadline:
            raise TimeoutError(f"the row's time ran out before {name}")
        r = bench_trl.run(name, func, recipe)
        tokens = round(r["completion_tokens"] * args.trl_prompts * n)  # completions per optimiser step
        rows.append({"rollout": name, "name": f"trl: {name}", "seconds": r["generation_seconds"], "tokens": tokens,
                     "step_seconds": r["step_seconds"], "reward": r["reward"]})  # fmt: skip
    return rows


# ---- the run ---------------------------------------------------------------------------------------------------------


def run_unit(ctx, rows: list[dict], row_id: str, size: tuple[int, int] | None, prompts) -> None:
    """One row (two for a generator or TRL), skipped when the median time of this size's rows so far does not fit
    the budget left, capped at `--row-cap-s`, its error recorded; the JSON is rewritten after it."""
    args = ctx["args"]
    size_name = f"{size[0]}x{size[1]}" if size else row_id
    base = {"id": row_id, "size": size_name, "rollout": "1st"}
    once = {"trl": "trl: GRPOTrainer steps", "standard": f"standard: {args.standard_seqs} random sequences"}
    base["name"] = f"{size_name} {row_label(row_id)}" if size else once[row_id]
    left = args.budget_s - (time.perf_counter() - ctx["start"]) - RESERVE_S
    took = [r["unit_seconds"] for r in rows if r["size"] == size_name and "unit_seconds" in r]
    estimate = median(took) if took else None
    print(f"{base['name']}: {left:.0f} s of the budget left, estimate {fmt(estimate, '.0f')} s", flush=True)
    start = time.perf_counter()
    try:
        if left <= 0 or (estimate is not None and estimate > left):
            raise TimeoutError(f"skipped: estimated {fmt(estimate, '.0f')} s, {max(left, 0):.0f} s of the budget left")
        deadline = start + min(args.row_cap_s, left)
        row_fn = {"hf_generate": hf_generate_row, "generate_batch": generate_batch_row, "trl": trl_rows}
        row_fn["standard"] = standard_row
        mark = memory_mark(ctx["device"])
        n = size[1] if size else args.sizes[0][1]
        new = row_fn.get(row_id, generator_rows)(ctx, row_id, prompts, n, deadline)
        for row in new:
            row.setdefault("peak_memory_bytes", peak_since(ctx["device"], mark))
            row.setdefault("name", f"{base['name']} {row['rollout']}" if "rollout" in row else base["name"])
        new = [{**base, **row} for row in new]
    except Exception as err:  # noqa: BLE001 - a failing row is recorded and the run goes on
        new = [{**base, "error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}]
    release_memory(ctx["device"])
    for row in new:
        row["unit_seconds"] = time.perf_counter() - start
        seconds = row.get("seconds")
        row["tokens_per_s"] = row["tokens"] / seconds if row.get("tokens") and seconds else None
        outcome = row.get("error") or f"{fmt(row['tokens_per_s'], '.0f')} tokens/s"
        print(f"    {row['name']}: {outcome}", flush=True)
    rows += new
    add_ratios(rows)
    path = pathlib.Path(args.out) / "bench_gpu.json"
    path.with_suffix(".tmp").write_text(json.dumps({"header": ctx["header"], "rows": rows}, indent=1) + "\n")
    os.replace(path.with_suffix(".tmp"), path)  # a run killed later keeps every row finished by now
    print(f"    took {time.perf_counter() - start:.1f} s", flush=True)


def add_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over (a) hf_generate, (b) generate_batch and (c) none of its size (none: the rollout of the
    same number); TRL's rows over TRL's own generation, as their `vs_hf_generate`."""
    for row in rows:
        for key, ref_id in (("vs_hf_generate", "hf_generate"), ("vs_generate_batch", "generate_batch"),
                            ("vs_none", "none")):  # fmt: skip
            if row["size"] == "trl":
                refs = [r for r in rows if r["size"] == "trl" and r["rollout"] == "TRL generate" and key[3] == "h"]
            else:
                refs = [r for r in rows if r["id"] == ref_id and r["size"] == row["size"]]
                refs = [r for r in refs if r["rollout"] == row["rollout"]] or [r for r in refs if r["rollout"] == "1st"]
            refs = [r for r in refs if r.get("tokens_per_s")]
            row[key] = row["tokens_per_s"] / refs[0]["tokens_per_s"] if refs and row.get("tokens_per_s") else None


def fmt(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def format_table(rows: list[dict]) -> str:
    """The rows by size, then in the order of ROWS (a size's first and second rollouts together)."""
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    rows = sorted(rows, key=lambda r: (sizes.index(r["size"]), ROWS.index(r["id"])))
    head = f"{'row':34s}{'seconds':>8s}{'tok/s':>8s}{'prefill':>8s}{'bulk':>8s}{'tail':>8s}{'K':>5s}{'K bulk':>7s}"
    head += f"{'ahead':>6s}{'accept':>7s}{'prop.':>6s}"
    lines = [head + f"{'x hf':>6s}{'x cb':>6s}{'x none':>7s}{'idle':>6s}{'syncs':>6s}{'KV GiB':>7s}{'peak GiB':>9s}"]
    lines[0] += f"{'roofl.':>7s}{'took':>6s}  note"
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:34s}  {r['error']}")
            continue
        phase = r.get("tokens_per_s_per_phase") or {}
        note = "capped: stopped at --row-cap-s or the budget" if r.get("capped") else r.get("probe_error", "")
        if "step_seconds" in r:
            note = f"generation {r['seconds']:.2f} s and optimiser step {r['step_seconds']:.2f} s, per step"
        lines.append(
            f"{r['name']:34s}{r['seconds']:8.2f}{fmt(r['tokens_per_s'], '.0f'):>8s}"
            + "".join(f"{fmt(phase.get(p), '.0f'):>8s}" for p in PHASES)
            + f"{fmt(r.get('mean_k')):>5s}{fmt((r.get('mean_k_per_phase') or {}).get('bulk')):>7s}"
            + f"{fmt((r.get('ahead_share_per_phase') or {}).get('bulk'), '.0%'):>6s}"
            + f"{fmt(r.get('acceptance_rate'), '.3f'):>7s}"
            + f"{fmt(r.get('proposer_share'), '.0%'):>6s}{fmt(r['vs_hf_generate']):>6s}"
            + f"{fmt(r['vs_generate_batch']):>6s}{fmt(r['vs_none']):>7s}{fmt(r.get('idle_share'), '.0%'):>6s}"
            + f"{fmt(r.get('syncs_per_step'), '.1f'):>6s}{fmt(r.get('kv_cache_bytes'), '.2f', 2**-30):>7s}"
            + f"{fmt(r.get('peak_memory_bytes'), '.2f', 2**-30):>9s}{fmt(r.get('roofline_share'), '.1%'):>7s}"
            + f"{r['unit_seconds']:6.1f}  {note}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns what it wrote to `--out`/bench_gpu.json ({"header", "rows"})."""
    start = START if argv is None else time.perf_counter()  # from the script's imports, or from an in-process call
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype, device)
    ctx = {"args": args, "device": device, "model": model, "start": start}
    ctx["draft"] = ctx["draft_error"] = None
    try:
        ctx["draft"] = load_model(args.draft, dtype, device)[0]
    except Exception as err:  # noqa: BLE001 - only the rows that draft with it fail
        ctx["draft_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    eos = model.generation_config.eos_token_id
    ctx["eos_ids"] = [eos] if isinstance(eos, int) else list(eos or [])
    ctx["pad_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ctx["eos_ids"][0]
    ctx["bandwidth"], method = copy_bandwidth(device)
    release_memory(device)
    ctx["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    ctx["kv_per_token"] = kv_bytes_per_token(model)
    ctx["header"] = header = {
        **environment(args, device, argv), "model": args.model, "draft": args.draft, "dtype": args.dtype,
        "sizes": [f"{p}x{n}" for p, n in args.sizes], "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
        "max_k": args.max_k, "threads": args.threads, "budget_s": args.budget_s, "row_cap_s": args.row_cap_s,
        "copy_bandwidth_bytes_per_s": ctx["bandwidth"], "copy_bandwidth_method": method,
        "weight_bytes": ctx["weight_bytes"], "kv_bytes_per_token": ctx["kv_per_token"],
        "roofline": "bulk steps: (target weights + KV bytes per token x rows' summed context) / copy bandwidth, "
        "over the steps' summed time",
        "trace_fields": TRACE_FIELDS,
        "prefill_trace_fields": PREFILL_TRACE_FIELDS,
        "warm_up": "untimed, each generator row: its own requests up to 3 decode steps at the largest K, aborted; "
        "the first generator row of a size: then one whole rollout (seed 0)",
    }  # fmt: skip
    print("\n".join(f"{key}: {value}" for key, value in header.items()), flush=True)
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(tokenizer, max(p for p, _ in args.sizes))
    rows: list[dict] = []
    # what lives through every row (modules, the models) leaves the collector's scans: each row's release_memory
    # scanned it all, 0.26 s a collection on a CPU, 7.6 of the CPU run's 40 s. Unfrozen after, for the exit to free
    # it as usual (frozen, triton's bindings report leaks)
    gc.freeze()
    try:
        for row_id in (r for r in (args.rows or ROWS) if r != "trl"):  # by row, as listed: a short budget skips
            if row_id == "standard":  # its own workload, once
                run_unit(ctx, rows, row_id, None, None)
                continue
            for size in args.sizes:  # the least wanted rows at every size, not every row of the last size
                run_unit(ctx, rows, row_id, size, prompts[: size[0]])
        if "trl" in (args.rows or ROWS):
            run_unit(ctx, rows, "trl", None, None)
    finally:
        gc.unfreeze()
    print(f"\n{header['card']} | {args.model} + {args.draft} in {args.dtype} | commit {header['commit']}")
    print(
        f"{header['command']}\nwhole run {time.perf_counter() - ctx['start']:.0f} s; JSON {args.out}/bench_gpu.json\n"
    )
    print(format_table(rows), flush=True)
    return {"header": header, "rows": rows}


if __name__ == "__main__":
    main()
