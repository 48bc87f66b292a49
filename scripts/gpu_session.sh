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
# policy's host time over the decode steps'); rows past the budget are skipped and say so.#
#   COMMIT=<hash> bash scripts/gpu_session.sh open "$OUT"    # there: the open issues' GPU rows, for a 15-minute lease
#
# `open` writes test_gpu.log (every CUDA test of tests/test_gpu.py: graphs in eval mode, graphs with speculation
# against the eager engine, one device read a step, the race kernels compiled against their references),
# test_kernels.log (the race, paged attention and top-k / top-p kernels' tests compiled) and bench.log /
# bench_gpu.json at $SIZES (64x8,256x8): `none` with graphs, `suffix` at auto K (running ahead where it drafts
# nothing) beside `suffix_lockstep`, `draft`, and `none_lockstep`, with mean K and the share of steps run ahead per
# phase, within a 260 s budget, 60 s a row. About 9 minutes with the install.
set -o pipefail
WHEELS="transformers==5.24.0 datasets==5.2.0 trl==1.16.0 peft==0.21.2 omegaconf==2.4.0 dill==0.4.1 multiprocess==0.70.19"

case "${1:-}" in
wheels)
    mkdir -p .git/info && grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $WHEELS
    ls .whl
    ;;
run | policy | kernels | engine | spec | open)
    mode=$1 out=${2:?give the output folder}; shift 2
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/rollout_kernels  # the import name an install would give it
    export PYTHONPATH=/tmp/site:/tmp/pk:. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
    if [ "$mode" = kernels ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        start=$(date +%s)
        timeout 240 python3 -m pytest tests/test_gpu.py::test_race_kernels_are_their_references_bit_for_bit_on_a_gpu \
            tests/kernels/test_race_logits.py tests/kernels/test_race_sample.py \
            tests/kernels/test_paged_attention.py -q -p no:cacheprovider 2>&1 | tee "$out/test_kernels.log" \
            | grep -E "^E   |passed|failed" | cut -c1-600 | tail -12
        echo "tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 180 python3 scripts/bench_paged_attention.py 2>&1 | grep -v USDT > "$out/paged_attention.log"
        tail -20 "$out/paged_attention.log"
        echo "paged attention: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 120 python3 -m pytest tests/kernels/test_keep_threshold.py -q -p no:cacheprovider 2>&1 \
            | tee "$out/test_keep_threshold.log" | grep -E "^E   |passed|failed" | cut -c1-600 | tail -6
        timeout 120 python3 scripts/bench_keep_threshold.py --repeats 10 2>&1 | grep -v USDT > "$out/keep_threshold.log"
        tail -8 "$out/keep_threshold.log"
        echo "keep threshold: $(( $(date +%s) - start )) s"
        exit 0
    fi
    if [ "$mode" = engine ]; then
        commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        start=$(date +%s)
        timeout 120 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "reads_the_device_once" 2>&1 \
            | tee "$out/test_gpu.log" | grep -E "^E   |passed|failed" | cut -c1-600 | tail -12
        echo "tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 420 python3 scripts/bench_gpu.py --commit "$commit" --out "$out" --sizes 64x8 --budget-s 380 \
            --rows standard none none_lockstep suffix none_compiled 2>&1 | grep -v USDT > "$out/bench.log"
        tail -16 "$out/bench.log"
        echo "bench: $(( $(date +%s) - start )) s"
        exit 0
    fi
    if [ "$mode" = open ]; then
        commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)"
        start=$(date +%s)
        timeout 130 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider --durations=0 2>&1 \
            | tee "$out/test_gpu.log" | grep -E "^E   |passed|failed|skipped" | cut -c1-600 | tail -12
        echo "tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 120 python3 -m pytest tests/kernels/test_race_logits.py tests/kernels/test_race_sample.py \
            tests/kernels/test_paged_attention.py tests/kernels/test_keep_threshold.py -q -p no:cacheprovider 2>&1 \
            | tee "$out/test_kernels.log" | grep -E "^E   |passed|failed|launcher" | cut -c1-400 | tail -8
        echo "kernel tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 300 python3 scripts/bench_gpu.py --commit "$commit" --out "$out" --sizes "${SIZES:-64x8,256x8}" \
            --budget-s 260 --row-cap-s 60 --rows none suffix suffix_lockstep draft none_lockstep 2>&1 \
            | grep -v USDT > "$out/bench.log"
        tail -24 "$out/bench.log"
        echo "bench: $(( $(date +%s) - start )) s"
        exit 0
    fi
    if [ "$mode" = spec ]; then
        commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        start=$(date +%s)
        timeout 150 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider \
            -k "graphs_sample_what_the_eager or reads_the_device_once" 2>&1 \
            | tee "$out/test_gpu.log" | grep -E "^E   |passed|failed" | cut -c1-600 | tail -12
        echo "tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 420 python3 scripts/bench_gpu.py --commit "$commit" --out "$out" --sizes 64x8 --budget-s 380 \
            --row-cap-s 120 --rows none suffix suffix_lockstep draft suffix+draft suffix_k1 2>&1 | grep -v USDT > "$out/bench.log"
        tail -16 "$out/bench.log"
        echo "bench: $(( $(date +%s) - start )) s"
        exit 0
    fi
    if [ "$mode" = policy ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        start=$(date +%s)
        timeout 150 python3 -m pytest tests/test_gpu_policy.py -q -p no:cacheprovider 2>&1 \
            | tee "$out/test_gpu_policy.log" | grep -E "^E   |passed|failed" | cut -c1-600 | tail -12
        echo "tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
        timeout 300 python3 scripts/trainer_logprob_gap.py --model tiny-target-1b --bf16 --num-prompts 16 --n 8 \
            --max-new-tokens 256 2>&1 | grep -v USDT > "$out/logprob_gap.log"
        grep -A5 "prompts$" "$out/logprob_gap.log"
        echo "gap: $(( $(date +%s) - start )) s"
        start=$(date +%s)
        timeout 120 python3 scripts/rebuild_memory.py 2>&1 | grep -v USDT > "$out/rebuild_memory.log"
        tail -2 "$out/rebuild_memory.log" | head -1
        echo "rebuild: $(( $(date +%s) - start )) s"
        exit 0
    fi
    commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # the working tree travels without .git: COMMIT=
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    start=$(date +%s)
    timeout 120 python3 -m pytest tests/test_gpu.py tests/test_graphs.py -q -p no:cacheprovider 2>&1 \
        | tee "$out/test_gpu.log" | grep -E "^E   |passed|failed" | cut -c1-600 | tail -12
    echo "tests: $(( $(date +%s) - start )) s"; start=$(date +%s)
    timeout 60 python3 scripts/probe_step.py --out "$out" 2>&1 | grep -v USDT > "$out/probe.log"
    grep -E '"(captured|memory_bytes|error|step_wall_ms|kernels_per_step|busy_share)"' "$out/probe_step.json"
    echo "probe: $(( $(date +%s) - start )) s"; start=$(date +%s)
    timeout 540 python3 scripts/bench_gpu.py --commit "$commit" --out "$out" "$@" 2>&1 | grep -v USDT > "$out/bench.log"
    tail -25 "$out/bench.log"
    echo "bench: $(( $(date +%s) - start )) s"
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh wheels | run OUT [bench_gpu.py args] | policy OUT | kernels OUT | engine OUT" \
        "| spec OUT | open OUT" >&2
    exit 2
    ;;
esac
