"""Processes that leave their instance's process group (``setsid``, a daemon), with real processes.

xlaunch adopts them (child subreaper) once their parent ends: while the job runs, those that end are
reaped (no zombies pile up in xlaunch); when the job ends, those still running are stopped and named
in a warning, for instances and for the ranks of ``--nproc-per-node`` alike.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from processes import running

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]

# three daemons that end at once and one that would run a minute (its pid in argv[1]), then "ready";
# the program itself ends when the file argv[2] exists
PROGRAM = """\
import os, sys, time
def daemon(seconds):
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork() == 0:
            if seconds:
                open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
            time.sleep(seconds)
            os._exit(0)
        os._exit(0)
    os.waitpid(first, 0)
for seconds in (0, 0, 0, 60):
    daemon(seconds)
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.02)
"""


def _zombie_children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children() if c.status() == psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


def _daemons(record: Path, count: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(p) for p in record.read_text().split()] if record.exists() else []
        if len(pids) >= count:
            return pids
        time.sleep(0.02)
    raise AssertionError(f"{record}: the daemons did not start")


def test_daemons_of_an_instance_are_reaped_while_it_runs_and_stopped_at_its_end(tmp_path: Path) -> None:
    record, done = tmp_path / "daemons", tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "--ninstances", "1", "--grace-period", "1",
                             "--no-python", "--", sys.executable, "-S", "-c", PROGRAM, str(record), str(done)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and b"ready" in proc.stdout.readline()
        daemon = _daemons(record, 1)[0]
        assert psutil.Process(daemon).ppid() == proc.pid        # adopted by xlaunch once its parent ended
        deadline = time.monotonic() + 5
        while _zombie_children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _zombie_children(proc.pid) == []                 # the three that ended were reaped
        done.touch()
        _out, err = proc.communicate(timeout=30)
    finally:
        done.touch()
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert running([daemon]) == []
    assert f"ran on after the job: {daemon} (" in err.decode()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (torch's elastic agent)")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 allowed CPUs (2 ranks)")
def test_daemons_of_ranks_are_stopped_at_the_end_of_the_job(tmp_path: Path) -> None:
    record, done = tmp_path / "daemons", tmp_path / "done"
    done.touch()                      # the ranks end once their daemons started
    script = tmp_path / "rank.py"
    script.write_text(PROGRAM)
    proc = subprocess.run([sys.executable, "-m", "xlaunch", "--nproc-per-node", "2", "--grace-period", "1",
                           str(script), str(record), str(done)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    daemons = _daemons(record, 2)
    assert running(daemons) == [], proc.stderr
    assert "2 process(es) that left their rank's process group" in proc.stderr


# an instance that ignores SIGTERM (a trainer that checkpoints: it outlives the parent-death signal) with
# an adopted daemon (double fork), one that ends at once (its pid in argv[2]) and one whose parent, the
# instance, still runs (a setsid'd child); the long-running ones' pids in argv[1]; then "ready" and wait
ESCAPES = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def daemon(seconds, record):
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork() == 0:
            open(record, "a").write(f"{os.getpid()}\\n")
            time.sleep(seconds)
            os._exit(0)
        os._exit(0)
    os.waitpid(first, 0)
daemon(60, sys.argv[1])
daemon(0, sys.argv[2])
if os.fork() == 0:
    os.setsid()
    open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
    time.sleep(60)
    os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


def test_kill_9_of_xlaunch_stops_the_daemons_of_its_instances(tmp_path: Path) -> None:
    """The watchdog stops what left the instances' groups too: a daemon xlaunch adopted (it announced its
    group to the watchdog) and one whose parent still ran (the watchdog follows the instance's descendants),
    SIGKILL after the grace period, as all of them ignore SIGTERM."""
    record, ended = tmp_path / "daemons", tmp_path / "ended"
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "-q", "--ninstances", "1", "--grace-period", "1",
                             "--no-python", "--", sys.executable, "-S", "-c", ESCAPES, str(record), str(ended)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    daemons: list[int] = []
    try:
        assert proc.stdout is not None and b"ready" in proc.stdout.readline()
        daemons = _daemons(record, 2)
        quick = _daemons(ended, 1)[0]
        deadline = time.monotonic() + 10          # reaped by xlaunch: its look for strays saw the adopted one too
        while psutil.pid_exists(quick) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not psutil.pid_exists(quick)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 8           # the 1 s grace period, then SIGKILL
        while running(daemons) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(daemons) == []
    finally:
        proc.kill()
        proc.communicate()
        for pid in running(daemons):
            os.kill(pid, 9)
