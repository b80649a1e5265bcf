"""How the optimizer library tells the user something was not done: one message, sent both as an
``OptimizeWarning`` (``warnings``) and as a ``logging`` warning on the ``xlaunch.optimize`` logger,
as ipex does through its own logger."""
from __future__ import annotations

import logging
import sys
import warnings

logger = logging.getLogger("xlaunch.optimize")
# A library logger: records reach the handlers the program configured (e.g. logging.basicConfig);
# without any, Python's last-resort handler would print every message a second time beside the
# warning, so it is kept quiet.
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
    """``message`` as an OptimizeWarning pointing at the user's call, and on the logger."""
    logger.warning("xlaunch.optimize: %s", message)
    warnings.warn(f"xlaunch.optimize: {message}", OptimizeWarning, stacklevel=caller_stacklevel())
