"""The tuner's children die with it: a launcher or a metric matcher outliving a ``kill -9`` of
``xlaunch-tune`` (or the OOM killer) kept running -- the launcher's instances measured on, into
the output directory, beside the trials of a ``--resume``d session, and a matcher stuck in a
pattern that backtracks spun for hours.

Each child asks the kernel for a signal when the tuner's thread that started it ends
(``prctl(PR_SET_PDEATHSIG)``), and ends at once if the tuner is already gone. That must run in
the child; a ``preexec_fn`` is unsafe once the tuner has threads (its progress bar), so the
launcher is started through a few lines of stdlib Python that ask for it and ``exec`` it
(:func:`tethered`); the matcher, a script of ours, runs :data:`SNIPPET` first. The launcher
gets SIGTERM (it stops its instances as on Ctrl-C); the matcher SIGKILL. Linux only; elsewhere
nothing is asked.
"""
from __future__ import annotations

import os
import signal
import sys

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
