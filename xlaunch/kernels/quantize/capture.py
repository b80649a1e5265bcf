"""torch.export as quantize uses it, quiet when it fails: an export that fails prints its partial
graph on ``sys.stderr`` (``print``, dozens of lines a try) and logs through torch's loggers; the
error then says it in one line (:class:`ExportError`), with the model's line it stopped at.

What the exporting thread prints or logs during a try is held back, and given out when the try
succeeds; other threads' writes pass through untouched (the holding is per thread)."""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from typing import Any, Iterator

from xlaunch.kernels.optimize.notes import excerpt

_lock = threading.Lock()
_held: dict[int, list[Any]] = {}   # thread ident -> its stderr texts and (handler, record) pairs
_users = 0
_original: Any = None


class ExportError(ValueError):
    """torch.export cannot capture the model; the message is one line."""


class _Stderr:
    """``sys.stderr`` while a thread is held: that thread's writes are kept, others' go through."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        held = _held.get(threading.get_ident())
        if held is None:
            return self._stream.write(text)
        held.append(text)
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Records(logging.Filter):
    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        held = _held.get(record.thread or 0)
        if held is None:
            return True
        held.append((self.handler, record))
        return False


def _torch_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    return list({id(h): h for logger in loggers for h in logger.handlers}.values())


@contextlib.contextmanager
def held_back() -> Iterator[list[Any]]:
    """Hold this thread's stderr writes and torch log records; the caller gives them out with
    :func:`give_out` (after a success) or drops them."""
    global _users, _original
    ident = threading.get_ident()
    handlers = _torch_handlers()
    filters = [_Records(handler) for handler in handlers]
    with _lock:
        if _users == 0:
            _original, sys.stderr = sys.stderr, _Stderr(sys.stderr)
        _users += 1
        _held[ident] = held = []
    for handler, record_filter in zip(handlers, filters):
        handler.addFilter(record_filter)
    try:
        yield held
    finally:
        for handler, record_filter in zip(handlers, filters):
            handler.removeFilter(record_filter)
        with _lock:
            _held.pop(ident, None)
            _users -= 1
            if _users == 0 and isinstance(sys.stderr, _Stderr):
                sys.stderr = _original


def give_out(held: list[Any]) -> None:
    """What a successful try printed or logged, given out as it would have been."""
    for item in held:
        if isinstance(item, str):
            sys.stderr.write(item)
        else:
            handler, record = item
            handler.handle(record)


_USER_LINE = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \S+\s*\n\s*(\S[^\n]*)')


def failure(exc: BaseException) -> str:
    """``Type: first line`` of an export's error, with the model's line it stopped at when torch names it."""
    text = str(exc)
    where = _USER_LINE.search(text)
    at = f" (at {where.group(1)}:{where.group(2)}: {where.group(3).strip()})" if where else ""
    return f"{type(exc).__name__}: {excerpt(text)}{at}"
