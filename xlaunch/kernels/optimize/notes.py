"""How the optimizer library tells the user something: each message once, on one channel.

Something asked for and not done (or undone) is an ``OptimizeWarning`` through ``warnings``
(filterable, catchable with ``pytest.warns``; ``logging.captureWarnings(True)`` puts it in the
program's logs). It is not also logged: a program with ``logging.basicConfig()`` would print it
twice. What went as planned (a graph frozen, the faster variant kept) is an INFO record on the
``xlaunch.optimize`` logger, and the whole report a DEBUG record."""
from __future__ import annotations

import logging
import sys
import warnings

logger = logging.getLogger("xlaunch.optimize")
# A library logger: records reach the handlers the program configured (e.g. logging.basicConfig);
# without any, Python's last-resort handler would print them, so it is kept quiet.
logger.addHandler(logging.NullHandler())


class OptimizeWarning(UserWarning):
    """Something asked for was not done (or was undone); the message says why."""


def caller_stacklevel() -> int:
    """The stacklevel of the first frame outside xlaunch.kernels (so warnings point at the user)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("xlaunch.kernels"):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str) -> None:
    """``message`` as an OptimizeWarning pointing at the user's call."""
    warnings.warn(f"xlaunch.optimize: {message}", OptimizeWarning, stacklevel=caller_stacklevel())


def info(message: str) -> None:
    """``message`` as an INFO record on the ``xlaunch.optimize`` logger."""
    logger.info("xlaunch.optimize: %s", message)
