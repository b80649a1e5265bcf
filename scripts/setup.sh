#!/usr/bin/env bash
# Idempotent set-up: venv, torch 2.13.0 (CPU build), xlaunch with dev extras, and the
# Debian allocator/numactl packages when they are missing and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

need_apt=()
[ -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] || ls /usr/lib/*/libjemalloc.so.2 >/dev/null 2>&1 || need_apt+=(libjemalloc2)
ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need_apt+=(libtcmalloc-minimal4)
command -v numactl >/dev/null 2>&1 || need_apt+=(numactl)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: warning: missing ${need_apt[*]} (not root or no apt-get)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.xlaunch-setup"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The CPU build of torch 2.13.0 is pinned here, never a range (a range pulls a CUDA build).
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q intel-openmp
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
