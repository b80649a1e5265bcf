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
"""
from __future__ import annotations

import collections
import errno
import io
import os
import select
import stat
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, Optional, TextIO

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
        self._log_tail = b"\n"                 # the last byte written to the log
        self._log_break = False                # the next bytes begin a new writer's output: a newline first
        self.bytes_seen = 0
        self.last_output = time.monotonic()

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes read from the instance's pipe."""
        if not chunk:
            return
        self.bytes_seen += len(chunk)
        self.last_output = time.monotonic()
        if self._log is not None:
            if self._log_break:
                self._log.write(b"\n")
                self._log_break = False
            self._log.write(chunk)
            self._log.flush()
            self._log_tail = chunk[-1:]
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

    def finish_line(self) -> None:
        """The writer ended, the stream goes on (a rank the agent restarts): its unfinished last line goes
        out completed with a newline on the console, and in the log before the next writer's bytes."""
        if self._pending:
            self._emit(self._pending)
            self._pending = b""
        self._log_break = self._log_tail != b"\n"

    def close(self) -> None:
        """End of stream: the partial last line (if any) goes out completed with a newline (the log keeps
        the bytes as written)."""
        if self._pending:
            self._emit(self._pending)
            self._pending = b""
        if self._log is not None:
            self._log.flush()

    def _emit(self, lines: bytes) -> None:
        """Write ``lines`` (newline-separated, without the final newline) with prefixes."""
        self._console.write_lines(self.prefix + lines.replace(b"\n", b"\n" + self.prefix) + b"\n")
