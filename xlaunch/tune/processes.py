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

**Streams** (the launcher's ``prepare_standard_streams``, then :func:`to_stdout`): closed (``2>&-``), full
(``2>/dev/full``), a pipe whose reader left (``| head``) or a terminal that went away. The session ended at its first message (the
start line on a full stderr: before any trial), or after the whole session at the table (a closed
stdout: ``AttributeError``; ``| head``: ``BrokenPipeError``), exit status 1 whatever it found. Now (as
the launcher does, docs/runner.md): a closed descriptor 0-2 is opened on ``/dev/null``; ``sys.stderr``
drops what its descriptor refuses; results that cannot be written to stdout are one line on stderr
(they are in ``--output-dir``), and the exit status is the session's.
"""
from __future__ import annotations

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
