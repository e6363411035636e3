#!/usr/bin/env bash
# pipecomm: reproduce every table and figure, or run the tests.
#   ./run_all.sh            set up .venv, run every experiment (profile chosen automatically),
#                           print the claims table
#   ./run_all.sh --tests    set up .venv, then ruff and the whole test suite
#   ./run_all.sh --help     all options (the orchestration itself is python -m pipecomm.lab.artifact)
# Bash only bootstraps the environment; everything else is Python.
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  cat <<'USAGE'
usage: ./run_all.sh [--profile cpu|cpu-full|gpu|shaped] [--only E3 [E7 ...]] [-p NAME=VALUE ...] [--force]
                    [--runs N] [--list] [--report [--reference]] [--tests [PYTEST ARGS...]] [--help]

  --profile P         parameter set: cpu (quick, <= 20 min), cpu-full (convergence protocols of
                      E7, E9, E13, <= 2.5 h), gpu (default: gpu if >= 2 GPUs are visible, else cpu),
                      shaped (network experiments on a virtual cluster of network namespaces
                      with tc-shaped links; needs root)
  --only E...         run only these experiments
  -p NAME=VALUE       override a parameter of the selected experiments (repeatable); the run is
                      written to results/<profile>/<E>__NAME=VALUE/, never over the default
  --force             re-run even when a current result (same parameters and code) exists
  --runs N            run the profile N times, independently (run k >= 2 in results/<profile>/run-<k>/);
                      the claims table gets a runs column, UNSTABLE where the runs disagree
  --list              list experiments: budget, parameters, whether the result is current
  --report            write results/<profile>/report/index.html (claims, figures, rendered
                      notebooks) from the results there, running nothing (a full run writes it
                      too); with --reference: artifact/reference/<profile>/report/
  --tests             set up, then `ruff check` and `pytest` on two workers (arguments after
                      it go to pytest instead of -n 2; no run options with it)
  --help              this text

Environment: PYTHON (interpreter used to create .venv, default python3),
PIPECOMM_SKIP_INSTALL=1 (trust an existing .venv as it is).
USAGE
}

mode=run
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --tests)
      if [ ${#args[@]} -gt 0 ]; then
        echo "run_all.sh: --tests runs ruff and pytest and takes no run options (got ${args[*]}); run them separately" >&2
        exit 2
      fi
      mode=tests; shift; args+=("$@"); break ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ "$mode" = tests ]; then
  for a in "${args[@]+"${args[@]}"}"; do
    case "$a" in
      --only|--only=*|--profile|--profile=*|--force|--list|--runs|--runs=*|--save-reference|--report|--reference|--timeout-factor|--timeout-factor=*)
        echo "run_all.sh: $a is a run option; --tests passes its arguments to pytest: run them separately (./run_all.sh $a ...)" >&2
        exit 2 ;;
    esac
  done
fi

PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "run_all.sh: $PYTHON not found; install Python 3.11+ (3.11-3.13 checked) or set PYTHON=/path/to/python3" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "run_all.sh: Python >= 3.11 is required (the pinned numpy, pandas and scipy have no release for older ones), $PYTHON is $("$PYTHON" -V 2>&1): set PYTHON=python3.11" >&2
  exit 2
fi

LOCK=artifact/requirements-lock.txt
VENV=.venv
VPY=$VENV/bin/python
reuse_torch=0
if [ ! -x "$VPY" ]; then
  # A machine that already has a working torch (GPU images) keeps it: the venv sees it.
  if "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
    reuse_torch=1
    echo "run_all.sh: reusing the torch $("$PYTHON" -c 'import torch; print(torch.__version__)') of $PYTHON"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
if [ -f "$VENV/pyvenv.cfg" ] && grep -q 'include-system-site-packages = true' "$VENV/pyvenv.cfg"; then
  reuse_torch=1
fi

stamp=$VENV/.pipecomm-installed
want=$(cat pyproject.toml "$LOCK" 2>/dev/null | cksum)
if [ "${PIPECOMM_SKIP_INSTALL:-0}" != 1 ] && [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "run_all.sh: installing pinned dependencies into $VENV (once)"
  constraints=$LOCK
  if [ "$reuse_torch" = 1 ]; then
    constraints=$VENV/constraints-no-torch.txt
    grep -v -E '^(torch|nvidia-|triton)' "$LOCK" > "$constraints"
  fi
  "$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$VPY" -m pip install --quiet -c "$constraints" -e ".[all]"
  "$VPY" -m ipykernel install --sys-prefix --name pipecomm --display-name "Python (pipecomm)" >/dev/null
  echo "$want" > "$stamp"
fi

if [ "$mode" = tests ]; then
  echo "run_all.sh: ruff check"
  "$VENV/bin/ruff" check .
  echo "run_all.sh: pytest"
  # two workers (pytest-xdist), one module or the shaped-network tests each (tests/conftest.py);
  # arguments of your own choose instead (for example -n 0, or one test file); one worker in a
  # .venv without xdist (PIPECOMM_SKIP_INSTALL=1 over an older one)
  workers=()
  if [ ${#args[@]} -eq 0 ] && "$VPY" -c "import xdist" 2>/dev/null; then
    workers=(-n 2 --dist loadgroup --no-loadscope-reorder)
  fi
  exec "$VPY" -m pytest "${workers[@]+"${workers[@]}"}" "${args[@]+"${args[@]}"}"
fi
exec "$VPY" -m pipecomm.lab.artifact "${args[@]+"${args[@]}"}"
