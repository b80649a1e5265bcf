"""Instance output: whole lines prefixed ``[i] `` on the console, raw bytes in per-instance logs.

Bytes are never decoded: what an instance writes (any encoding, binary, ``\\r``) reaches its
log file unchanged and the console unchanged apart from the prefix. The console only ever
receives complete lines, each queued in one piece, so lines of different instances never
mix. A partial last line is completed with a newline on the console when the stream ends;
a line longer than ``max_line`` bytes is cut into ``max_line`` pieces on the console (each
prefixed) so memory stays bounded; log files always keep the exact bytes.

A :class:`Console` never blocks its writer (the runner's one loop, which also acts on signals):
lines are queued and written as far as the descriptor takes them without waiting. The runner
stops reading instances while the queue is full, so a slow reader slows instances down instead
of losing their output; a write that fails (a full disk, ``/dev/full``, a reader gone) drops the
lines and counts them.

:class:`OutputSteps` is the output half of a :class:`~.supervisor.Supervisor`: reading the supervised
groups' pipes, and the two sinks (the console for their lines, stderr for xlaunch's messages) that
never block the loop. While the console queue is full the loop stops reading pipes (back-pressure:
nothing is lost, instances wait in their writes) and keeps acting on signals, exits and deadlines;
what a write drops (a full disk, a closed stream) is warned about once and counted at the end, the
job itself untouched.
"""
from __future__ import annotations

import collections
import errno
import io
import os
import select
import selectors
import stat
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, Callable, Optional, TextIO

    from xlaunch.launcher.run.child import Child
    from xlaunch.launcher.run.logfiles import LogFiles
    from xlaunch.launcher.run.signals import SignalInbox

from xlaunch.launcher.run.signals import JOB_CONTROL, job_control, signal_name

DEFAULT_MAX_LINE = 1 << 20
DEFAULT_LIMIT = 4 << 20      # queued bytes above which the runner stops reading instances
PIPE_CHUNK = select.PIPE_BUF  # what a pipe that polls writable takes without blocking
_STDOUT = object()


class Console:
    """A sink for complete lines, normally the launcher's stdout (instance lines) or stderr (its
    own messages).

    Regular files and block devices are written at once (they never wait for a reader). Pipes,
    sockets and terminals get a write only when they poll writable, at most ``PIPE_BUF`` bytes
    at a time, so a reader that stops reading never blocks the caller: lines wait in the queue
    (:attr:`pending`, :meth:`flush` again when the descriptor is writable). Objects without a
    descriptor (tests' ``BytesIO``) get ``write()``. A write error drops the lines it concerned
    (``ENOSPC``: later lines are tried again) or, for a reader that went away, every line from
    then on; :attr:`dropped_lines` counts them and :attr:`problem` says why.
    """

    def __init__(self, stream: BinaryIO | TextIO | None | object = _STDOUT, *, limit: int = DEFAULT_LIMIT) -> None:
        """``stream``: default ``sys.stdout``; None (a stream Python found closed) takes nothing."""
        stream = sys.stdout if stream is _STDOUT else stream
        self._stream: BinaryIO | TextIO | None = stream  # type: ignore[assignment]
        self._fd: Optional[int] = None
        self._poll: Optional[select.poll] = None
        self.limit = limit
        self._queue: collections.deque[memoryview] = collections.deque()
        self.queued = 0                       # bytes waiting
        self.dropped_lines = 0
        self.problem: Optional[str] = None    # why lines were dropped (the first reason)
        self.gone = stream is None            # nothing will be written any more
        if stream is None:
            self.problem = "closed"
            return
        try:
            self._fd = stream.fileno()
            stream.flush()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._fd = None
        if self._fd is not None:
            try:
                mode = os.fstat(self._fd).st_mode
            except OSError:
                self._fd, self._stream, self.gone = None, None, True
                return
            if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
                self._poll = select.poll()
                self._poll.register(self._fd, select.POLLOUT)

    def fileno(self) -> int:
        """The descriptor to wait on for writability (valid while :attr:`waits` is true)."""
        assert self._fd is not None
        return self._fd

    @property
    def waits(self) -> bool:
        """Lines are queued for a descriptor that may become writable later."""
        return bool(self._queue) and self._poll is not None and not self.gone

    @property
    def full(self) -> bool:
        """The queue holds ``limit`` bytes or more: stop producing lines until it drains."""
        return self.queued >= self.limit

    def write_lines(self, data: bytes) -> None:
        """Queue ``data`` (complete, newline-terminated lines) and write what can be written now."""
        if self.gone:
            self.dropped_lines += data.count(b"\n")
            return
        self._queue.append(memoryview(data))
        self.queued += len(data)
        self.flush()

    def flush(self) -> None:
        """Write queued lines until the descriptor would block or the queue is empty."""
        while self._queue and not self.gone:
            head = self._queue[0]
            if self._fd is None:
                self._write_object(head)
                continue
            if self._poll is not None:
                if not self._poll.poll(0):
                    return
                piece = head[:PIPE_CHUNK]
            else:
                piece = head
            try:
                written = os.write(self._fd, piece)
            except (BlockingIOError, InterruptedError):
                return
            except BrokenPipeError:
                self._give_up("the reader went away")
                return
            except OSError as error:
                self._drop_head(error.strerror or str(error))
                if error.errno in (errno.EBADF, errno.EINVAL):
                    self._give_up(error.strerror or str(error))
                continue
            self.queued -= written
            if written == len(head):
                self._queue.popleft()
            else:
                self._queue[0] = head[written:]

    def discard(self, why: str) -> None:
        """Drop every queued line (counted): nobody will read them in time."""
        while self._queue:
            self._drop_head(why)

    def _write_object(self, head: memoryview) -> None:
        stream = self._stream
        self._queue.popleft()
        self.queued -= len(head)
        try:
            binary = getattr(stream, "buffer", None)
            if binary is not None or isinstance(stream, (io.RawIOBase, io.BufferedIOBase)):
                (binary or stream).write(bytes(head))  # type: ignore[union-attr]
            else:
                stream.write(bytes(head).decode("utf-8", "replace"))  # type: ignore[union-attr]
            stream.flush()  # type: ignore[union-attr]
        except BrokenPipeError:
            self.dropped_lines += head.tobytes().count(b"\n")
            self._give_up("the reader went away")
        except (OSError, ValueError) as error:
            self.dropped_lines += head.tobytes().count(b"\n")
            self.problem = self.problem or str(error)

    def _drop_head(self, why: str) -> None:
        head = self._queue.popleft()
        self.queued -= len(head)
        self.dropped_lines += max(1, head.tobytes().count(b"\n"))
        self.problem = self.problem or why

    def _give_up(self, why: str) -> None:
        """The reader went away (``xlaunch ... | head``): drop this and every later line."""
        self.discard(why)
        self.gone = True
        self.problem = self.problem or why


class InstanceStream:
    """Splits one instance's output into lines for the console and copies it to its log."""

    def __init__(self, index: int, console: Console, log: BinaryIO | None = None,
                 max_line: int = DEFAULT_MAX_LINE, label: Optional[str] = None) -> None:
        self.index = index
        self.prefix = f"[{index if label is None else label}] ".encode()
        self._console = console
        self._log = log
        self._max_line = max_line
        self._pending = b""
        self.bytes_seen = 0
        self.last_output = time.monotonic()

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes read from the instance's pipe."""
        if not chunk:
            return
        self.bytes_seen += len(chunk)
        self.last_output = time.monotonic()
        if self._log is not None:
            self._log.write(chunk)
            self._log.flush()
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._pending = data
        else:
            self._pending = data[end + 1:]
            self._emit(data[:end])
        while len(self._pending) > self._max_line:
            self._emit(self._pending[: self._max_line])
            self._pending = self._pending[self._max_line:]

    def close(self) -> None:
        """End of stream: the partial last line (if any) goes out completed with a newline."""
        if self._pending:
            self._emit(self._pending)
            self._pending = b""
        if self._log is not None:
            self._log.flush()

    def _emit(self, lines: bytes) -> None:
        """Write ``lines`` (newline-separated, without the final newline) with prefixes."""
        self._console.write_lines(self.prefix + lines.replace(b"\n", b"\n" + self.prefix) + b"\n")


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
            while child.fd is not None:
                ready = selectors.DefaultSelector()
                ready.register(child.fd, selectors.EVENT_READ)
                readable = ready.select(0)
                ready.close()
                if not readable:
                    self.close_pipe(child)
                    break
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
