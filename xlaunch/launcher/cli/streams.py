"""The standard streams as xlaunch finds them: closed (``2>&-``), full (``2>/dev/full``) or read by
nobody must never stop a job.

:func:`prepare_standard_streams` runs first thing in the command:

* a closed descriptor 0, 1 or 2 is opened on ``/dev/null``, so no pipe or log file xlaunch
  opens later lands on it (an instance's output written to "stderr" would otherwise go into a
  log or a pipe), and what xlaunch writes there is dropped;
* ``sys.stderr`` becomes a writer that drops what the descriptor refuses (``ENOSPC``, ``EPIPE``,
  a closed stream) instead of raising: a message xlaunch cannot show is lost (it is still in the
  launcher log with ``--log-dir``), the job is not.
"""
from __future__ import annotations

import io
import os
import select
import sys

STALL_LIMIT = 1.0     # seconds a message may wait for a non-blocking stderr before it is dropped


class ForgivingWriter(io.RawIOBase):
    """Raw writer on a descriptor: writes everything it can, drops what the descriptor refuses."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:      # a terminal stays one (a step shown in place: --check-isa --probe, the tuner's bar)
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data)
        size = len(view)
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except InterruptedError:
                continue
            except BlockingIOError:    # left non-blocking by someone: wait a little, then drop
                if not select.select([], [self._fd], [], STALL_LIMIT)[1]:
                    break
            except OSError:
                break
        self.dropped += len(view)
        return size


def prepare_standard_streams() -> None:
    """Open closed standard descriptors on /dev/null; make ``sys.stderr`` drop instead of raise."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)   # noqa: SIM115 - lives as long as the process
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)   # noqa: SIM115
    old = sys.stderr
    encoding = getattr(old, "encoding", None) or "utf-8"
    try:
        if old is not None:
            old.flush()
    except (OSError, ValueError):
        pass
    sys.stderr = io.TextIOWrapper(ForgivingWriter(2), encoding=encoding,  # type: ignore[arg-type]
                                  errors="backslashreplace", line_buffering=True, write_through=True)
