"""How the optimizer library tells the user something: each message once, on one channel.

Something asked for and not done (or undone) is an ``OptimizeWarning`` through ``warnings``
(filterable, catchable with ``pytest.warns``; ``logging.captureWarnings(True)`` puts it in the
program's logs). It is not also logged: a program with ``logging.basicConfig()`` would print it
twice. What went as planned (a graph frozen, the faster variant kept) is an INFO record on the
``xlaunch.optimize`` logger, and the whole report a DEBUG record. Messages of other libraries
are quoted in whole words (:func:`excerpt`). No torch here."""
from __future__ import annotations

import logging
import warnings
from typing import Any

from xlaunch._errors import stacklevel_outside

MAX_QUOTE = 400

logger = logging.getLogger("xlaunch.optimize")
# A library logger: records reach the handlers the program configured (e.g. logging.basicConfig);
# without any, Python's last-resort handler would print them, so it is kept quiet.
logger.addHandler(logging.NullHandler())


class OptimizeWarning(UserWarning):
    """Something asked for was not done (or was undone); the message says why."""


class SampleInputError(ValueError):
    """The model fails on the ``sample_input`` it was given (the model's error is the cause)."""

    def __init__(self, exc: BaseException) -> None:
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


def excerpt(text: object, limit: int = MAX_QUOTE) -> str:
    """The first line of ``text``; a first line longer than ``limit`` ends at its last sentence (or
    word) within the limit, followed by `` (...)``, never in the middle of a word."""
    lines = str(text).strip().splitlines()
    line = lines[0].strip() if lines else ""
    if len(line) <= limit:
        return line
    head = line[:limit]
    stop = max(head.rfind(end) for end in (". ", "! ", "? "))
    cut = head[:stop + 1] if stop > limit // 2 else head[:head.rfind(" ")].rstrip(",;:") if " " in head else head
    return cut + " (...)"
