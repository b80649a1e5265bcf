"""One process while it runs (an instance xlaunch started, or a rank torch's agent started), how
its end is told (``exit 3``, ``killed by SIGSEGV``), and how a :class:`~.supervisor.Supervisor`
reads its pipe (:class:`OutputSteps`, the supervisor's output half).

While the console queue is full the loop stops reading pipes (back-pressure: nothing is lost,
instances wait in their writes) and keeps acting on signals, exits and deadlines; what a write to
the console or stderr drops (a full disk, a closed stream) is warned about once and counted at the
end, the job itself untouched."""
from __future__ import annotations

import errno
import os
import re
import selectors
import subprocess
from stat import S_ISREG

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Callable, Optional

    from xlaunch.launcher.observe.kernel_filter import VerboseFilter
    from xlaunch.launcher.run.console import Console
    from xlaunch.launcher.run.logfiles import LogFiles
    from xlaunch.launcher.run.signals import SignalInbox

from xlaunch._records import factory, record
from xlaunch.launcher.plan.records import Instance
from xlaunch.launcher.run.console import InstanceStream
from xlaunch.launcher.run.signals import JOB_CONTROL, job_control, signal_name


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


def _stat_fields(pid: int) -> Optional[list[bytes]]:
    """The fields of ``/proc/PID/stat`` after the command name (the state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def zombie_status(pid: int) -> Optional[tuple[int, int]]:
    """``(CLD_* code, value)`` of an exited process not reaped yet, from ``/proc/PID/stat``."""
    fields = _stat_fields(pid)
    if fields is None or fields[:1] != [b"Z"] or len(fields) < 50:
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


# the kernel's flags on a thread that is dying: begun to exit (do_exit), writing a core dump, killed by a signal
_PF_DYING = 0x4 | 0x200 | 0x400            # PF_EXITING | PF_DUMPCORE | PF_SIGNALED
_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in a thread's pending set: how exit_group zaps the other threads


def _exiting(pid: int) -> bool:
    """Every thread of ``pid`` has begun to exit (``PF_EXITING``), is being killed by a signal or writing its
    core dump (``PF_SIGNALED``, ``PF_DUMPCORE``), ended, or has the SIGKILL pending that ``exit_group`` (or a
    fatal signal) sends the others: the exit status is set and no handler runs again, so a signal sent now
    changes nothing. A process caught between its ``exit`` (or crash) and its zombie, which a ``Z`` test alone
    takes for running (a core dump of 300 MiB: a second and more); and one whose main thread ended
    (``pthread_exit``: ``Z`` in its ``stat``) while another runs on, which a ``Z`` test takes for ended."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if fields[:1] in ([b"Z"], [b"X"]) or (fields[6].isdigit() and int(fields[6]) & _PF_DYING):
                continue
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as status:
                pending = next((line.split()[1] for line in status if line.startswith(b"SigPnd:")), b"0")
            if not int(pending, 16) & _SIGKILL_BIT:
                return False
        except FileNotFoundError:
            continue                                   # that thread is gone
        except (OSError, IndexError, ValueError):
            return False
    return True


def ended_child(pid: int) -> bool:
    """``pid`` is a child of this process that has ended, or is ending, and is not reaped yet: a signal sent
    now does not change how it ended (a rank, the child of torch's agent, is never one: see :func:`has_ended`)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[1:2] == [str(os.getpid()).encode()] and _exiting(pid)


def has_ended(pid: int) -> bool:
    """``pid`` has ended or is ending: a zombie, every thread exiting, or no longer there (reaped)."""
    return _stat_fields(pid) is None or _exiting(pid)


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[:1] == [b"Z"]



OPENMP_REGISTRATION = "/dev/shm/__KMP_REGISTERED_LIB_{pid}_{uid}"
_REGISTRATION_TEXT = re.compile(rb"0x[0-9a-f]+-cafe[0-9a-f]+-[\w.+-]+[\s\x00]*")


def remove_openmp_registration(pid: int) -> bool:
    """Remove what a killed process of ours left in ``/dev/shm`` from Intel's or LLVM's OpenMP (the one
    xlaunch preloads): each process registers there (``__KMP_REGISTERED_LIB_<pid>_<uid>``, text
    ``0x<address>-cafe<hex>-<library>``) and removes the file at a normal exit, so every instance
    ended by SIGTERM or SIGKILL left one. Only a regular file of this user holding that text, for a
    ``pid`` that no longer exists, is removed; True when one was."""
    path = OPENMP_REGISTRATION.format(pid=pid, uid=os.getuid())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False                       # none (the usual case), or not ours to read
    try:
        info = os.fstat(fd)
        ours = S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_size <= 4096
        text = os.read(fd, 4096) if ours else b""
    except OSError:
        return False
    finally:
        os.close(fd)
    if not _REGISTRATION_TEXT.fullmatch(text) or exists(pid):
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True

POLL_INTERVAL = 0.2          # upper bound on any wait, in case a wake-up is missed
READ_SIZE = 1 << 16


class OutputSteps:
    """Pipes and sinks; mixed into :class:`~.supervisor.Supervisor`, whose state it uses."""

    children: list[Child]
    console: Console
    messages: Console
    logs: Optional[LogFiles]
    selector: selectors.BaseSelector
    reading: bool
    interrupted: Optional[int]
    _waiting_sinks: set[int]
    _warned: set[str]
    signals: SignalInbox
    log: Callable[[str], None]                   # the Supervisor's messages and loop step
    say: Callable[..., None]
    dispatch: Callable[[selectors.SelectorKey], None]

    def read(self, child: Child) -> None:
        assert child.fd is not None
        try:
            chunk = os.read(child.fd, READ_SIZE)
        except (InterruptedError, BlockingIOError):
            return
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            chunk = b""
        if chunk:
            child.stream.feed(chunk if child.kernels is None else child.kernels.feed(chunk))
        else:
            self.close_pipe(child)

    def close_pipe(self, child: Child) -> None:
        if child.fd is None:
            return
        if child.fd in self.selector.get_map():
            self.selector.unregister(child.fd)
        if child.kernels is not None:     # --kernel-report: the bytes the filter held back
            child.stream.feed(child.kernels.close())
        child.stream.close()
        self.release_pipe(child)
        child.fd = None

    def release_pipe(self, child: Child) -> None:
        """Close the read end of ``child``'s output (subclasses own it differently)."""
        os.close(child.fd)  # type: ignore[arg-type]

    def drain_and_close_pipes(self) -> None:
        """Groups are gone; read what is left in the pipes without waiting, then close them."""
        for child in self.groups():
            self.drain(child)
            self.close_pipe(child)

    def drain(self, child: Child) -> None:
        """Read what ``child``'s pipe holds now, without waiting."""
        while child.fd is not None:
            ready = selectors.DefaultSelector()
            ready.register(child.fd, selectors.EVENT_READ)
            readable = ready.select(0)
            ready.close()
            if not readable:
                return
            self.read(child)

    def pipes(self) -> list[Child]:
        return [c for c in self.children if c.fd is not None]

    def update_reading(self) -> None:
        """Stop reading instance pipes while the console queue is full; resume when half empty."""
        if self.reading and self.console.full:
            for child in self.pipes():
                self.selector.unregister(child.fd)
            self.reading = False
            self.log("console not keeping up: output of instances waits in their pipes")
        elif not self.reading and self.console.queued <= self.console.limit // 2:
            for child in self.pipes():
                self.selector.register(child.fd, selectors.EVENT_READ, child)
            self.reading = True

    def watch_pipe(self, child: Child) -> None:
        if self.reading:
            self.selector.register(child.fd, selectors.EVENT_READ, child)  # type: ignore[arg-type]

    def sync_sinks(self) -> float:
        """Wait for writability of sinks with queued lines; return the longest sleep allowed."""
        longest = POLL_INTERVAL
        for sink in (self.console, self.messages):
            fd = sink.fileno() if sink.waits else None
            if fd is not None and fd not in self._waiting_sinks:
                try:
                    self.selector.register(fd, selectors.EVENT_WRITE, sink)
                    self._waiting_sinks.add(fd)
                except (OSError, ValueError, KeyError):   # not pollable here: try again soon
                    longest = 0.05
            elif fd is None:
                for stale in [s for s in self._waiting_sinks if self.selector.get_key(s).data is sink]:
                    self.selector.unregister(stale)
                    self._waiting_sinks.discard(stale)
        return longest

    def check_output(self) -> None:
        """Warn, once each, when console lines or log lines start being dropped."""
        console = self.console
        if console.dropped_lines and "console" not in self._warned:
            self._warned.add("console")
            where = "; the log files keep everything" if self.logs is not None else ""
            self.say(f"console output is being dropped ({console.problem}){where}", warning=True)
        if self.messages.dropped_lines and "messages" not in self._warned:
            self._warned.add("messages")
            self.log(f"stderr does not take xlaunch's messages ({self.messages.problem}): they are only logged here")
        if self.logs is None:
            return
        for index, log in self.logs.instances.items():
            if log.problem is not None and log.path not in self._warned:
                self._warned.add(log.path)
                self.say(f"{self.noun} {index}: cannot write its log {log.path!r} ({log.problem}): the rest of "
                         f"its output is dropped from the log (the console still shows it)", warning=True)
        launcher = self.logs.launcher
        if launcher is not None and launcher.problem is not None and launcher.path not in self._warned:
            self._warned.add(launcher.path)
            self.say(f"cannot write the launcher log {launcher.path!r} ({launcher.problem}): "
                     "later events are not logged", warning=True)

    def report_drops(self) -> None:
        """The end-of-run count of what was dropped (after the summary, before the last flush)."""
        self.check_output()
        if self.console.dropped_lines:
            self.say(f"{self.console.dropped_lines} line(s) of console output dropped ({self.console.problem})",
                     warning=True)
        if self.logs is not None:
            for index, log in self.logs.instances.items():
                if log.problem is not None:
                    self.say(f"{self.noun} {index}: {log.dropped_lines} line(s) missing at the end of its log "
                             f"({log.problem})", warning=True)
        if self.messages.dropped_lines:
            self.log(f"{self.messages.dropped_lines} line(s) of messages could not be written to stderr "
                     f"({self.messages.problem})")

    def finish_output(self) -> None:
        """Write what the sinks still hold: wait for a slow reader, but not once a signal came."""
        sinks = (self.console, self.messages)
        self.handle_late_signals()
        while any(s.waits for s in sinks) and self.interrupted is None:
            self.sync_sinks()
            for key, _events in self.selector.select(POLL_INTERVAL):
                self.dispatch(key)
            self.handle_late_signals()
        self.console.flush()
        if self.console.waits:
            before = self.console.dropped_lines
            self.console.discard("not read before xlaunch exited")
            self.say(f"{self.console.dropped_lines - before} line(s) of console output were not read before "
                     "xlaunch exited: dropped" + (" (the log files have them)" if self.logs is not None else ""),
                     warning=True)
        self.messages.flush()
        if self.messages.waits:
            self.messages.discard("not read before xlaunch exited")
            self.log(f"{self.messages.dropped_lines} line(s) of messages could not be written to stderr")

    def handle_late_signals(self) -> None:
        """Signals after every group is gone stop the final wait for a reader, nothing else."""
        for number in self.signals.take():
            if number in JOB_CONTROL:     # nothing left to stop but xlaunch itself
                job_control(number, [], self.log)
                continue
            if self.interrupted is None:
                self.interrupted = number
            self.log(f"received {signal_name(number)} while writing the last output: not waiting for the reader")
