"""Instance output: whole lines prefixed ``[i] `` on the console, raw bytes in per-instance logs.

Bytes are never decoded: what an instance writes (any encoding, binary, ``\\r``) reaches its
log file unchanged and the console unchanged apart from the prefix. The console only ever
receives complete lines, each written in one piece, so lines of different instances never
mix. A partial last line is completed with a newline on the console when the stream ends;
a line longer than ``max_line`` bytes is cut into ``max_line`` pieces on the console (each
prefixed) so memory stays bounded; log files always keep the exact bytes.
"""
from __future__ import annotations

import io
import os
import select
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, TextIO

DEFAULT_MAX_LINE = 1 << 20


class Console:
    """A sink for complete lines, normally the launcher's stdout.

    Writes go straight to the file descriptor with a loop over partial writes (a signal such as
    SIGCHLD can cut a large pipe write short); objects without a descriptor get ``write()``.
    """

    def __init__(self, stream: BinaryIO | TextIO | None = None) -> None:
        stream = sys.stdout if stream is None else stream
        self._stream: BinaryIO | TextIO | None = stream
        self._fd: int | None = None
        try:
            self._fd = stream.fileno()
            stream.flush()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._fd = None

    def write_lines(self, data: bytes) -> None:
        """Write ``data`` (complete, newline-terminated lines) entirely, or drop it if nobody reads."""
        try:
            if self._fd is not None:
                view = memoryview(data)
                while view:
                    try:
                        view = view[os.write(self._fd, view):]
                    except BlockingIOError:  # stdout left non-blocking by someone: wait, retry
                        select.select([], [self._fd], [])
            elif self._stream is not None:
                binary = getattr(self._stream, "buffer", None)
                if binary is not None or isinstance(self._stream, (io.RawIOBase, io.BufferedIOBase)):
                    (binary or self._stream).write(data)  # type: ignore[union-attr]
                else:
                    self._stream.write(data.decode("utf-8", "replace"))  # type: ignore[arg-type]
                self._stream.flush()
        except BrokenPipeError:
            # The reader went away (``xlaunch ... | head``): keep draining instances, drop output.
            self._fd = None
            self._stream = None


class InstanceStream:
    """Splits one instance's output into lines for the console and copies it to its log."""

    def __init__(self, index: int, console: Console, log: BinaryIO | None = None,
                 max_line: int = DEFAULT_MAX_LINE) -> None:
        self.index = index
        self.prefix = f"[{index}] ".encode()
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
