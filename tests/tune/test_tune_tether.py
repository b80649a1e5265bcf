"""A ``kill -9`` of xlaunch-tune (or the OOM killer) leaves nothing of it running: the launcher of
the running trial (and so its instances) and a metric matcher stuck in a backtracking pattern
end with it. Both kept running before (the launcher's instances measured on into the output
directory, beside the trials of a ``--resume``d session)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.live


def _start(tmp_path: Path, program: str, *args: str) -> subprocess.Popen:
    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false, true]\n")
    (tmp_path / "prog.py").write_text(program)
    return subprocess.Popen([sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--ninstances", "1",
                             "--no-plot", "--output-dir", "out", *args, "prog.py"], cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(find, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = find()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("not seen in time")


def _gone(processes: list[psutil.Process], seconds: float = 10.0) -> list[psutil.Process]:
    """Those of ``processes`` still running (not a zombie) after ``seconds``; killed, so that a
    failing test leaves nothing behind either."""
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    left = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for process in left:
        process.kill()
    return left


def test_a_killed_tuner_takes_its_trial_with_it(tmp_path: Path) -> None:
    tuner = _start(tmp_path, "import os, time\nopen('pid.' + str(os.getpid()), 'w').close()\ntime.sleep(60)\n")
    try:
        pid_file = _wait_for(lambda: list(tmp_path.glob("pid.*")))[0]
        program = psutil.Process(int(pid_file.name.split(".")[1]))
        launcher = [p for p in psutil.Process(tuner.pid).children() if "xlaunch" in " ".join(p.cmdline())]
        assert launcher, "the launcher is the tuner's child"
        tuner.send_signal(signal.SIGKILL)
        tuner.wait(10)
        assert _gone([program, *launcher]) == []
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()


def test_a_killed_tuner_takes_its_metric_matcher_with_it(tmp_path: Path) -> None:
    tuner = _start(tmp_path, "print('a' * 40 + '!')\n", "--metric", "(a+)+$", "--timeout", "60")
    try:
        def matcher() -> list[psutil.Process]:
            try:
                return [p for p in psutil.Process(tuner.pid).children() if "finditer" in " ".join(p.cmdline())]
            except psutil.NoSuchProcess:
                return []

        spinning = _wait_for(matcher)
        tuner.send_signal(signal.SIGKILL)
        tuner.wait(10)
        assert _gone(spinning) == []
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
