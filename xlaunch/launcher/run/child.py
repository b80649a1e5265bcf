"""One process while it runs (an instance xlaunch started, or a rank torch's agent started), and how
its end is told (``exit 3``, ``killed by SIGSEGV``)."""
from __future__ import annotations

import os
import subprocess

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

    from xlaunch.launcher.observe.kernel_filter import VerboseFilter

from xlaunch._records import factory, record
from xlaunch.launcher.plan.records import Instance
from xlaunch.launcher.run.console import InstanceStream
from xlaunch.launcher.run.signals import signal_name


def status_code(wait_code: int, value: int) -> int:
    """Shell-style status from ``waitid``: the exit code, or 128+N when killed by signal N."""
    return value if wait_code == os.CLD_EXITED else 128 + value


def status_text(wait_code: int, value: int) -> str:
    """``"exit 3"``, ``"killed by SIGSEGV (core dumped)"``."""
    if wait_code == os.CLD_EXITED:
        return f"exit {value}"
    text = f"killed by {signal_name(value)}"
    return text + " (core dumped)" if wait_code == os.CLD_DUMPED else text


@record(frozen=False)
class Child:
    """One instance while it runs."""

    instance: Instance
    stream: InstanceStream
    proc: Optional[subprocess.Popen] = None   # or a RankProcess (a rank the agent started, a forked instance)
    fd: Optional[int] = None              # read end of the output pipe while open
    started: float = 0.0
    ended: Optional[float] = None
    status: Optional[int] = None          # shell-style status once known
    text: str = "not started"
    stopped_by: str = ""                  # why xlaunch signalled it, if it did
    group_alive: bool = False             # its process group may still have members
    kill_at: Optional[float] = None       # when the group gets SIGKILL
    notes: list[str] = factory(list)
    observer: Optional[object] = None     # observe.Observer, from its first sampling interval on
    kernels: Optional[VerboseFilter] = None   # --kernel-report: takes oneDNN's lines out of the stream
    engines: Optional[str] = None         # --auto-optimize: the file it records its engines in

    @property
    def running(self) -> bool:
        return self.proc is not None and self.ended is None

    @property
    def done(self) -> bool:
        """Never started, or ended with nothing left in its process group."""
        return self.proc is None or (self.ended is not None and not self.group_alive)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    @property
    def pgid(self) -> int:
        """Its process group: its own pid (it leads a new session), unless its process says otherwise."""
        return getattr(self.proc, "pgid", None) or self.pid


class RankProcess:
    """A process xlaunch did not start with ``Popen``, so knows by its pid: a rank torch's agent started,
    or an instance the fork server of ``--share-imports`` forked (with ``stdout_fd``, its output pipe)."""

    def __init__(self, pid: int, pgid: int, stdout_fd: Optional[int] = None) -> None:
        self.pid = pid
        self.pgid = pgid
        self.returncode: Optional[int] = None
        self.stdout = os.fdopen(stdout_fd, "rb") if stdout_fd is not None else None


def zombie_status(pid: int) -> Optional[tuple[int, int]]:
    """``(CLD_* code, value)`` of an exited process not reaped yet, from ``/proc/PID/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[:1] != [b"Z"] or len(fields) < 50:
        return None
    raw = int(fields[49])                 # field 52, exit_code: the status as waitpid(2) gives it
    if os.WIFEXITED(raw):
        return os.CLD_EXITED, os.WEXITSTATUS(raw)
    if os.WIFSIGNALED(raw):
        return (os.CLD_DUMPED if os.WCOREDUMP(raw) else os.CLD_KILLED), os.WTERMSIG(raw)
    return None


def exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ended_child(pid: int) -> bool:
    """``pid`` is a child of this process that has ended and is not reaped yet: a signal sent now does
    not change how it ended (a rank, the child of torch's agent, is never one: the agent may have
    stopped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[0] == b"Z" and int(fields[1]) == os.getpid()
    except (OSError, IndexError, ValueError):
        return False


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[:1] == [b"Z"]
    except (OSError, IndexError):
        return False
