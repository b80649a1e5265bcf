"""xlaunch as a background job of a terminal with ``stty tostop`` (real pty, real processes).

A background job that writes to its terminal gets SIGTTOU. Instances have no terminal (sessions of
their own), so the kernel stops xlaunch alone: xlaunch stops its instances first, as for Ctrl-Z, and
continues them with itself; ``kill %1`` of the stopped job (SIGTERM, then SIGCONT) ends it.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from host_cpus import allowed_cores
from processes import leftovers

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
INSTANCES = min(2, allowed_cores())

# a shell in miniature: the pty (argv[1]) becomes its controlling terminal with TOSTOP set, the job
# (argv[2:]) runs in a process group of its own in the background; says when it stopped and how it
# ended; "fg" (on stdin) puts it in the foreground and continues it, "kill" sends SIGTERM and SIGCONT
SHELL = r"""
import os, signal, subprocess, sys, termios
fd = os.open(sys.argv[1], os.O_RDWR)
attrs = termios.tcgetattr(fd)
attrs[3] |= termios.TOSTOP
termios.tcsetattr(fd, termios.TCSANOW, attrs)
job = subprocess.Popen(sys.argv[2:], stdin=fd, stdout=fd, stderr=fd, process_group=0)
_pid, status = os.waitpid(job.pid, os.WUNTRACED)
print("stopped" if os.WIFSTOPPED(status) else "ended", os.WSTOPSIG(status) if os.WIFSTOPPED(status) else status,
      flush=True)
command = sys.stdin.readline().strip()
if command == "fg":
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    os.tcsetpgrp(fd, job.pid)
else:
    os.killpg(job.pid, signal.SIGTERM)
os.killpg(job.pid, signal.SIGCONT)
print("continued", flush=True)
_pid, status = os.waitpid(job.pid, 0)
job.returncode = os.waitstatus_to_exitcode(status)
print("exit", job.returncode, flush=True)
"""

# says its pid in a file, waits until every instance did, says ready, waits for DIR/go
PROGRAM = ("import os, sys, time\n"
           "folder, count = sys.argv[1], int(sys.argv[2])\n"
           "open(os.path.join(folder, f'pid-{os.getpid()}'), 'w').close()\n"
           "while len([n for n in os.listdir(folder) if n.startswith('pid-')]) < count:\n"
           "    time.sleep(0.02)\n"
           "print('ready', os.getpid(), flush=True)\n"
           "while not os.path.exists(os.path.join(folder, 'go')):\n"
           "    time.sleep(0.02)\n")


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def wait_states(pids: list[int], stopped: bool, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        states = [state(pid) for pid in pids]
        if all((s == "T") == stopped for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.02)


def read_line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    """The mini shell's next line (``""`` when none came in time)."""
    assert proc.stdout is not None
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            byte = os.read(proc.stdout.fileno(), 1)
            if not byte:
                break
            data += byte
    return data.decode().strip()


def drain(master: int) -> bytes:
    data = b""
    while select.select([master], [], [], 0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("then", ["fg", "kill"])
def test_background_job_stopped_by_tty_output_stops_and_goes_on_with_its_instances(tmp_path: Path,
                                                                                  then: str) -> None:
    master, slave = os.openpty()
    tty = os.ttyname(slave)
    os.close(slave)
    argv = [sys.executable, "-m", "xlaunch", "-q", "--ninstances", str(INSTANCES), "--grace-period", "5",
            "--no-python", "--", sys.executable, "-S", "-c", PROGRAM, str(tmp_path), str(INSTANCES)]
    shell = subprocess.Popen([sys.executable, "-S", "-c", SHELL, tty, *argv], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    output = b""
    try:
        assert read_line(shell) == f"stopped {int(signal.SIGTTOU)}"     # it wrote its first line
        output += drain(master)
        pids = [int(p.name[4:]) for p in tmp_path.glob("pid-*")]
        assert len(pids) == INSTANCES
        assert wait_states(pids, True) == ["T"] * INSTANCES           # stopped with it (they ran on)
        time.sleep(0.3)
        assert [state(pid) for pid in pids] == ["T"] * INSTANCES
        assert shell.stdin is not None
        shell.stdin.write(f"{then}\n".encode())
        shell.stdin.flush()
        assert read_line(shell) == "continued"
        if then == "fg":
            assert "T" not in wait_states(pids, False)
            (tmp_path / "go").touch()
        line = read_line(shell)
        output += drain(master)
        assert line == ("exit 0" if then == "fg" else f"exit {128 + signal.SIGTERM}"), (line, output)
        if then == "fg":
            assert all(f"ready {pid}".encode() in output for pid in pids), output
        assert shell.wait(timeout=10) == 0
        assert leftovers(str(tmp_path)) == []
    finally:
        (tmp_path / "go").touch()
        shell.kill()
        shell.communicate()
        os.close(master)
        for pid in leftovers(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
