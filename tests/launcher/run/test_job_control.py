"""Ctrl-Z and fg with real processes: the whole job stops with xlaunch and goes on with it.

Instances sit in sessions of their own, so the terminal's SIGTSTP reaches xlaunch alone; xlaunch
stops them (SIGSTOP) before it stops itself and continues them when it is continued.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from host_cpus import allowed_cores
from processes import leftovers

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
INSTANCES = min(2, allowed_cores())
# waits for a file, checking every 20 ms; says its pid first
PROGRAM = ("import os, sys, time\n"
           "print('ready', os.getpid(), flush=True)\n"
           "while not os.path.exists(sys.argv[1]):\n"
           "    time.sleep(0.02)\n")


def state(pid: int) -> str:
    """The one-letter state of ``pid`` in ``/proc/PID/stat`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def wait_state(pids: list[int], wanted: bool, timeout: float = 10.0) -> list[str]:
    """Wait until every pid is stopped (``wanted``) or none is; the states seen last."""
    deadline = time.monotonic() + timeout
    while True:
        states = [state(pid) for pid in pids]
        if all((s == "T") == wanted for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.02)


def start(tmp_path: Path, *, own_session: bool) -> tuple[subprocess.Popen, list[int], Path]:
    """xlaunch in a process group of its own (as a shell's job), or in a session of its own (an
    orphaned process group, which the kernel does not stop on SIGTSTP); its instances' pids."""
    go = tmp_path / f"go-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", str(INSTANCES), "--grace-period", "1",
            "--no-python", "--", sys.executable, "-S", "-c", PROGRAM, str(go)]

    def as_a_job() -> None:
        for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGTSTP, signal.SIGCONT):
            signal.signal(number, signal.SIG_DFL)
        if not own_session:
            os.setpgid(0, 0)

    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=as_a_job, start_new_session=own_session)
    assert proc.stdout is not None
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(INSTANCES)]
    return proc, pids, go


def run_to_end(proc: subprocess.Popen, go: Path, act: Callable[[], None]) -> bytes:
    """``act()`` on the running job, then let its instances end (``go``); xlaunch's stderr once it exited 0
    with nothing left running (killed whatever happens)."""
    try:
        act()
        go.touch()
        _out, err = proc.communicate(timeout=30)
    finally:
        go.touch()
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert leftovers(str(go)) == []
    return err


def test_ctrl_z_stops_every_instance_and_fg_continues_them(tmp_path: Path) -> None:
    proc, pids, go = start(tmp_path, own_session=False)

    def stop_and_go_on() -> None:
        proc.send_signal(signal.SIGTSTP)
        assert wait_state([proc.pid], True) == ["T"]
        assert wait_state(pids, True) == ["T"] * INSTANCES       # they went on running before
        time.sleep(0.3)
        assert [state(pid) for pid in pids] == ["T"] * INSTANCES   # and stay stopped with xlaunch
        proc.send_signal(signal.SIGCONT)
        assert "T" not in wait_state(pids, False)

    assert run_to_end(proc, go, stop_and_go_on) == b""


def test_sigtstp_in_an_orphaned_process_group_leaves_nothing_stopped(tmp_path: Path) -> None:
    """The kernel does not stop an orphaned process group on SIGTSTP: neither xlaunch nor its instances stop."""
    proc, pids, go = start(tmp_path, own_session=True)

    def tstp() -> None:
        proc.send_signal(signal.SIGTSTP)
        time.sleep(0.5)
        assert state(proc.pid) != "T"
        assert "T" not in [state(pid) for pid in pids]

    run_to_end(proc, go, tstp)


# says its pid, then on SIGTERM writes argv[1] and exits (a trainer that checkpoints on SIGTERM)
CHECKPOINTS = ("import os, signal, sys, time\n"
               "def stop(*_):\n"
               "    open(sys.argv[1] + f'-{os.getpid()}', 'w').close()\n"
               "    sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, stop)\n"
               "print('ready', os.getpid(), flush=True)\n"
               "time.sleep(60)\n")


def test_kill_9_of_a_stopped_job_lets_its_instances_act_on_sigterm(tmp_path: Path) -> None:
    """Ctrl-Z, then ``kill -9`` of xlaunch: the watchdog's SIGTERM comes with SIGCONT, so each stopped
    instance runs its SIGTERM handler before the grace period ends (it would get SIGKILL stopped)."""
    marker = tmp_path / "checkpointed"
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", str(INSTANCES), "--grace-period", "5",
            "--no-python", "--", sys.executable, "-S", "-c", CHECKPOINTS, str(marker)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.setpgid(0, 0))
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids += [int(proc.stdout.readline().split()[-1]) for _ in range(INSTANCES)]
        proc.send_signal(signal.SIGTSTP)
        assert wait_state(pids, True) == ["T"] * INSTANCES
        proc.kill()
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 4                   # well inside the 5 s grace period
        while len(list(tmp_path.glob("checkpointed-*"))) < INSTANCES and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(p.name for p in tmp_path.glob("checkpointed-*")) == sorted(f"checkpointed-{p}" for p in pids)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# a child that checkpoints on SIGTERM, left running (never waited for) once the leader exits on argv[2]
LEAVES_A_CHILD = ("import os, subprocess, sys, time\n"
                  "child = subprocess.Popen([sys.executable, '-S', '-c', sys.argv[3], sys.argv[1]])\n"
                  "print('ready', child.pid, flush=True)\n"
                  "while not os.path.exists(sys.argv[2]):\n"
                  "    time.sleep(0.02)\n")


@pytest.mark.parametrize("how", ["forwarded", "leftover"])
def test_sigterm_to_an_instance_stopped_from_outside_comes_with_sigcont(tmp_path: Path, how: str) -> None:
    """``kill -STOP`` of an instance (not through xlaunch), then the job ends: the SIGTERM xlaunch sends
    (forwarded from its own, or to the leftovers of a group whose leader ended) comes with SIGCONT, so
    the stopped process runs its handler at once instead of being killed stopped after the grace period."""
    marker, go = tmp_path / "checkpointed", tmp_path / "go"
    program = ["-c", CHECKPOINTS, str(marker)] if how == "forwarded" else \
        ["-c", LEAVES_A_CHILD, str(marker), str(go), CHECKPOINTS]
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", "1", "--grace-period", "20",
            "--no-python", "--", sys.executable, "-S", *program]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.setpgid(0, 0))
    pid = -1
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline().split()[-1])
        if how == "leftover":        # the child must have its handler installed before it is stopped
            assert b"ready" in proc.stdout.readline()
        os.kill(pid, signal.SIGSTOP)
        assert wait_state([pid], True) == ["T"]
        if how == "forwarded":
            proc.send_signal(signal.SIGTERM)
        else:
            go.touch()
        _out, err = proc.communicate(timeout=15)          # well inside the 20 s grace period
        assert (tmp_path / f"checkpointed-{pid}").exists(), err.decode()
        assert proc.returncode == (143 if how == "forwarded" else 0), err.decode()
    finally:
        proc.kill()
        proc.communicate()
        if pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# says its pid, waits for the file argv[1], exits 3
FAILS_AT_GO = ("import os, sys, time\n"
               "print('ready', os.getpid(), flush=True)\n"
               "while not os.path.exists(sys.argv[1]):\n"
               "    time.sleep(0.01)\n"
               "sys.exit(3)\n")


@pytest.mark.skipif(INSTANCES < 2, reason="needs 2 allowed CPUs (2 instances)")
def test_instances_failing_at_the_same_moment_each_failed_on_its_own(tmp_path: Path) -> None:
    """Both instances exit 3 before xlaunch reaps either (xlaunch held stopped meanwhile): the first
    failure's fail-fast SIGTERM reaches the other's group when it has already ended, so its row says
    ``exit 3``, not ``stopped after instance 0 failed``."""
    go, summary = tmp_path / "go", tmp_path / "summary.json"
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", "2", "--summary-json", str(summary),
            "--no-python", "--", sys.executable, "-S", "-c", FAILS_AT_GO, str(go)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.setpgid(0, 0))
    try:
        assert proc.stdout is not None
        pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
        proc.send_signal(signal.SIGSTOP)
        assert wait_state([proc.pid], True) == ["T"]
        go.touch()
        deadline = time.monotonic() + 10
        while [state(pid) for pid in pids] != ["Z", "Z"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [state(pid) for pid in pids] == ["Z", "Z"]
        proc.send_signal(signal.SIGCONT)
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 3, err.decode()
    assert [i["status"] for i in json.loads(summary.read_text())["instances"]] == ["exit 3", "exit 3"]


# 24 instances (unpinned: any CPU count) that each exit 3 at one moment, a second after the plan starts
MANY_AT_ONCE = """\
import os, sys, time
from xlaunch.launcher.plan.records import Instance, Plan
from xlaunch.launcher.run.runner import run_plan
at = time.time() + 1.0
# 32 MiB written: the exit takes a few ms to free it, a window between the exit and the zombie
program = f"import os, time; memory = b'x' * (32 << 20); time.sleep(max(0.0, {at!r} - time.time())); os._exit(3)"
plan = Plan(tuple(Instance(i, (), (), dict(os.environ), (sys.executable, "-S", "-c", program), bind="none",
                           membind="none") for i in range(24)))
sys.exit(run_plan(plan, log_dir=None, log_file_prefix="x", keep_going=False, grace_period=5, quiet=True,
                  summary_json=sys.argv[1]))
"""


def test_many_instances_exiting_at_once_are_never_said_stopped_with_their_own_status(tmp_path: Path) -> None:
    """24 instances exit 3 together: xlaunch's fail-fast SIGTERM finds some of them between their exit and
    their zombie (freeing their memory: the status is set). Each row is 'exit 3' or 'killed by SIGTERM (stopped
    after ...)', never 'exit 3 (stopped after instance N failed)' (in 6 of 6 runs before, 1-3 rows)."""
    summary = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, "-c", MANY_AT_ONCE, str(summary)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3 and done.stderr == "", done.stderr
    statuses = [i["status"] for i in json.loads(summary.read_text())["instances"]]
    assert "exit 3" in statuses and all(s == "exit 3" or s.startswith("killed by SIGTERM (stopped after instance")
                                        for s in statuses), statuses


# instance 0 crashes with a 64 MiB core dump (its own RLIMIT_CORE raised); instance 1 exits 3 once it sees the
# dump under way (PF_DUMPCORE in instance 0's /proc stat), so xlaunch's fail-fast SIGTERM finds instance 0 dumping
CRASH_WITH_CORE = """\
import os, resource, signal
resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
memory = bytearray(os.urandom(1 << 20)) * 64
open("crashing.tmp", "w").write(str(os.getpid()))
os.rename("crashing.tmp", "crashing")     # whole: the other instance read an empty file, /proc//stat
os.kill(os.getpid(), signal.SIGSEGV)
"""
FAILS_WHILE_IT_DUMPS = """\
import os, time
while not os.path.exists("crashing"):
    time.sleep(0.001)
pid = open("crashing").read()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[6]) & 0x200:
            break
    except (OSError, ValueError, IndexError):
        break
os._exit(3)
"""


def _core_pattern() -> str:
    try:
        return Path("/proc/sys/kernel/core_pattern").read_text().strip()
    except OSError:
        return "|"


@pytest.mark.skipif(INSTANCES < 2, reason="needs 2 allowed CPUs (2 instances)")
@pytest.mark.skipif(_core_pattern().startswith("|"), reason="core dumps go to a handler program here (a crash record)")
def test_an_instance_writing_its_core_dump_when_another_fails_crashed_on_its_own(tmp_path: Path) -> None:
    """A core dump takes a while (here 64 MiB); the fail-fast SIGTERM that reaches the dumping instance changes
    nothing: its row is 'killed by SIGSEGV (core dumped)', not '... (stopped after instance 1 failed)'."""
    summary = tmp_path / "summary.json"
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", str(INSTANCES), "--bind-with", "none",
            "--summary-json", str(summary), "--no-python", "--", sys.executable, "-S", "-c",
            "import os, sys; exec(sys.argv[1 + int(os.environ['XLAUNCH_INSTANCE_INDEX'])])",
            CRASH_WITH_CORE, FAILS_WHILE_IT_DUMPS]
    done = subprocess.run(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode in (3, 139), done.stderr
    statuses = [i["status"] for i in json.loads(summary.read_text())["instances"]]
    assert statuses[0].startswith("killed by SIGSEGV") and "stopped after" not in statuses[0], statuses


# instance 0's main thread ends (pthread_exit: 'Z' in its stat) while another thread runs on; instance 1 fails
# once it sees that
MAIN_THREAD_ENDS = """\
import ctypes, os, threading, time
threading.Thread(target=time.sleep, args=(30,)).start()
open("main-thread-ends", "w").write(str(os.getpid()))
ctypes.CDLL(None).pthread_exit(None)
"""
FAILS_ONCE_IT_HAS = """\
import os, time
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        if open("/proc/" + open("main-thread-ends").read() + "/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break
    except (OSError, ValueError, IndexError):
        pass
    time.sleep(0.005)
os._exit(5)
"""


@pytest.mark.skipif(INSTANCES < 2, reason="needs 2 allowed CPUs (2 instances)")
def test_an_instance_whose_main_thread_ended_is_still_running_when_stopped(tmp_path: Path) -> None:
    """A process whose main thread ended while another runs on shows 'Z' in /proc/PID/stat: xlaunch's fail-fast
    SIGTERM ends it, so its row says so ('killed by SIGTERM (stopped after instance 1 failed)'; a 'Z' test took
    it for ended on its own and the row said 'killed by SIGTERM' alone, as if it had been its own doing)."""
    summary = tmp_path / "summary.json"
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", "2", "--bind-with", "none", "--grace-period",
            "5", "--summary-json", str(summary), "--no-python", "--", sys.executable, "-S", "-c",
            "import os, sys; exec(sys.argv[1 + int(os.environ['XLAUNCH_INSTANCE_INDEX'])])",
            MAIN_THREAD_ENDS, FAILS_ONCE_IT_HAS]
    done = subprocess.run(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    statuses = [i["status"] for i in json.loads(summary.read_text())["instances"]]
    assert statuses == ["killed by SIGTERM (stopped after instance 1 failed)", "exit 5"], statuses
