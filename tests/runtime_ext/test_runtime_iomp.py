"""The whole runtime suite again, in a process where Intel's libiomp5 is preloaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(os.environ.get("XLAUNCH_TEST_OMP_KIND") == "iomp", reason="already the libiomp5 run")
def test_runtime_suite_under_libiomp5(iomp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "LD_PRELOAD": iomp_path, "XLAUNCH_TEST_OMP_KIND": "iomp"}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(HERE)],
        capture_output=True, text=True, timeout=300, cwd=HERE.parents[1], env=env,
    )
    summary = result.stdout.strip().splitlines()[-1:] or [""]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary[0] and "failed" not in summary[0]
