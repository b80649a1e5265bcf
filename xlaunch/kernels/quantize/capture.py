"""Output held back per thread. torch.export as quantize uses it, quiet when it fails: an export
that fails prints its partial graph on ``sys.stderr`` (``print``, dozens of lines a try) and logs
through torch's loggers; the error then says it in one line (:class:`ExportError`), with the
model's line it stopped at. NNCF and ONNX Runtime while they quantize (:func:`quiet_libraries`):
progress bars on ``sys.stdout``, advice on the root logger.

What the holding thread writes to ``sys.stdout``/``sys.stderr`` or logs is held (Python level
only: file descriptors are never redirected, they are the whole process's); other threads' writes
and records pass through untouched, so a user's own threads lose nothing."""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import warnings
from typing import Any, Iterable, Iterator, Optional

from xlaunch.kernels.optimize.notes import excerpt

_lock = threading.Lock()
_held: dict[int, list[Any]] = {}   # thread ident -> its (stream name, text) and (handler, record) items
_users = 0
_originals: dict[str, Any] = {}
# The quantizers' libraries: their own helper threads (rich's progress refresh) are held while
# :func:`quiet_libraries` runs; their warnings are ignored there.
LIBRARIES = ("nncf", "onnxruntime", "onnx", "openvino", "rich", "tqdm")
_library_users = 0


class ExportError(ValueError):
    """torch.export cannot capture the model; the message is one line."""


class _Dropped(list):
    """Where the libraries' helper threads' writes go: nowhere."""

    def append(self, item: Any) -> None:
        pass


_DROPPED = _Dropped()


def _library_thread(thread: threading.Thread) -> bool:
    modules = (type(thread).__module__, getattr(getattr(thread, "_target", None), "__module__", None))
    return any(isinstance(m, str) and m.split(".")[0] in LIBRARIES for m in modules)


def _holder() -> Optional[list[Any]]:
    """Where this thread's output goes while held, or None (it passes through)."""
    held = _held.get(threading.get_ident())
    if held is None and _library_users and _library_thread(threading.current_thread()):
        return _DROPPED
    return held


class _Stream:
    """``sys.stdout``/``sys.stderr`` while a thread is held: that thread's writes are kept, others'
    go through. A held thread sees no terminal (no progress bar is drawn for it)."""

    def __init__(self, stream: Any, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, text: str) -> int:
        held = _holder()
        if held is None:
            return self._stream.write(text)
        held.append((self._name, text))
        return len(text)

    def isatty(self) -> bool:
        return _holder() is None and self._stream.isatty()

    def flush(self) -> None:
        if _holder() is None:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._stream, name)
        if name == "rich_proxied_file":   # rich's stream proxy (a live display): its consoles write there, held too
            return _Stream(value, self._name)
        return value


class _Records(logging.Filter):
    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        held = _holder()   # a record is handled in the thread that logs it
        if held is None:
            return True
        held.append((self.handler, record))
        return False


def _handlers(prefixes: Iterable[str], root: bool = False) -> list[logging.Handler]:
    """The handlers of the loggers named ``prefix`` or ``prefix.*`` (and the root's, and the last
    resort that prints when no handler is set up)."""
    prefixes = tuple(prefixes)
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name in prefixes or name.startswith(tuple(f"{p}." for p in prefixes))]
    if root:
        loggers.append(logging.getLogger())
    handlers = [h for logger in loggers for h in logger.handlers]
    if root and logging.lastResort is not None:
        handlers.append(logging.lastResort)
    return list({id(h): h for h in handlers}.values())


@contextlib.contextmanager
def held_back(handlers: Optional[list[logging.Handler]] = None) -> Iterator[list[Any]]:
    """Hold this thread's stdout/stderr writes and the records it logs through ``handlers`` (torch's
    by default); the caller gives them out with :func:`give_out` (after a success) or drops them."""
    global _users
    ident = threading.get_ident()
    handlers = _handlers(["torch"]) if handlers is None else handlers
    filters = [_Records(handler) for handler in handlers]
    with _lock:
        if _users == 0:
            for name in ("stdout", "stderr"):
                if getattr(sys, name) is not None:   # None (no console): print() writes nothing, as before
                    _originals[name] = getattr(sys, name)
                    setattr(sys, name, _Stream(_originals[name], name))
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
            if _users == 0:
                for name in ("stdout", "stderr"):   # unless someone replaced it meanwhile
                    original = _originals.pop(name, None)
                    if isinstance(getattr(sys, name), _Stream):
                        setattr(sys, name, original)


def give_out(held: list[Any], min_level: int = logging.NOTSET) -> None:
    """What was held, given out as it would have been: the writes, and the records at ``min_level``
    or above (only the records, when ``min_level`` is set)."""
    for first, second in held:
        if isinstance(first, str):
            stream = getattr(sys, first)
            if min_level == logging.NOTSET and stream is not None:
                stream.write(second)
        elif second.levelno >= min_level:
            first.handle(second)


@contextlib.contextmanager
def ignored_warnings(modules: Iterable[str]) -> Iterator[None]:
    """Warnings raised from ``modules`` (and their submodules) ignored within the block, and no
    others: one filter put first and taken out after (``catch_warnings`` would replace every
    thread's filters for the while, and put back the whole list)."""
    pattern = re.compile(r"(%s)(\.|$)" % "|".join(re.escape(m) for m in modules))
    ignore = ("ignore", None, Warning, pattern, 0)
    with _lock:
        warnings.filters.insert(0, ignore)   # type: ignore[attr-defined]
        _mutated()
    try:
        yield
    finally:
        with _lock:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(ignore)   # type: ignore[attr-defined]
            _mutated()


def _mutated() -> None:
    """Tell the warnings machinery its filters changed (as ``filterwarnings`` does)."""
    mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if mutated is not None:
        mutated()


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """The quantizers' chatter kept from the user, and nothing else: what this thread (and the
    libraries' own helper threads) print or log below ERROR while NNCF or ONNX Runtime quantize
    (NNCF's progress bars, its INFO lines, ONNX Runtime's advice on the root logger), and warnings
    raised from those libraries' modules. Errors they log are given out at the end; the user's
    other threads print, log and warn as usual."""
    global _library_users
    handlers, held = _handlers(LIBRARIES, root=True), []
    with _lock:
        _library_users += 1
    try:
        with ignored_warnings(LIBRARIES), held_back(handlers) as held:
            yield
    finally:
        with _lock:
            _library_users -= 1
        give_out(held, logging.ERROR)


_USER_LINE = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \S+\s*\n\s*(\S[^\n]*)')


def failure(exc: BaseException) -> str:
    """``Type: first line`` of an export's error, with the model's line it stopped at when torch names it."""
    text = str(exc)
    where = _USER_LINE.search(text)
    at = f" (at {where.group(1)}:{where.group(2)}: {where.group(3).strip()})" if where else ""
    return f"{type(exc).__name__}: {excerpt(text)}{at}"
