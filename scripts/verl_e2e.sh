#!/usr/bin/env bash
# The veRL backend end to end on this CPU, in an environment of its own (veRL 0.9.1 pins transformers >=5.5.3,<5.11,
# below the main environment's): installs the project with its `verl` extra as the how-to says, then runs the
# adapter's tests (tests/test_verl.py) and veRL's own main_ppo for 3 GRPO steps with rollout.name=rollout
# (tests/verl_e2e/). About 2.5 minutes of installs on a warm pip cache, then about 2.5 minutes of tests on 2 cores:
#   scripts/verl_e2e.sh            # builds .venv-verl/ from scratch, then runs the tests
#   scripts/verl_e2e.sh --install  # builds it only (CI builds it while the main environment installs)
#   scripts/verl_e2e.sh --tests -x # the tests only, in the environment built before; arguments go to pytest
#   VERL_VENV=/path scripts/verl_e2e.sh   # another environment folder
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VERL_VENV:-.venv-verl}"
PHASE=all
if [[ "${1:-}" == "--install" || "${1:-}" == "--tests" ]]; then
  PHASE="${1#--}"
  shift
fi

if [[ "$PHASE" == install && $# -gt 0 ]]; then
  echo "verl_e2e.sh: --install takes no more arguments (pytest's go after --tests), got: $*" >&2
  exit 2
fi

if [[ "$PHASE" != tests ]]; then
  # the project is installed from a copy of its sources, taken first: setuptools builds in the source folder (build/,
  # *.egg-info), and CI installs the main environment from that folder meanwhile, then runs tests that write caches there
  src="$(mktemp -d)"
  trap 'rm -rf "$src"' EXIT
  cp -r pyproject.toml README.md rollout specdec kernels "$src"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # torch first, pinned to the CPU build the main environment uses (veRL would otherwise pull a CUDA build).
  # --no-compile, then compileall on every core: pip byte-compiles the ~150 packages one file after another,
  # compileall -j 0 on both of CI's cores (installs and compiling 157 s instead of 192 on the same day). Left to the
  # first imports, the tests took 294 s instead of 163 (veRL's ray workers start at once, each compiling what it
  # imports). Files that do not compile on this Python (torch's py312_*) are skipped, as pip skips them.
  "$VENV/bin/pip" install -q --no-compile torch==2.13.0
  "$VENV/bin/pip" install -q --no-compile "$src[verl]" pytest
  purelib="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  "$VENV/bin/python" -m compileall -q -j 0 "$purelib" > /dev/null || true
  "$VENV/bin/python" -c "import verl, transformers, torch, ray; print('verl', verl.__version__, 'transformers', \
transformers.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
fi
if [[ "$PHASE" != install ]]; then
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "verl_e2e.sh: no environment at $VENV: build it first with scripts/verl_e2e.sh --install" >&2
    exit 2
  fi
  "$VENV/bin/python" -m pytest -q tests/test_verl.py tests/verl_e2e "$@"
fi
