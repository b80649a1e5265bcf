"""Shared test helpers.

Recorded machines: ``machine_tree(name)`` and ``MACHINE_NAMES`` (from tests/machine_trees.py,
importable by that name from any test module), or the ``recorded_machine`` fixture.

System libraries (jemalloc, tcmalloc, libiomp5, numactl) are installed by ``scripts/setup.sh``.
Locally a missing one skips the tests that need it; under CI (``CI=true``) it is a failure.
"""
from __future__ import annotations

import gc
import glob
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import machine_trees
from machine_trees import MACHINE_NAMES, machine_tree

from xlaunch._torch import paused_gc

REPO = Path(__file__).resolve().parent.parent

# A shell starts a background job (`make test &`) with SIGINT ignored, and an ignored SIGINT is
# inherited: every xlaunch a test starts would then keep ignoring it (as it should: see
# test_startup_signals.py), and the tests that send SIGINT would wait forever. Tests that want
# SIGINT ignored set it themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The variables xlaunch plans for each instance. One set in the shell that runs the suite (CI machines often
# set OMP_NUM_THREADS=1) would be kept by every xlaunch a test starts, with a warning, where the tests expect
# xlaunch's own choices: 7 tests failed under OMP_NUM_THREADS=1. They are taken out of the session (a test of
# a user's value sets it itself); the report header names what was taken out.
PLANNED_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY",
    "KMP_BLOCKTIME", "MALLOC_CONF", "GLIBC_TUNABLES", "TCMALLOC_RELEASE_RATE", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD",
    "ONEDNN_VERBOSE", "DNNL_VERBOSE",
)
TAKEN_OUT = {name: os.environ.pop(name) for name in PLANNED_VARIABLES if name in os.environ}


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not TAKEN_OUT:
        return []
    return ["taken out of the environment (xlaunch plans them): "
            + ", ".join(f"{name}={value}" for name, value in TAKEN_OUT.items())]


# The test workers share the CPUs, and each runs torch in its own process and in the processes
# its tests start. After every parallel region OpenMP's threads spin before they sleep (GNU's
# libgomp ~300,000 spins, Intel's 200 ms): with more threads than CPUs, the spinning takes the CPU
# from the thread that has work. Measured on the AVX2 VM (2 vCPUs, load 3-4): tests/kernels/optim
# and tests/nn/test_nn_merged took 186 s (100 s of CPU) with the default policy, 22 s (20 s) with
# PASSIVE. A test that wants another policy sets its own (children inherit this one).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# xlaunch.llm's measured kernel choice would time kernels against ATen's GEMM in any test that runs
# 16 rows or more on a CPU with native bf16, and then test ATen's path instead of the kernels: the
# kernels always run in tests (and their children); tests/llm/test_llm_kernel_choice.py opts in.
os.environ.setdefault("XLAUNCH_LLM_DENSE_ROWS", "off")

VENV_PREFIX = Path(sys.prefix)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The files that take longest, longest first (per-file sums of --durations, Zen 5 VM, 2026-11-29), so the
# workers (--dist loadfile) do not end with one of them running a long file alone. make test passes
# --no-loadscope-reorder: by default xdist orders files by their number of tests instead.
SLOW_FIRST = (
    "launcher/distributed/test_distributed.py", "kernels/quantize/test_quantize.py",
    "kernels/optimize/test_engines.py", "tune/test_tune_live.py", "launcher/run/test_startup_signals.py",
    "launcher/run/test_runner.py", "llm/test_llm_example.py", "runtime_ext/test_runtime_exit.py",
    "kernels/inject/test_inject.py", "kernels/test_onednn_ceiling.py", "launcher/distributed/test_front_failures.py",
    "llm/test_llm_standalone.py", "kernels/quantize/test_quantize_encoder.py", "runtime_ext/test_runtime_iomp.py",
    "llm/test_llm_loader.py", "runtime_ext/test_runtime_topology.py", "kernels/optimize/test_optimize_ipex.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)
    items.sort(key=rank)   # stable: the order within a file and among the others is kept


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session):
    """No automatic collector passes while the test modules import torch, the engines and transformers: each
    full pass traverses everything imported so far, and collection made 16 of them (2.45 of its 6.4 s in each
    worker, Zen 5 VM, 2026-11-28). pytest_collection_finish collects once, then freezes."""
    with paused_gc():
        yield


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (torch, the engines, every test module) lives for the whole session: frozen,
    the collector's full passes stop traversing it: each worker makes 14-21 of them a run, 0.5 s each
    on pyenv's interpreter unfrozen, 0.23 s on Debian's frozen (AVX2 VM, 2026-11-28). Objects made by the
    tests are collected as before."""
    gc.collect()
    gc.freeze()


_MACHINES_MADE = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """One directory of unpacked recorded machines per session (tests/machine_trees.py): made by the session's
    first process (xdist's controller, or a lone pytest), named in the environment its workers and the pytest
    runs the tests start inherit, removed by the process that made it."""
    if not machine_trees.usable(os.environ.get(machine_trees.SHARED_ENV)):
        path = machine_trees.make_scratch()
        os.environ[machine_trees.SHARED_ENV] = str(path)
        config.stash[_MACHINES_MADE] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_MACHINES_MADE, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(machine_trees.SHARED_ENV, None)


def require(what: str, found: str | None) -> str:
    """Return ``found``; when it is None, skip locally or fail under CI."""
    if found:
        return found
    message = f"{what} is not installed (scripts/setup.sh installs it)"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)
    raise AssertionError("unreachable")


def _first(patterns: list[str]) -> str | None:
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="session", autouse=True)
def engine_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """``optimize(backend=...)`` caches engines under ``XLAUNCH_CACHE_DIR``: the tests (and the
    processes they start) use a folder of their own, never the user's ``~/.cache/xlaunch``."""
    path = tmp_path_factory.mktemp("xlaunch-cache")
    previous = os.environ.get("XLAUNCH_CACHE_DIR")
    os.environ["XLAUNCH_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("XLAUNCH_CACHE_DIR", None)
    else:
        os.environ["XLAUNCH_CACHE_DIR"] = previous


@pytest.fixture()
def one_torch_thread():
    """Timing on a shared 2-vCPU machine: one thread per op keeps the medians meaningful (two
    threads wait on each other whenever another process takes one of the CPUs). Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def jemalloc_path() -> str:
    return require("libjemalloc.so.2", _first(["/usr/lib/*/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2"]))


@pytest.fixture(scope="session")
def tcmalloc_path() -> str:
    return require(
        "libtcmalloc_minimal.so.4",
        _first(["/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4"]),
    )


@pytest.fixture(scope="session")
def iomp_path() -> str:
    return require("libiomp5.so", _first([str(VENV_PREFIX / "lib" / "libiomp5.so")]))


@pytest.fixture(scope="session")
def libomp_path() -> str:
    """LLVM's OpenMP runtime (Debian's libomp5)."""
    return require("libomp.so.5", _first(["/usr/lib/*/libomp.so.5", "/usr/lib/llvm-*/lib/libomp.so.5"]))


@pytest.fixture(scope="session")
def numactl_path() -> str:
    return require("numactl", shutil.which("numactl"))


__all__ = ["MACHINE_NAMES", "machine_tree"]


@pytest.fixture(scope="session")
def recorded_machine():
    """``machine_tree``: name -> the unpacked recorded root (shared, read-only)."""
    return machine_tree


@pytest.fixture()
def marker_script(tmp_path):
    """A program that proves it ran by creating a file: ``(script, marker)``."""
    marker = tmp_path / "started"
    script = tmp_path / "prog.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('x')\n")
    return script, marker
