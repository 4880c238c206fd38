#!/usr/bin/env bash
# Ensure the project's Python environment: a virtualenv at .venv with flashpost installed
# (editable) plus the dev tools. Idempotent: a second run checks a stamp keyed by the hash of
# pyproject.toml and returns in well under a second.
#
# torch is installed first and pinned (torch==2.13.0) when the venv has none, so a CPU machine
# takes the local CPU wheel instead of a multi-GB CUDA build pulled in by an unpinned range.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${FLASHPOST_VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_PIN=${FLASHPOST_TORCH:-torch==2.13.0}

want=$(cat pyproject.toml infra/setup_python.sh | sha256sum | cut -c1-16)
stamp="$VENV/.flashpost-stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] python environment up to date ($VENV)"
  exit 0
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "[setup] error: $PYTHON not found. Install Python 3.11 (Debian: apt-get install python3) or set PYTHON=/path/to/python3.11." >&2
  exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "[setup] error: flashpost needs Python >= 3.11, $PYTHON is $("$PYTHON" -V 2>&1). Set PYTHON=/path/to/python3.11." >&2
  exit 1
fi
# Debian splits venv/ensurepip out of the interpreter package.
if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    ver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "[setup] installing python${ver}-venv (Debian)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python${ver}-venv" >/dev/null
  else
    echo "[setup] error: $PYTHON cannot create virtualenvs (no ensurepip). On Debian run as root: apt-get install python3-venv" >&2
    exit 1
  fi
fi

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# This machine's pip config lists local wheel folders that may be absent; their warnings are noise.
pip_install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "[setup] installing $TORCH_PIN"
  pip_install "$TORCH_PIN"
fi
echo "[setup] installing flashpost (editable) and its dependencies"
pip_install -e '.[dev]'
# DeepSpeed JIT-compiles its CPU shared-memory collective on the first init_distributed (minutes on
# 2 cores); build it here, once per machine (cached in ~/.cache/torch_extensions), with a message.
echo "[setup] building DeepSpeed's CPU communication op (first time only)"
"$VENV/bin/python" - <<'PY'
import importlib
importlib.import_module("deepspeed.comm.torch").build_shm_op()
PY
echo "$want" > "$stamp"
echo "[setup] python environment ready in $(( $(date +%s) - t0 )) s ($VENV)"
