#!/usr/bin/env bash
# Idempotent set-up: venv (on Debian's python3.11 when there is one), torch 2.13.0 (CPU build),
# torchao 0.18.0, xlaunch with dev, tune and engine (onnxruntime, openvino) extras, the Debian
# allocator/numactl/libomp5 (and python3.11-venv) packages when they are missing and we are root, and
# xlaunch.nn's and xlaunch.llm's compiled kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# PYTHON=...: checked before anything is installed (one line, exit 2): it runs, it is 3.10+ (torch 2.13's
# floor), and an existing $VENV was made with the same version (it was kept in silence, on its own Python).
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
  want=$(py_version "$PYTHON") && [ -n "$want" ] || { echo "setup: PYTHON=$PYTHON: not a Python interpreter that runs here" >&2; exit 2; }
  if [ "$(printf '%s\n' 3.10 "$want" | sort -V | head -n 1)" != 3.10 ]; then
    echo "setup: PYTHON=$PYTHON is Python $want; torch 2.13 needs Python 3.10 or later" >&2; exit 2
  fi
  if [ -x "$VENV/bin/python" ] && have=$(py_version "$VENV/bin/python") && [ "$have" != "$want" ]; then
    echo "setup: PYTHON=$PYTHON is Python $want, but $VENV was made with Python $have: remove $VENV" \
         "(or set VENV to another folder) to make it with $PYTHON" >&2
    exit 2
  fi
fi
need_apt=()
[ -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] || ls /usr/lib/*/libjemalloc.so.2 >/dev/null 2>&1 || need_apt+=(libjemalloc2)
ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need_apt+=(libtcmalloc-minimal4)
command -v numactl >/dev/null 2>&1 || need_apt+=(numactl)
# LLVM's OpenMP runtime: runtime_ext's tests run again with it preloaded (as with Intel's).
ls /usr/lib/*/libomp.so.5 >/dev/null 2>&1 || need_apt+=(libomp5)
# SIMDe's portable AVX-512 (headers only): tests/llm runs the AVX-512 VNNI kernels with it on any x86 CPU.
[ -e /usr/include/simde/x86/avx512.h ] || need_apt+=(libsimde-dev)
# Debian's Python 3.11 without its venv module (a slim image): the package that holds it (below).
DEBIAN_PY=/usr/bin/python3.11
has_venv() { "$1" -c 'import ensurepip, venv' >/dev/null 2>&1; }
if [ -z "${PYTHON:-}" ] && [ ! -x "$VENV/bin/python" ] && [ -x "$DEBIAN_PY" ] && ! has_venv "$DEBIAN_PY"; then
  need_apt+=(python3.11-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: warning: missing ${need_apt[*]} (not root or no apt-get)" >&2
  fi
fi

# The venv's interpreter: $PYTHON, else Debian's own Python 3.11 when it is there with its venv module,
# else python3. Debian builds its interpreter with profile-guided and link-time optimisation; a Python
# built by pyenv (as on the AVX2 VM) has neither unless asked. The same suite, same day, AVX2 VM: 281 s
# with Debian's 3.11.2 against 325-345 s with pyenv's 3.11.7 (`import torch` 2.5 against 3.0 s of CPU).
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif has_venv "$DEBIAN_PY"; then
  PY=$DEBIAN_PY
else
  PY=python3
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PY ($("$PY" -V 2>&1))"
  "$PY" -m venv "$VENV"
fi
# xlaunch.nn's kernels, then (when they built) xlaunch.llm's, as `python -m xlaunch.{nn,llm}.native` would.
build_kernels=(-c 'import sys
from xlaunch.llm import native as llm
from xlaunch.nn import native as nn
sys.exit(nn.main([]) or llm.main([]))')
stamp="$VENV/.xlaunch-setup"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log="$VENV/setup.log"
  echo "setup: installing torch==2.13.0+cpu, intel-openmp==2026.2.0, torchao and xlaunch[dev,tune,onnxruntime,openvino,llm] into $VENV (log: $log)"
  started=$SECONDS
  step() { echo "setup: [$1/4] $2 ($((SECONDS - started)) s so far)"; }
  pip_install() { "$VENV/bin/python" -m pip install -q "$@" >>"$log" 2>&1 || { cat "$log" >&2; exit 1; }; }
  : >"$log"
  step 1 "upgrading pip"
  pip_install --upgrade pip
  # The CPU build of torch 2.13.0 is pinned here, +cpu included: the registry's torch==2.13.0 is the CUDA build
  # (with cuda-toolkit: gigabytes), which a plain pin pulled wherever no local +cpu wheel matched
  # (PYTHON=python3.12 here). From pip's own indexes when they hold it, else PyTorch's CPU index ($TORCH_INDEX_URL).
  # --no-compile, then compileall on both cores in the background: pip byte-compiles torch's
  # thousands of modules on one core (about 13 s of the 23 s this step took).
  step 2 "torch 2.13.0 (CPU build) and numpy: the largest download, a minute or more"
  # The indexes pip is configured with first (a wheel cache or mirror that holds the +cpu build: found at once);
  # PyTorch's CPU index only when they have none: where it cannot be reached, pip spends a minute or more retrying
  # it for torch and each of its dependencies.
  torch_pins=("torch==2.13.0+cpu" "numpy==2.4.6")   # numpy now: torch warns without it
  if [ -n "${TORCH_INDEX_URL:-}" ] || ! "$VENV/bin/python" -m pip install -q --no-compile "${torch_pins[@]}" >>"$log" 2>&1; then
    pip_install --no-compile --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "${torch_pins[@]}"
  fi
  site_packages=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$VENV/bin/python" -m compileall -q -j 0 "$site_packages/torch" "$site_packages/numpy" >/dev/null 2>&1 &
  bytecode=$!
  # With torch in place, xlaunch.nn's and xlaunch.llm's kernels compile at every ISA level (the
  # levels this CPU runs first; the others so that a wheel built here serves any x86-64 CPU)
  # while pip installs the rest; `python -m` from here imports xlaunch from this source tree.
  # One process for both (no subshell): the trap's kill reaches the build itself, which then ends its
  # compilers (a `{ a && b; } &` took the signal in its subshell and left them all running).
  "$VENV/bin/python" "${build_kernels[@]}" >"$VENV/nn-build.log" 2>&1 &
  nn_build=$!
  # a failed pip step leaves no compiler behind (the build ends its compilers and scratch folder, then exits)
  trap 'kill "$nn_build" "$bytecode" 2>/dev/null; wait "$nn_build" "$bytecode" 2>/dev/null || true' EXIT
  echo "setup: compiling xlaunch.nn's kernels alongside (log: $VENV/nn-build.log)"
  # torchao (INT8 PT2E flow) is pure Python for the CPU path; --no-deps keeps it off torch's pin.
  step 3 "torchao"
  pip_install --no-deps "torchao==0.18.0"
  # The engines (pinned in pyproject.toml) install next to torch without moving it.
  step 4 "xlaunch and its extras: onnxruntime, openvino and nncf, transformers, optuna, intel-openmp (a minute or more)"
  pip_install -e ".[dev,tune,onnxruntime,openvino,llm]" "intel-openmp==2026.2.0"
  echo "setup: packages installed ($((SECONDS - started)) s)"
  wait "$bytecode" || true   # a file compileall cannot compile is compiled (or not) at import
  touch "$stamp"
fi

# xlaunch.nn's and xlaunch.llm's kernels: compiled once per source, torch and ISA level into
# ~/.cache/xlaunch/{nn,llm} (nothing to do when those builds exist; not keyed by this CPU, so a
# cache or wheel made on one x86-64 machine serves every other); without a compiler the
# pure-torch paths are used.
# A build started above is waited for here.
nn_status=0
if [ -n "${nn_build:-}" ]; then
  wait "$nn_build" || nn_status=$?
  trap - EXIT          # both waited for: their PIDs may name other processes now
  cat "$VENV/nn-build.log"
else
  "$VENV/bin/python" "${build_kernels[@]}" || nn_status=$?
fi
[ "$nn_status" = 0 ] || echo "setup: warning: xlaunch.nn / xlaunch.llm kernels not built (pure-torch paths)" >&2
