"""The benches' argparse types: a count or a duration out of range is one line naming the option, exit
status 2, before anything runs (``--rounds 0`` ended in statistics' "no median for empty data" after the
whole run; ``--threads 0`` in torch's traceback). Imports no torch."""
from __future__ import annotations

import argparse
import math
from typing import Callable, Sequence


def integer(least: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, not {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, not {text!r}")
        return value
    check.__name__ = "integer"           # argparse names the type in its own messages
    return check


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, not {text!r}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, not {text!r}")
    return value


def names(known: Sequence[str], accept: Callable[[str], bool] | None = None) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of at least one of ``known`` (or of the names ``accept`` takes, ``known``
    then says them): ``--models foo`` stopped the bench only when it came to that model."""
    def check(text: str) -> list[str]:
        got = [name.strip() for name in text.split(",")]
        unknown = [name for name in got if not (accept(name) if accept else name in known)]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
        return got
    check.__name__ = "names"
    return check


def int_range(text: str) -> tuple[int, int]:
    """An argparse type: ``LOW-HIGH``, integers with 0 <= LOW <= HIGH."""
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high)
    except ValueError:
        bounds = (1, 0)
    if not 0 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"must be LOW-HIGH with integers 0 <= LOW <= HIGH, not {text!r}")
    return bounds


def modules(text: str) -> str:
    """An argparse type: comma-separated modules this Python can import (``--share-imports``: xlaunch's fork server
    that cannot import one starts the copies on their own, and the figures would be labelled shared)."""
    import importlib.util

    for name in text.split(","):
        try:
            found = importlib.util.find_spec(name.strip()) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise argparse.ArgumentTypeError(f"no module named {name.strip()!r}")
    return text


COUNT = integer(1)            # rounds, repetitions, iterations, steps, threads, batch sizes
SECONDS = seconds             # (a name a bench's own ``seconds`` variable does not shadow)
