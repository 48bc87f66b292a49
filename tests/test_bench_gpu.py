"""scripts/bench_gpu.py, the GPU benchmark, at its CPU defaults: every row runs, the JSON holds each with a finite
tokens/s, and the table comes last. (On CUDA the same code paths run at full size; only the CUDA-only measurements
are n/a here.)"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_defaults_run_every_row_and_print_the_table_last(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    header, rows = report["header"], report["rows"]
    for key in ("card", "versions", "commit", "command", "copy_bandwidth_bytes_per_s", "kv_bytes_per_token"):
        assert header[key], f"expected the header to hold {key}"
    assert header["versions"]["torch"] and header["versions"]["transformers"]

    module = load_script()
    has_trl = importlib.util.find_spec("trl") is not None
    import transformers

    # the continuous-batching API the row calls came after transformers 5.0 (the oldest supported)
    has_batching = hasattr(transformers, "ContinuousBatchingConfig")
    by_id = {row_id: [r for r in rows if r["id"] == row_id] for row_id in module.ROWS}
    for row_id, found in by_id.items():
        assert found, f"expected a row {row_id!r} in the JSON"
        if row_id == "trl" and not has_trl:
            assert found[0]["error"].startswith("ImportError: skipped"), found[0]
            continue
        if row_id == "generate_batch" and not has_batching:
            assert found[0]["error"].startswith("ImportError"), found[0]
            continue
        for row in found:
            assert "error" not in row, row
            assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
            assert row["unit_seconds"] > 0
    for row_id in ("none", "suffix", "suffix+draft", "draft", "suffix_k4", "ngram", "suffix_k2", "suffix_k1"):
        first, second = by_id[row_id]
        assert (first["rollout"], second["rollout"]) == ("1st", "2nd")
        assert set(first["tokens_per_s_per_phase"]) == {"prefill", "bulk", "tail"}
        assert set(first["mean_k_per_phase"]) == set(first["ahead_share_per_phase"]) == {"prefill", "bulk", "tail"}
        assert set(first["ahead_share_per_phase"].values()) == {0.0}  # a CPU runs in lockstep
        trace = first["trace"]  # every decode step, as header["trace_fields"] names its entries
        assert trace and all(len(step) == len(header["trace_fields"]) for step in trace)
        assert sum(step[2] for step in trace) <= first["tokens"] and {step[5] for step in trace} <= {"b", "t"}
        prefills = first["prefill_trace"]  # every admission, as header["prefill_trace_fields"] names its entries
        assert prefills and all(len(step) == len(header["prefill_trace_fields"]) for step in prefills)
        assert prefills[0][3] == 0 and len(prefills) + len(trace) == first["num_steps"]
        assert sum(step[1] for step in prefills) + sum(step[2] for step in trace) == first["tokens"]
        assert 0 <= first["acceptance_rate"] <= 1 and first["kv_cache_bytes"] > 0
        assert first["idle_share"] is None and first["syncs_per_step"] is None  # CUDA only
        assert 0 <= first["proposer_share"] < (0.01 if row_id == "none" else 1)  # none: no proposer to run
    assert {r["vs_none"] for r in by_id["none"]} == {1.0}
    for row_id in ("none_lockstep", "suffix_lockstep"):  # the host in lockstep, beside `none` and `suffix`
        assert {r["async_scheduling"] for r in by_id[row_id]} == {False}
    assert {r["whole_groups"] for r in by_id["none_split"]} == {False} and {
        r["whole_groups"] for r in by_id["none"]
    } == {True}
    assert [r["tokens"] for r in by_id["none_split"]] == [r["tokens"] for r in by_id["none"]]  # the same samples
    assert by_id["hf_generate"][0]["vs_hf_generate"] == 1.0
    assert by_id["suffix_k4"][1]["mean_k"] == 4.0

    table = done.stdout.rstrip().splitlines()[-len(rows) - 1 :]
    assert table[0].startswith("row") and "tok/s" in table[0], done.stdout[-3000:]
    assert [line[:34].rstrip() for line in table[1:]] == [r["name"] for r in rows]


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, capsys):
    import transformers

    module = load_script()
    verbosity = transformers.utils.logging.get_verbosity()
    try:  # in-process, so as to be quick: main quiets transformers' logging, which is put back after
        out = module.main(
            ["--device", "cpu", "--rows", "none", "draft", "--draft", "no-such-model", "--out", str(tmp_path)]
        )
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
    draft = [r for r in out["rows"] if r["id"] == "draft"]
    assert len(draft) == 1 and "did not load" in draft[0]["error"] and "no-such-model" in draft[0]["error"]
    assert all(math.isfinite(r["tokens_per_s"]) for r in out["rows"] if r["id"] == "none")
    saved = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [r["name"] for r in saved["rows"]] == [r["name"] for r in out["rows"]]
    assert draft[0]["error"] in capsys.readouterr().out.splitlines()[-1]


def test_the_warm_up_runs_the_timed_rollouts_own_prefill_and_leaves_nothing_behind():
    # Triton compiles a kernel per shape class: a warm-up of other prompts left the first timed prefill compiling
    import torch

    from rollout import Generator, SamplingParams, SpecConfig
    from rollout.models import zoo

    module = load_script()
    model, _ = zoo.load_model("tiny-target", torch.float32, "cpu")
    prompts = [[5 + i, 9, 11 + 2 * i, 7][: 2 + i % 3] for i in range(6)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0)
    spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    gen = Generator(model, max_batch_size=8, max_seq_len=24, spec=spec)
    seen, step = [], gen.step

    def recorded_step():
        out = step()
        seen.append(out.record)
        return out

    gen.step = recorded_step
    module.warm_up(gen, prompts, params, spec)
    warm = [(r.kind, r.batch_size, r.num_draft_tokens) for r in seen]
    assert not gen.has_unfinished and [kind for kind, *_ in warm].count("decode") == 3
    assert all(k == 3 for kind, _, k in warm if kind == "decode")  # every decode step fed the largest K
    seen.clear()
    result = module.rollout(gen, prompts, params, deadline=float("inf"))
    timed_prefills = [(r.kind, r.batch_size) for r in seen if r.kind == "prefill"]
    first_decode = next(i for i, (kind, *_) in enumerate(warm) if kind == "decode")
    assert [(kind, b) for kind, b, _ in warm[:first_decode]] == timed_prefills[:first_decode]
    assert result["tokens"] == sum(r.num_emitted for r in seen) and not result["capped"]


def test_union_length_counts_overlapping_device_intervals_once():
    module = load_script()
    assert module.union_length([]) == 0.0
    assert module.union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == 4.0
    assert module.union_length([(4.0, 6.0), (0.0, 1.0), (0.5, 4.5)]) == 6.0


def test_each_gpu_session_mode_fits_one_device_command():
    """A device command runs at most 600 s and the install takes some: each mode of scripts/gpu_session.sh gives its
    parts limits that add up to at most 560 s (a limit past it kills the run in its last part, the bench, whose
    table comes last)."""
    import re

    text = (ROOT / "scripts" / "gpu_session.sh").read_text()
    modes = re.search(r'case "\$mode" in\n(.*?)\n    esac', text, re.S)[1]
    sums = {}
    for mode, body in re.findall(r"^    (\w+)\)\n(.*?)^        ;;", modes, re.M | re.S):
        limits = re.findall(r"^\s+(?:tests \S+|logged \S+|bench) (\d+) ", body, re.M)
        sums[mode] = sum(int(x) for x in limits)
    assert set(sums) == {"kernels", "engine", "open", "rows", "auto", "spec", "policy", "run"}, sums
    assert all(0 < total <= 560 for total in sums.values()), sums


def test_the_verification_bench_checks_and_times_every_width_on_a_cpu(tmp_path):
    """scripts/bench_verify.py (exact verification's cost per drafted depth; on a GPU replayed as graphs) at a CPU's
    size: it checks each shape's chains against `verify_exact` with every draft accepted, and records each width's
    eager times and the per-depth cost (the replay is a GPU's only)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_verify", SCRIPT.parent / "bench_verify.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    widths = [1, 2, 4]
    module.main(["--device", "cpu", "--rows", "2", "5", "--widths", *map(str, widths), "--vocab", "301"]
                + ["--repeats", "3", "--sets", "2", "--out", str(tmp_path), "--commit", "test"])  # fmt: skip
    report = json.loads((tmp_path / "bench_verify.json").read_text())
    assert report["header"]["commit"] == "test" and report["header"]["copy_bandwidth_bytes_per_s"] > 0
    assert [(r["rows"], r["width"]) for r in report["records"]] == [(rows, w) for rows in (2, 5) for w in widths]
    for record in report["records"]:
        assert record["chains_graph_ms"] is None  # no CUDA
        assert record["chains_eager_ms"] > 0 and record["filtered_eager_ms"] > 0
    times = {(r["rows"], r["width"], key): r[key] for r in report["records"] for key in r}
    for key in ("chains_eager_ms", "filtered_eager_ms"):  # (t(4) - t(1)) / 3 for each number of rows
        expected = {str(rows): (times[rows, 4, key] - times[rows, 1, key]) / 3 for rows in (2, 5)}
        assert report[f"{key}_per_depth_ms"] == pytest.approx(expected)
    assert report["chains_graph_ms_per_depth_ms"] == {"2": None, "5": None}
