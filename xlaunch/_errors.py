"""Errors a user reads in one line: another library's exception quoted in one line of ours (its
messages may span many lines), and the checks of a user's arguments (no torch needed); and where a
warning points (:func:`stacklevel_outside`: the user's line, not ours).

A count is an integer (``int``, numpy's, a one-element integer tensor: anything with
``__index__``), never a float or a bool, so ``EmbeddingSpec(3.5, 4)`` is refused instead of
truncated to 3 rows; a rate is a real number (``float``, ``int``, numpy's, a one-element tensor);
a flag is a bool (numpy's too), never a string (``"False"`` would be true). Each failure is one
``TypeError`` or ``ValueError`` naming the argument."""
from __future__ import annotations

import math       # built into the interpreter: nothing imported from disk on the launch path
import operator
import sys

TYPE_CHECKING = False   # typing stays off the launch path (the distributed agent quotes errors too)
if TYPE_CHECKING:
    from typing import Any, Optional


def error_line(error: BaseException, limit: "Optional[int]" = 300) -> str:
    """``Type: first line of its message``, that line cut at ``limit`` characters (None: whole)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:limit] if text else ''}"


def as_index(value: "Any") -> "Optional[int]":
    """``value`` as an int when it is an integer (``int``, numpy's, a one-element integer tensor:
    anything with ``__index__``), not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def whole_number(value: "Any", name: str, minimum: "Optional[int]" = 0) -> int:
    """``value`` as an int, at least ``minimum`` (None: any)."""
    number = as_index(value)
    if number is None:
        raise TypeError(f"{name} must be an integer, not {value!r} ({type(value).__name__})")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def real_number(value: "Any", name: str, minimum: "Optional[float]" = None) -> float:
    """``value`` as a finite float, at least ``minimum`` (None: any)."""
    number = None
    if not isinstance(value, (bool, str, bytes)) and hasattr(type(value), "__float__"):
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):   # a tensor of many elements: RuntimeError
            pass
    if number is None:
        raise TypeError(f"{name} must be a number, not {value!r} ({type(value).__name__})")
    if not math.isfinite(number) or (minimum is not None and number < minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return number


def flag(value: "Any", name: str) -> bool:
    """``value`` as a bool: ``True``/``False`` (numpy's, 0 and 1 too), never a string."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__bool__"):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    try:
        if value is True or value is False or value in (0, 1):
            return bool(value)
    except (TypeError, ValueError, RuntimeError):
        pass
    raise TypeError(f"{name} must be True or False, not {value!r}")


def stacklevel_outside(*packages: str) -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the first frame
    whose module is none of ``packages`` and in none of them (``"xlaunch.kernels"``; ``"xlaunch", "torch"``),
    however deep the call came from (a model's forward through ``nn.Module.__call__``, a loader)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _within(frame.f_globals.get("__name__", ""), packages):
        frame, level = frame.f_back, level + 1
    return level


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)
