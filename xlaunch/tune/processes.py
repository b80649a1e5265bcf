"""The tuner as a process: its children die with it, and its standard streams never stop it.

**Children** (:func:`tethered`, :func:`snippet_call`). A launcher or a metric matcher outliving a
``kill -9`` of ``xlaunch-tune`` (or the OOM killer) kept running -- the launcher's instances measured on,
into the output directory, beside the trials of a ``--resume``d session, and a matcher stuck in a
pattern that backtracks spun for hours. Each child asks the kernel for a signal when the tuner's
thread that started it ends (``prctl(PR_SET_PDEATHSIG)``), and ends at once if the tuner is already
gone. That must run in the child; a ``preexec_fn`` is unsafe once the tuner has threads (its progress
bar), so the launcher is started through a few lines of stdlib Python that ask for it and ``exec`` it;
the matcher, a script of ours, runs :data:`SNIPPET` first. The launcher gets SIGTERM (it stops its
instances as on Ctrl-C); the matcher SIGKILL. Linux only; elsewhere nothing is asked.

**Streams** (:func:`prepare`, :func:`to_stdout`): closed (``2>&-``), full (``2>/dev/full``), a pipe whose
reader left (``| head``) or a terminal that went away. The session ended at its first message (the
start line on a full stderr: before any trial), or after the whole session at the table (a closed
stdout: ``AttributeError``; ``| head``: ``BrokenPipeError``), exit status 1 whatever it found. Now (as
the launcher does, docs/runner.md): a closed descriptor 0-2 is opened on ``/dev/null``; ``sys.stderr``
drops what its descriptor refuses; results that cannot be written to stdout are one line on stderr
(they are in ``--output-dir``), and the exit status is the session's.
"""
from __future__ import annotations

import io
import os
import signal
import sys
from typing import Callable

SNIPPET = """
def _die_with_parent(parent, number):
    import ctypes, os
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, number, 0, 0, 0)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):
        return
    if os.getppid() != parent:          # gone before the request: nobody would send the signal
        os._exit(128 + number)
"""
_EXEC = SNIPPET + """
import os, sys
_die_with_parent(int(sys.argv[1]), int(sys.argv[2]))
os.execvp(sys.argv[3], sys.argv[3:])
"""


def tethered(argv: list[str], number: int = signal.SIGTERM) -> list[str]:
    """``argv`` (its first item a path, or a name looked up in PATH) started so that it gets ``number`` when this process ends."""
    return [sys.executable, "-I", "-S", "-c", _EXEC, str(os.getpid()), str(int(number)), *argv]


def snippet_call(number: int = signal.SIGKILL) -> str:
    """Python lines (stdlib) that make the running script get ``number`` when this process ends."""
    return SNIPPET + f"_die_with_parent({os.getpid()}, {int(number)})\n"


class _Dropping(io.RawIOBase):
    """A raw writer on ``fd`` that drops what the descriptor refuses instead of raising."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:          # the progress bar is drawn on a terminal only
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
            except OSError:             # ENOSPC, EPIPE, EIO (the terminal is gone), EAGAIN: dropped
                break
        return size


def prepare() -> None:
    """First thing in ``xlaunch-tune``: closed descriptors 0-2 on /dev/null, a ``sys.stderr`` that never raises."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)      # noqa: SIM115 - lives as long as the process
    old = sys.stderr
    try:
        if old is not None:
            old.flush()
    except (OSError, ValueError):
        pass
    sys.stderr = io.TextIOWrapper(_Dropping(2), encoding=getattr(old, "encoding", None) or "utf-8",  # type: ignore[arg-type]
                                  errors="backslashreplace", line_buffering=True, write_through=True)


def to_stdout(write: Callable[[], None], where: str) -> None:
    """Run ``write()`` (it prints the results) and flush; a stdout that refuses them is one line on
    stderr naming ``where`` they are kept, and nothing more is sent there (nor at exit)."""
    try:
        write()
        sys.stdout.flush()
    except (OSError, ValueError, SystemExit) as exc:     # ValueError: a closed file object; SystemExit:
        import errno                                        # rich's answer to a broken pipe

        problem = os.strerror(errno.EPIPE) if isinstance(exc, SystemExit) else getattr(exc, "strerror", None) or str(exc)
        sys.stderr.write(f"xlaunch-tune: warning: cannot write the results to stdout ({problem}){where}\n")
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())        # what the buffer holds drains there at exit
            os.close(null)
        except (OSError, ValueError, AttributeError):
            sys.stdout = open(os.devnull, "w")        # noqa: SIM115
