"""The runtime tests that use the OpenMP runtime again, in a process where Intel's libiomp5 is preloaded,
and in one where LLVM's libomp is (``XLAUNCH_TEST_OMP_KIND`` says which runtime must be found).

Rerun: the files whose tests pin, size or read back the team of whatever runtime torch uses
(in this process or in the processes they start). Not rerun, as the same run would repeat:
test_runtime_openmp.py (parses /proc maps text and names, no runtime), test_runtime_topology.py
(pure choices; its live cases choose both runtimes themselves), test_runtime_exit.py (runs
libiomp5 itself) and this file. A new file that uses the runtime belongs in RERUN (checked below).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import loader_env

HERE = Path(__file__).resolve().parent
RERUN = ("test_runtime_pinning.py", "test_runtime_pool.py", "test_runtime_streams.py", "test_runtime_task.py",
         "test_runtime_ipex_names.py")
NOT_RERUN = ("test_runtime_openmp.py", "test_runtime_topology.py", "test_runtime_exit.py", "test_runtime_iomp.py")


def test_every_runtime_test_file_is_rerun_or_said_not_to_be() -> None:
    files = {path.name for path in HERE.glob("test_*.py")}
    assert files == set(RERUN) | set(NOT_RERUN), sorted(files ^ (set(RERUN) | set(NOT_RERUN)))


already_a_rerun = pytest.mark.skipif("XLAUNCH_TEST_OMP_KIND" in os.environ, reason="already a rerun")


@already_a_rerun
def test_runtime_suite_under_libiomp5(iomp_path):
    rerun(iomp_path, "iomp")


@already_a_rerun
def test_runtime_suite_under_llvm_libomp(libomp_path):
    rerun(libomp_path, "omp")


def rerun(library: str, kind: str) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, **loader_env.preload(library), "XLAUNCH_TEST_OMP_KIND": kind}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *(str(HERE / name) for name in RERUN)],
        capture_output=True, text=True, timeout=300, cwd=HERE.parents[1], env=env,
    )
    summary = result.stdout.strip().splitlines()[-1:] or [""]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary[0] and "failed" not in summary[0]
    passed = re.search(r"(\d+) passed", summary[0])
    assert passed is not None and int(passed.group(1)) > 0, summary
