"""A saved quantized model, read back: one clear error for a file that is missing, not ours, or damaged.

The file is what :meth:`QuantizedModule.save` writes: a ``torch.export`` archive (a zip) holding
``xlaunch-quantize.json`` (mode and report) beside the program. Before torch sees it, the file is
checked here: it must exist and be a regular file (no directory, FIFO or device), be a readable
zip, and hold our JSON (capped at 16 MiB, the format we know). ``torch.export.load`` logs a
traceback through torch's loggers before it raises; those records are held back and the error
becomes the one ``ValueError`` naming the file and the first cause.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import zipfile
from typing import Any, Callable

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

META_FILE = "xlaunch-quantize.json"
FORMAT_VERSION = 1
MAX_META_BYTES = 16 << 20
MODES = ("static", "dynamic", "weight_only", "fp32")
TORCH_LOGGERS = ("torch.export", "torch.export.pt2_archive._package")


class _HeldBack(logging.Filter):
    """Drops every record; keeps the first exception one of them carried."""

    def __init__(self) -> None:
        super().__init__()
        self.first_error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.first_error is None and record.exc_info and record.exc_info[1] is not None:
            self.first_error = record.exc_info[1]
        return False


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def _open_regular(name: str) -> Any:
    """``name`` opened for reading; OSError with a one-line message, ValueError when not a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"load_quantized: {name}: no such file") from None
    except OSError as exc:
        raise type(exc)(f"load_quantized: {name}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ValueError(f"load_quantized: {name} is {kind} (a saved model is one .pt2 file)")
    return os.fdopen(fd, "rb")


def _read_meta(name: str, handle: Any) -> dict:
    corrupt = f"load_quantized: {name} is corrupt or not a saved model"
    try:
        archive = zipfile.ZipFile(handle)
        entries = [info for info in archive.infolist()
                   if info.filename == META_FILE or info.filename.endswith("/extra/" + META_FILE)]
    except Exception as exc:   # BadZipFile, OSError, EOFError, ...
        raise ValueError(f"{corrupt}: {_one_line(exc)}") from None
    if not entries:
        raise ValueError(f"load_quantized: {name} was not written by xlaunch quantize (no {META_FILE}; "
                         "QuantizedModule.save writes it)")
    if entries[0].file_size > MAX_META_BYTES:
        raise ValueError(f"{corrupt}: its {META_FILE} is {entries[0].file_size} bytes")
    try:
        meta = json.loads(archive.read(entries[0]))
    except Exception as exc:   # a bad CRC, zlib.error, an unknown compression, not JSON, ...
        raise ValueError(f"{corrupt}: {META_FILE}: {_one_line(exc)}") from None
    if not isinstance(meta, dict) or meta.get("mode") not in MODES or not isinstance(meta.get("report"), dict):
        raise ValueError(f"{corrupt}: its {META_FILE} has no valid mode and report")
    if not isinstance(meta.get("format"), int) or meta["format"] > FORMAT_VERSION:
        raise ValueError(f"load_quantized: {name} has format {meta.get('format')!r}; this xlaunch reads "
                         f"format {FORMAT_VERSION} and older (a newer xlaunch wrote it?)")
    return meta


def read(path: Any, before_load: Callable[[], Any] = lambda: None) -> tuple[torch.export.ExportedProgram, dict]:
    """(the exported program, the JSON we saved beside it) of the model file at ``path``.
    ``before_load`` runs once the file checks passed, before torch reads the program."""
    name = os.fspath(path)
    with _open_regular(name) as handle:
        meta = _read_meta(name, handle)
        before_load()
        handle.seek(0)
        held = _HeldBack()
        loggers = [logging.getLogger(logger) for logger in TORCH_LOGGERS]
        for logger in loggers:
            logger.addFilter(held)
        try:
            program = torch.export.load(handle)
        except Exception as exc:
            cause = held.first_error or exc
            raise ValueError(f"load_quantized: {name} is corrupt: torch.export cannot load it "
                             f"({_one_line(cause)})") from None
        finally:
            for logger in loggers:
                logger.removeFilter(held)
    return program, meta
