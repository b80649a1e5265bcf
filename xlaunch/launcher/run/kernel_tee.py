"""``--kernel-report`` for a process that becomes its program (``--per-rank``): a filter process on
its stdout, as ``program | filter`` would be, so the program keeps the engine's pid.

:func:`filter_stdout` is called by the rank just before it ``execve``\\ s the program: it forks a
child that reads a new pipe, and puts the pipe's write end on fd 1. The child passes the
program's bytes on to the original stdout with oneDNN's lines taken out
(:class:`~xlaunch.launcher.observe.kernel_filter.VerboseFilter`) and, at end of file -- when the
program and everything it started have closed their stdout -- writes the report line and its
warnings on stderr, then exits. It ignores SIGINT, SIGTERM and SIGHUP, so the program's last
output is never cut off by the signal that stops the program; a reader that goes away makes it
drain and drop, never block the program. Only stdout passes through it (oneDNN prints there);
stderr stays the program's own.
"""
from __future__ import annotations

import errno
import os
import select
import signal

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

READ_SIZE = 1 << 16


def filter_stdout(label: str, requested_dtype: Optional[str] = None) -> int:
    """Start the filter child (its pid is returned) and make fd 1 the pipe into it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:     # the filter: never returns
        code = 0
        try:
            os.close(write_end)
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(number, signal.SIG_IGN)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)          # the program's stdin is the program's alone
            os.close(null)
            try:
                serve(read_end, 1, 2, label, requested_dtype)
            except Exception:       # never take the program's output down with us: copy the rest as is
                code = 1
                _copy(read_end, [1])
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(read_end)
    os.dup2(write_end, 1)
    os.close(write_end)
    return pid


def serve(source: int, out: int, err: int, label: str, requested_dtype: Optional[str] = None) -> None:
    """Copy ``source`` to ``out`` without oneDNN's lines until end of file; then the report on ``err``."""
    from xlaunch.launcher.observe.kernel_filter import VerboseFilter
    from xlaunch.launcher.observe.kernel_report import kernel_line, kernel_warnings

    keep = VerboseFilter()
    sink: list[Optional[int]] = [out]
    last = b"\n"                       # the last byte passed on
    while True:
        try:
            chunk = os.read(source, READ_SIZE)
        except InterruptedError:
            continue
        if not chunk:
            break
        passed = keep.feed(chunk)
        last = passed[-1:] or last
        _write(sink, passed)
    passed = keep.close()
    last = passed[-1:] or last
    _write(sink, passed)
    data = keep.tally.to_json()
    lines = [f"xlaunch: {label} kernels: {kernel_line(data)}\n"]
    if last != b"\n" and _same_file(out, err):   # the program's last line unfinished: the report on a line of its own
        lines.insert(0, "\n")
    lines += [f"xlaunch: warning: {label}: {warning}\n" for warning in kernel_warnings(data, requested_dtype)]
    _write([err], "".join(lines).encode())


def _same_file(one: int, other: int) -> bool:
    """Whether two descriptors write to one file or pipe (a rank's stdout and stderr share its FIFO)."""
    try:
        a, b = os.fstat(one), os.fstat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _copy(source: int, sink: list[Optional[int]]) -> None:
    while True:
        try:
            chunk = os.read(source, READ_SIZE)
        except InterruptedError:
            continue
        if not chunk:
            return
        _write(sink, chunk)


def _write(sink: list[Optional[int]], data: bytes) -> None:
    """All of ``data`` to ``sink[0]``; a reader gone (or a full disk) turns the sink off for good."""
    view = memoryview(data)
    while view and sink[0] is not None:
        try:
            view = view[os.write(sink[0], view):]
        except InterruptedError:
            continue
        except BlockingIOError:     # our stdout was left non-blocking by someone: wait until it drains
            select.select([], [sink[0]], [])
        except OSError as error:
            if error.errno not in (errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO):
                raise
            sink[0] = None
