"""Marks around the builds of ``optimize`` and ``quantize`` in oneDNN's verbose stream, so
``xlaunch --kernel-report`` counts the calls made while routes are built, checked and timed apart
from the program's steady state.

Written only when ``XLAUNCH_KERNEL_MARKS=1`` (the plan sets it next to ``ONEDNN_VERBOSE`` under
``--kernel-report``): one line on file descriptor 1, where oneDNN prints, with one ``write()``, so
the mark lands in order between oneDNN's own lines (each of them one ``printf`` + ``fflush``). The
launcher's filter takes the marks out of the output like oneDNN's lines
(:mod:`xlaunch.launcher.observe.kernel_filter`). No torch here.

    xlaunch_verbose,build,start,optimize
    xlaunch_verbose,build,end,optimize
"""
from __future__ import annotations

import contextlib
import functools
import os

TYPE_CHECKING = False   # the launcher reads MARK_PREFIX: typing stays off its path
if TYPE_CHECKING:
    from typing import Any, Callable, Iterator, TypeVar

    F = TypeVar("F", bound=Callable[..., Any])

MARK_PREFIX = "xlaunch_verbose"
MARKS_ENV = "XLAUNCH_KERNEL_MARKS"


def _mark(edge: str, what: str) -> None:
    if os.environ.get(MARKS_ENV) != "1":
        return
    try:
        os.write(1, f"{MARK_PREFIX},build,{edge},{what.replace(',', ' ')}\n".encode())
    except OSError:     # a closed or full stdout never stops the build
        pass


@contextlib.contextmanager
def building(what: str) -> Iterator[None]:
    """Everything inside is a build: its oneDNN calls are reported apart (nesting is fine)."""
    _mark("start", what)
    try:
        yield
    finally:
        _mark("end", what)


def marked(what: str) -> Callable[[F], F]:
    """``@marked("optimize")``: every call of the function is a build (:func:`building`)."""
    def wrap(function: F) -> F:
        @functools.wraps(function)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with building(what):
                return function(*args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap
