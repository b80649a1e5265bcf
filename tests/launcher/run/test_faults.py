"""Faults around a running job, with real processes and the real CLI: a console on a full device,
logs on a full file system, stderr closed or full, a reader that stops reading. In each, the job
keeps its own exit status (or stops within the grace period when told to), a warning counts
what was dropped, and /proc shows nothing of the job left running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 allowed CPUs", allow_module_level=True)

# writes its pid to a file, N lines, then exits with a status; "spam" ignores SIGTERM and never ends
PROGRAM = """\
import os, signal, sys
with open(sys.argv[1], "a") as pids:
    pids.write(f"{os.getpid()}\\n")
mode, count = sys.argv[2], int(sys.argv[3])
if mode == "spam":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    i = 0
    while True:
        print(f"spam {i} " + "x" * 70)
        i += 1
index = os.environ["XLAUNCH_INSTANCE_INDEX"]
for i in range(count):
    print(f"line {index} {i} " + "y" * 60)
sys.exit(int(mode))
"""


@pytest.fixture()
def job(tmp_path: Path):
    program = tmp_path / f"job_{uuid.uuid4().hex[:8]}.py"
    program.write_text(PROGRAM)
    pids = tmp_path / "pids"
    pids.touch()
    return program, pids


def xlaunch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "xlaunch", "--ninstances", "2", *args]


def alive(pids_file: Path) -> list[int]:
    """Processes of the job (pids the instances wrote) that still exist and are not zombies."""
    left = []
    for pid in map(int, pids_file.read_text().split()):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            left.append(pid)
    return left


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, timeout=60, **kwargs)


def test_console_on_a_full_device_keeps_the_job_and_the_logs(tmp_path: Path, job) -> None:
    program, pids = job
    with open("/dev/full", "wb") as full:
        # --keep-going: without it, instance 1's exit may stop instance 0 before it printed (seen under load)
        done = run(xlaunch_argv("--keep-going", "--log-dir", str(tmp_path / "logs"), str(program), str(pids), "3", "200"),
                   stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 3, done.stderr                    # the program's status, not a traceback
    assert "Traceback" not in done.stderr
    assert "console output is being dropped (No space left on device)" in done.stderr
    dropped = [line for line in done.stderr.splitlines() if "line(s) of console output dropped" in line]
    assert dropped and int(dropped[0].split("warning: ")[1].split()[0]) > 0, done.stderr
    log = (tmp_path / "logs" / "xlaunch_instance_0.log").read_text().splitlines()
    assert log == [f"line 0 {i} " + "y" * 60 for i in range(200)]       # the log files keep everything
    assert alive(pids) == []


@pytest.mark.parametrize("stderr", ["closed", "full"])
def test_closed_or_full_stderr_never_stops_the_job(tmp_path: Path, job, stderr: str) -> None:
    program, pids = job
    argv = xlaunch_argv("--keep-going", "--log-dir", str(tmp_path / "logs"), str(program), str(pids), "4", "3")
    if stderr == "closed":
        done = run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.close(2))
    else:
        with open("/dev/full", "wb") as full:
            done = run(argv, stdout=subprocess.PIPE, stderr=full)
    assert done.returncode == 4
    lines = done.stdout.decode().splitlines()
    for index in (0, 1):
        assert [line.split()[3] for line in lines if line.startswith(f"[{index}] line")] == ["0", "1", "2"]
    assert len(pids.read_text().split()) == 2                     # both instances ran
    launcher_log = (tmp_path / "logs" / "xlaunch_launcher.log").read_text()
    assert "exit status 4" in launcher_log and "starting 2 instances" in launcher_log   # messages kept there
    assert alive(pids) == []


def _mount_tiny_tmpfs(where: Path) -> None:
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc}): a full file system is not tested")


def test_logs_on_a_full_file_system_keep_the_job(tmp_path: Path, job) -> None:
    program, pids = job
    disk = tmp_path / "tiny"
    _mount_tiny_tmpfs(disk)
    try:
        done = run(xlaunch_argv("--log-dir", str(disk / "logs"), str(program), str(pids), "0", "3000"),
                   capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        for index in (0, 1):   # the console has every line; each log is whole up to where the disk filled
            assert sum(1 for line in done.stdout.splitlines() if line.startswith(f"[{index}] line")) == 3000
            log = (disk / "logs" / f"xlaunch_instance_{index}.log").read_bytes()
            expected = "".join(f"line {index} {i} " + "y" * 60 + "\n" for i in range(3000)).encode()
            assert len(log) < len(expected) and expected.startswith(log)
            missing = [line for line in done.stderr.splitlines()
                       if line.startswith(f"xlaunch: warning: instance {index}: ") and "missing at the end" in line]
            assert missing and "No space left on device" in missing[0], done.stderr
        assert "cannot write its log" in done.stderr
        assert alive(pids) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=10)


def test_a_reader_that_stops_does_not_delay_signals(tmp_path: Path, job) -> None:
    """stdout is a FIFO whose reader opened it and stopped reading; instances spam and ignore
    SIGTERM. SIGTERM to xlaunch: instances get SIGKILL after the 1 s grace period, xlaunch exits
    143 right after, and what the reader never read is reported as dropped."""
    program, pids = job
    fifo = tmp_path / "console"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with open(fifo, "wb") as writer:
            proc = subprocess.Popen(xlaunch_argv("--grace-period", "1", str(program), str(pids), "spam", "0"),
                                    cwd=REPO, stdout=writer, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while len(pids.read_text().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)                                  # the FIFO and xlaunch's queue fill up
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
        took = time.monotonic() - started
    finally:
        os.close(reader)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert took < 1 + 2.0, (took, err)                   # the grace period, not the reader, decided
    assert "killed by SIGKILL (SIGTERM forwarded)" in err
    assert "line(s) of console output were not read before xlaunch exited" in err
    assert alive(pids) == []


def test_a_slow_reader_loses_nothing(tmp_path: Path, job) -> None:
    """A reader that pauses while 2 x 40,000 lines (6 MB, more than the console queue) are
    written gets every line exactly once: instances wait in their pipes meanwhile."""
    program, pids = job
    proc = subprocess.Popen(xlaunch_argv("-q", str(program), str(pids), "0", "40000"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    for index in (0, 1):
        got = [line for line in out.split(b"\n") if line.startswith(f"[{index}] ".encode())]
        assert got == [f"[{index}] line {index} {i} ".encode() + b"y" * 60 for i in range(40000)]
    assert b"dropped" not in err
    assert alive(pids) == []


def test_a_terminal_stays_a_terminal_behind_the_forgiving_stderr() -> None:
    """The stderr that drops what its descriptor refuses said it was no terminal: `xlaunch --check-isa --probe`
    printed a line per step instead of one line rewritten in place, and so would the tuner's progress bar."""
    import pty

    code = ("import sys\nfrom xlaunch.launcher.api import prepare_standard_streams\nprepare_standard_streams()\n"
            "print(sys.stderr.isatty())")
    parent, child = pty.openpty()
    try:
        on_terminal = subprocess.run([sys.executable, "-c", code], stdin=child, stderr=child, capture_output=False,
                                     stdout=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(parent)
        os.close(child)
    piped = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, timeout=60)
    assert (on_terminal.stdout, piped.stdout) == ("True\n", "False\n")
