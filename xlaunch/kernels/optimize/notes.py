"""How the optimizer library tells the user something: each message once, on one channel.

Something asked for and not done (or undone) is an ``OptimizeWarning`` through ``warnings``
(filterable, catchable with ``pytest.warns``; ``logging.captureWarnings(True)`` puts it in the
program's logs). It is not also logged: a program with ``logging.basicConfig()`` would print it
twice. What went as planned (a graph frozen, the faster variant kept) is an INFO record on the
``xlaunch.optimize`` logger, and the whole report a DEBUG record."""
from __future__ import annotations

import logging
import warnings
from typing import Any

from xlaunch._callers import stacklevel_outside

logger = logging.getLogger("xlaunch.optimize")
# A library logger: records reach the handlers the program configured (e.g. logging.basicConfig);
# without any, Python's last-resort handler would print them, so it is kept quiet.
logger.addHandler(logging.NullHandler())


class OptimizeWarning(UserWarning):
    """Something asked for was not done (or was undone); the message says why."""


class SampleInputError(ValueError):
    """The model fails on the ``sample_input`` it was given (the model's error is the cause)."""

    def __init__(self, exc: BaseException) -> None:
        from xlaunch.kernels.optimize.text import excerpt

        super().__init__(f"optimize: the model fails on sample_input ({type(exc).__name__}: {excerpt(exc)})")


def warn(message: str) -> None:
    """``message`` as an OptimizeWarning pointing at the user's call."""
    warnings.warn(f"xlaunch.optimize: {message}", OptimizeWarning, stacklevel=stacklevel_outside("xlaunch"))


def record_warning(report: Any, message: str) -> None:
    """``message`` in ``report.warnings`` (an optimize report) and as an OptimizeWarning."""
    report.warnings.append(message)
    warn(message)


def info(message: str) -> None:
    """``message`` as an INFO record on the ``xlaunch.optimize`` logger."""
    logger.info("xlaunch.optimize: %s", message)
