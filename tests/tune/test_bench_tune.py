"""bench/tune.py's own logic: a launch that outlives its --timeout is stopped with everything it
started (run_cpu's program is its child, in its process group)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from bench_modules import load
from processes import running, wait_gone

PARENT = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
print("throughput: 1.0 img/s", flush=True)
time.sleep(60)
"""


def test_a_launch_past_its_timeout_leaves_nothing_running(tmp_path: Path) -> None:
    """subprocess.run's timeout killed the launcher alone: its program ran on, an orphan."""
    bench = load("tune")
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    value = bench.run_once("slow", [sys.executable, "-c", PARENT, str(pid_file)], timeout=1.0)
    assert value is None and time.monotonic() - started < 10
    child = int(pid_file.read_text())
    assert running([child]) == [] or wait_gone([child], 0.5) == [], "the launch's child outlived it"
    assert bench.run_once("quick", [sys.executable, "-c", "print('throughput: 2.5 img/s')"], timeout=30) == 2.5
