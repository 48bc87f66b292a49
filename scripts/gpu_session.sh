#!/usr/bin/env bash
# A lent GPU machine's whole session in one prepared command: the CUDA tests, the decode-step probe, the benchmark.
#
# The machines lent so far had no network and an image with torch, triton and accelerate but not the rest, so the
# missing packages travel as wheels, downloaded on the development machine first:
#
#   bash scripts/gpu_session.sh wheels                     # here: .whl/ (ignored by git), once
#   COMMIT=<hash> bash scripts/gpu_session.sh run "$OUT" --quick   # there: everything, bench_gpu.py with these args
#
# `run` writes test_gpu.log, probe_step.json, probe.log, bench.log and bench_gpu.json under the folder given. Each
# part has its own time limit, so a hang in one still leaves the others' files.
#
#   bash scripts/gpu_session.sh policy "$OUT"             # there: issue 40's GPU tests and the trainer log-prob gap
#
# `policy` writes test_gpu_policy.log, logprob_gap.log and rebuild_memory.log (their last lines are JSON).
#
#   bash scripts/gpu_session.sh kernels "$OUT"            # there: the new kernels compiled (issues 40, 42, 43)
#
# `kernels` writes test_kernels.log (the race kernels' bits against their references, race_logits and paged attention
# tests compiled), paged_attention.log (scripts/bench_paged_attention.py: page tiles vs 64/128-key tiles and splits),
# test_keep_threshold.log and keep_threshold.log (top-k / top-p thresholds: the kernel against the sort it replaced).
#
#   COMMIT=<hash> bash scripts/gpu_session.sh engine "$OUT"  # there: issue 41 and 43's engine rows, in one process
#
# `engine` writes test_gpu.log (one wait for the device a decode step, Event.synchronize counted too) and bench.log /
# bench_gpu.json: at 64 x 8, `none` (the host one step ahead) beside `none_lockstep` with the GPU's idle share,
# `standard` (the nano-vllm benchmark), `suffix`, and `none_compiled` (torch.compile; its compile seconds in the
# graphs record) last.
#
#   COMMIT=<hash> bash scripts/gpu_session.sh spec "$OUT"    # there: issue 42's speculation rows, in one process
#
# `spec` writes test_gpu.log (graphs with speculation sample what the eager engine samples; one device read a step)
# and bench.log / bench_gpu.json: at 64 x 8, first and second rollout, `none` with graphs beside `suffix` (auto K;
# `suffix_lockstep`: never ahead of the device), `draft`, `suffix+draft` and `suffix_k1`, each with its phases' tokens/s, `proposer_share` and `policy_share` (the K
# policy's host time over the decode steps'); rows past the budget are skipped and say so.
#
#   COMMIT=<hash> bash scripts/gpu_session.sh open "$OUT"    # there: the open issues' GPU rows, for a 15-minute lease
#
# `open` writes test_gpu.log (every CUDA test of tests/test_gpu.py: graphs in eval mode, graphs with speculation
# against the eager engine, a replayed verifying graph against its eager body, one device read a step, the race
# kernels compiled against their references; and graphs captured again after a change of the policy),
# test_kernels.log (the paged attention, top-k / top-p and race kernels' tests compiled; on 2026-11-27 the race tests
# alone took the 120 s then given, so the others go first now) and bench.log / bench_gpu.json at $SIZES (64x8,256x8):
# `none` with graphs, `suffix` at auto K (verifying in the replay, running ahead where it drafts nothing), `draft`,
# `none_lockstep` and `suffix_lockstep`, with mean K and the share of steps run ahead per phase, within a 230 s
# budget, 60 s a row (rows past it are skipped, last first). About 9 minutes with the install. On 2026-11-28 the
# CUDA tests took 69 s of their limit and the 246 kernel tests all of theirs (150 s then), so the kernels have 170 s.
#
#   COMMIT=<hash> bash scripts/gpu_session.sh rows "$OUT"    # there: `open`'s benchmark rows alone, to repeat them
#
# `rows` writes verify.log / bench_verify.json (scripts/bench_verify.py: exact verification's milliseconds per drafted
# depth at 175 and 512 rows, vocab 128256, replayed and eager, against the floor), then bench.log / bench_gpu.json as
# `open` does, without the tests, with `none_split` (a prompt's samples admitted as slots free up, as before whole
# groups) in place of `suffix_lockstep`. About 5 minutes with the install.
#
#   COMMIT=<hash> bash scripts/gpu_session.sh auto "$OUT"    # there: the auto policy against none, for a short lease
#
# `auto` writes test_gpu_policy.log (graphs dropped by a change of the policy are captured again, into a new pool)
# and bench.log / bench_gpu.json: `none` and `suffix` at auto K, both with graphs, at $SIZES (64x8,256x8), first and
# second rollout, within a 180 s budget, 75 s a row. About 5 minutes with the install.
#
# Each mode's time limits add up to at most 560 s: a device command runs at most 600 s, and the install and imports
# take the rest (tests/test_bench_gpu.py checks the sums).
set -o pipefail
WHEELS="transformers==5.24.0 datasets==5.2.0 trl==1.16.0 peft==0.21.2 omegaconf==2.4.0 dill==0.4.1 multiprocess==0.70.19"

case "${1:-}" in
wheels)
    mkdir -p .git/info && grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $WHEELS
    ls .whl
    ;;
run | policy | kernels | engine | spec | open | rows | auto)
    mode=$1 out=${2:?give the output folder}; shift 2
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/rollout_kernels  # the import name an install would give it
    export PYTHONPATH=/tmp/site:/tmp/pk:. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
    commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # the working tree travels without .git: COMMIT=
    # pytest, its whole log in $out/LOG, its error lines and summary shown: tests LOG SECONDS [pytest args]
    tests() {
        local log=$1 limit=$2; shift 2
        timeout "$limit" python3 -m pytest "$@" -q -p no:cacheprovider 2>&1 | tee "$out/$log" \
            | grep -E "^E   |passed|failed|skipped|launcher" | cut -c1-600 | tail -12
    }
    # a script's output in $out/LOG (without the profiler's USDT noise): logged LOG SECONDS SCRIPT [args]
    logged() {
        local log=$1 limit=$2; shift 2
        timeout "$limit" python3 "$@" 2>&1 | grep -v USDT > "$out/$log"
    }
    # bench_gpu.py into $out/bench.log and bench_gpu.json, the table's last LINES shown: bench SECONDS LINES [args]
    bench() {
        local limit=$1 lines=$2; shift 2
        logged bench.log "$limit" scripts/bench_gpu.py --commit "$commit" --out "$out" "$@"
        tail -"$lines" "$out/bench.log"
    }
    # the seconds since the last lap, labelled: lap LABEL
    lap() { echo "$1: $(( $(date +%s) - start )) s"; start=$(date +%s); }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    start=$(date +%s)
    case "$mode" in
    kernels)
        tests test_kernels.log 200 tests/test_gpu.py::test_race_kernels_are_their_references_bit_for_bit_on_a_gpu \
            tests/kernels/test_race_logits.py tests/kernels/test_race_sample.py tests/kernels/test_paged_attention.py
        lap tests
        logged paged_attention.log 150 scripts/bench_paged_attention.py
        tail -20 "$out/paged_attention.log"
        lap "paged attention"
        tests test_keep_threshold.log 100 tests/kernels/test_keep_threshold.py
        logged keep_threshold.log 100 scripts/bench_keep_threshold.py --repeats 10
        tail -8 "$out/keep_threshold.log"
        lap "keep threshold"
        ;;
    engine)
        tests test_gpu.log 120 tests/test_gpu.py -k "reads_the_device_once"
        lap tests
        bench 400 16 --sizes 64x8 --budget-s 360 --rows standard none none_lockstep suffix none_compiled
        lap bench
        ;;
    open)
        python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)"
        tests test_gpu.log 100 tests/test_gpu.py --durations=0 \
            tests/test_gpu_policy.py::test_graphs_dropped_by_a_change_are_captured_again_and_replayed
        lap tests
        tests test_kernels.log 170 tests/kernels/test_paged_attention.py tests/kernels/test_keep_threshold.py \
            tests/kernels/test_race_logits.py tests/kernels/test_race_sample.py
        lap "kernel tests"
        bench 270 24 --sizes "${SIZES:-64x8,256x8}" --budget-s 230 --row-cap-s 60 \
            --rows none suffix draft none_lockstep suffix_lockstep
        lap bench
        ;;
    rows)
        logged verify.log 90 scripts/bench_verify.py --commit "$commit" --out "$out"
        tail -4 "$out/verify.log"
        lap verify
        bench 270 24 --sizes "${SIZES:-64x8,256x8}" --budget-s 230 --row-cap-s 60 \
            --rows none suffix draft none_split none_lockstep
        lap bench
        ;;
    auto)
        tests test_gpu_policy.log 60 tests/test_gpu_policy.py -k "captured_again or disable_adapter"
        lap tests
        bench 210 12 --sizes "${SIZES:-64x8,256x8}" --budget-s 180 --row-cap-s 75 --rows none suffix
        lap bench
        ;;
    spec)
        tests test_gpu.log 130 tests/test_gpu.py -k "graphs_sample_what_the_eager or reads_the_device_once"
        lap tests
        bench 380 16 --sizes 64x8 --budget-s 340 --row-cap-s 120 \
            --rows none suffix suffix_lockstep draft suffix+draft suffix_k1
        lap bench
        ;;
    policy)
        tests test_gpu_policy.log 130 tests/test_gpu_policy.py
        lap tests
        logged logprob_gap.log 280 scripts/trainer_logprob_gap.py --model tiny-target-1b --bf16 --num-prompts 16 \
            --n 8 --max-new-tokens 256
        grep -A5 "prompts$" "$out/logprob_gap.log"
        lap gap
        logged rebuild_memory.log 100 scripts/rebuild_memory.py
        tail -2 "$out/rebuild_memory.log" | head -1
        lap rebuild
        ;;
    run)
        tests test_gpu.log 120 tests/test_gpu.py tests/test_graphs.py
        lap tests
        logged probe.log 60 scripts/probe_step.py --out "$out"
        grep -E '"(captured|memory_bytes|error|step_wall_ms|kernels_per_step|busy_share)"' "$out/probe_step.json"
        lap probe
        bench 360 25 "$@"
        lap bench
        ;;
    esac
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh wheels | run OUT [bench_gpu.py args] | policy OUT | kernels OUT | engine OUT" \
        "| spec OUT | open OUT | rows OUT | auto OUT" >&2
    exit 2
    ;;
esac
