"""Saved quantized models: written without following a symlink, read back with one clear error
for a file that is missing, not ours, damaged or hostile.

Two layouts, both one zip file with the manifest ``xlaunch-quantize.json`` (format, mode, engine,
report, library versions, input signature):

  * torch routes (``static``, ``dynamic``, ``weight_only``, ``fp32``, ``bf16``): a ``torch.export`` archive
    (``.pt2``) with the manifest as its extra file (format 1);
  * ``onnxruntime_static``/``openvino_static``: an xlaunch archive (format 2) of stored
    (uncompressed) entries: the manifest, then ``model.onnx`` or ``model.xml`` + ``model.bin``,
    each with its size and sha256 in the manifest (:mod:`.engine_saved`).

Writing goes to a new temporary file beside ``path`` (created exclusively), renamed over it when
complete: a symlink or a non-regular file at ``path`` is refused, nothing is written anywhere
else, and an interrupted save leaves the old file as it was. Reading opens ``path`` once and
checks it before any engine sees it: a regular file (no directory, FIFO or device), a readable
zip, our manifest (capped at 16 MiB, a format and engine we know); an engine archive holds
exactly the files its engine needs, as regular stored entries (a symlink, directory, compressed,
unknown or duplicate entry is refused), each read with a bound (its recorded size, the archive's
size) and checked against its sha256. Nothing is extracted to disk and nothing in the file is
unpickled or executed. ``torch.export.load`` logs a traceback through torch's loggers before it
raises; those records are held back and the error becomes one ``ValueError`` naming the file.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional

from xlaunch._errors import error_line
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.kernels.quantize import capture, engine_saved, routes

META_FILE = "xlaunch-quantize.json"
FORMAT_VERSION = 1          # a torch.export archive with our manifest
ENGINE_FORMAT_VERSION = 2   # an xlaunch archive of an engine's files
MAX_META_BYTES = 16 << 20
MAX_FILE_BYTES = 1 << 38    # one engine file (256 GiB); it is also bounded by the archive's size
TORCH_MODES = ("static", "dynamic", "weight_only", "fp32", "bf16")
FLOAT_MODES = ("fp32", "bf16")   # the float program (bf16: under autocast)
MODES = (*TORCH_MODES, *engine_saved.ENGINES)
ENGINE_NAMES = ("torch", *engine_saved.FILES)
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
    return error_line(exc, 200).rstrip(": ")


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
        raise ValueError(f"load_quantized: {name} is {kind} (a saved model is one file)")
    return os.fdopen(fd, "rb")


def _read_meta(name: str, handle: Any) -> tuple[zipfile.ZipFile, dict]:
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
    if len(entries) > 1:
        raise ValueError(f"{corrupt}: it holds {len(entries)} {META_FILE} entries")
    if entries[0].file_size > MAX_META_BYTES:
        raise ValueError(f"{corrupt}: its {META_FILE} is {entries[0].file_size} bytes")
    try:
        meta = json.loads(archive.read(entries[0]))
    except Exception as exc:   # a bad CRC, zlib.error, an unknown compression, not JSON, ...
        raise ValueError(f"{corrupt}: {META_FILE}: {_one_line(exc)}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{corrupt}: its {META_FILE} is not an object")
    if not isinstance(meta.get("format"), int) or meta["format"] > ENGINE_FORMAT_VERSION:
        raise ValueError(f"load_quantized: {name} has format {meta.get('format')!r}; this xlaunch reads "
                         f"format {ENGINE_FORMAT_VERSION} and older (a newer xlaunch wrote it?)")
    engine = meta.get("engine", "torch")   # the first format 1 files name no engine
    if engine not in ENGINE_NAMES:
        raise ValueError(f"load_quantized: {name} names engine {engine!r}, which this xlaunch does not run "
                         f"(it knows {', '.join(ENGINE_NAMES)}; a newer xlaunch wrote it?)")
    modes = TORCH_MODES if engine == "torch" else [m for m, e in engine_saved.ENGINES.items() if e == engine]
    if meta.get("mode") not in modes or not isinstance(meta.get("report"), dict):
        raise ValueError(f"{corrupt}: its {META_FILE} has no valid mode for engine {engine} and report")
    return archive, meta


def _engine_files(name: str, archive: zipfile.ZipFile, meta: dict, archive_size: int) -> dict[str, bytes]:
    """The engine's files, each a regular stored entry matching its recorded size and sha256."""
    corrupt = f"load_quantized: {name} is corrupt"
    wanted = engine_saved.FILES[meta["engine"]]
    declared = meta.get("files")
    if not isinstance(declared, dict) or sorted(declared) != sorted(wanted):
        raise ValueError(f"{corrupt}: its manifest does not list the files {', '.join(wanted)}")
    found: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind == stat.S_IFLNK:
            raise ValueError(f"load_quantized: {name} is refused: entry {info.filename!r} is a symbolic link "
                             "(a saved model holds regular files only)")
        if info.is_dir() or kind not in (0, stat.S_IFREG):
            raise ValueError(f"load_quantized: {name} is refused: entry {info.filename!r} is not a regular file")
        if info.filename == META_FILE:
            continue
        if info.filename not in wanted or info.filename in found:
            raise ValueError(f"load_quantized: {name} is refused: unexpected entry {info.filename!r}")
        found[info.filename] = info
    files = {}
    for entry in wanted:
        info, record = found.get(entry), declared[entry]
        if info is None:
            raise ValueError(f"{corrupt}: {entry} is missing")
        size = record.get("size") if isinstance(record, dict) else None
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise ValueError(f"{corrupt}: {entry} is compressed (save stores it)")
        if not isinstance(size, int) or size != info.file_size or not 0 <= size <= min(MAX_FILE_BYTES, archive_size):
            raise ValueError(f"{corrupt}: {entry} is {info.file_size} bytes, its manifest says {size!r}")
        try:
            with archive.open(info) as member:
                data = member.read(size + 1)
        except Exception as exc:   # a bad CRC, a truncated archive, ...
            raise ValueError(f"{corrupt}: {entry}: {_one_line(exc)}") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            raise ValueError(f"{corrupt}: {entry} does not match its recorded size and sha256")
        files[entry] = data
    return files


@dataclass
class Opened:
    """A saved model read back: its manifest, what runs it, and its torch program (or a function
    saying there is none) and module."""

    meta: dict
    runner: Callable[..., Any]
    program: Any
    module: Optional[torch.nn.Module] = None
    check: Optional[Callable[[tuple], None]] = None   # raises one ValueError for a call the model does not serve


def file_name(path: Any, who: str) -> str:
    """``path`` (a str, bytes or os.PathLike) as a str; anything else is one TypeError naming ``who``."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{who}: path must be a str or os.PathLike (a file's path), not {type(path).__name__}")
    name = os.fsdecode(path)
    if not name:     # said "load_quantized: : no such file"
        raise ValueError(f"{who}: '' names no file (give a file's path, e.g. model.pt2)")
    return name


def _torch_model(program: torch.export.ExportedProgram, mode: str,
                 how: Optional[str] = None) -> tuple[Callable[..., Any], torch.nn.Module]:
    module = program.module()
    if mode in ("static", "dynamic"):   # compiled as the saved model was (one compile, not a failed one first)
        return routes.FrozenCompiled(module, how), module   # (FrozenCompiled ignores a how it does not know)

    def runner(*args: Any) -> Any:
        with torch.no_grad():
            return module(*args)
    return runner, module


def read(path: Any) -> Opened:
    """The model file at ``path``, checked, then loaded (torch) or handed to its engine."""
    name = file_name(path, "load_quantized")
    with _open_regular(name) as handle:
        archive, meta = _read_meta(name, handle)
        mode = meta["mode"]
        if meta.get("engine", "torch") != "torch":
            engine_saved.check_installed(name, mode)
            files = _engine_files(name, archive, meta, os.fstat(handle.fileno()).st_size)

            def no_program() -> Any:
                raise ValueError(f"a {mode} model loaded from a file runs on its engine and has no "
                                 "torch.export program")
            return Opened(meta, engine_saved.load(name, mode, meta, files, torch.get_num_threads()), no_program)
        if mode not in FLOAT_MODES:   # a float program holds none of torchao's ops: no import (seconds)
            routes.import_torchao()   # the ops a PT2E program holds, registered only for a file that passed the checks
        routes.register_decomposed_ops()
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
    runner, module = _torch_model(program, mode, meta.get("compile"))
    return Opened(meta, runner, program, module, _call_check(name, mode, meta, program))


def _call_check(name: str, mode: str, meta: dict,
                program: torch.export.ExportedProgram) -> Optional[Callable[[tuple], None]]:
    """Each call of a loaded torch program checked against the manifest's ``inputs``, as engine
    models are: a wrong dtype or feature shape was an AssertionError (``Guard failed: ...``) or a
    RuntimeError from inside the program. None where the manifest's inputs cannot say: a value
    recorded by its repr, or a file whose list left out a baked plain argument (saved before it
    was recorded: fewer entries than the program's arguments)."""
    try:
        arguments = program.call_spec.in_spec.children()[0].num_children
    except (AttributeError, IndexError, TypeError):
        return None
    if not isinstance(meta.get("inputs"), list) or len(meta["inputs"]) != arguments:
        return None
    try:
        signature = engine_saved.Signature({"inputs": meta.get("inputs"), "output_count": 1})
    except ValueError:
        return None

    def check(args: tuple) -> None:
        problem = signature.mismatch(args)
        if problem is not None:
            raise ValueError(f"{mode} model {name}: {problem}")
    return check


# --- writing ---------------------------------------------------------------------------------

def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_new(path: Any, fill: Callable[[BinaryIO], None]) -> None:
    """``fill`` writes the content into a new file beside ``path``, which then replaces ``path``
    (never written through: a symlink or non-regular file there is refused)."""
    name = file_name(path, "save")
    if not name or name.endswith((os.sep, "/")):
        raise ValueError(f"save: {name!r} names no file (give a file's path, e.g. model.pt2)")
    try:
        existing = os.lstat(name)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat.S_ISLNK(existing.st_mode):
        raise ValueError(f"save: {name} is a symbolic link; save does not write through one "
                         "(remove it or give the real path)")
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise ValueError(f"save: {name} exists and is not a regular file")
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"save: {folder}: no such directory")
    try:
        fd, temporary = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(name) + ".", suffix=".partial")
    except OSError as exc:
        raise type(exc)(f"save: cannot create a file in {folder}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _stored(archive: zipfile.ZipFile, entry: str, data: bytes) -> None:
    info = zipfile.ZipInfo(entry, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    archive.writestr(info, data)


def save(path: Any, mode: str, report: dict, runner: Any,
         program: Callable[[], torch.export.ExportedProgram]) -> None:
    """Write a quantized model (see the module docstring for the two layouts)."""
    path = file_name(path, "save")   # before any export (seconds)
    if mode in engine_saved.ENGINES:
        engine = engine_saved.ENGINES[mode]
        files, signature = engine_saved.payload(mode, runner)
        meta = {"format": ENGINE_FORMAT_VERSION, "mode": mode, "engine": engine, "report": report,
                "versions": engine_saved.versions(engine), **signature,
                "files": {k: {"size": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in files.items()}}

        def fill(handle: BinaryIO) -> None:
            with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                _stored(archive, META_FILE, json.dumps(meta).encode("utf-8"))
                for entry in engine_saved.FILES[engine]:
                    _stored(archive, entry, files[entry])
        write_new(path, fill)
        return
    try:
        exported = program()
    except capture.ExportError as exc:
        raise ValueError(f"save: {path}: the {mode} model cannot be saved: {exc} (it runs in this "
                         "process; a saved model is the program torch.export captures)") from None
    meta = {"format": FORMAT_VERSION, "mode": mode, "engine": "torch", "report": report,
            "versions": engine_saved.versions("torch"), "inputs": program_inputs(exported)}
    if isinstance(runner, routes.FrozenCompiled) and runner.calls:   # the batch compile that worked
        meta["compile"] = runner.how
    write_new(path, lambda handle: torch.export.save(exported, handle, extra_files={META_FILE: json.dumps(meta)}))


def program_inputs(program: torch.export.ExportedProgram) -> list[dict[str, Any]]:
    """The program's user inputs as the manifest records them (``null``: a dynamic dimension), in
    order; a plain argument export baked in (no placeholder: ``user_inputs`` holds its value) as
    ``{"value": ...}`` (it was left out, so the list no longer lined up with the arguments)."""
    inputs: list[dict[str, Any]] = []
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    for entry in program.graph_signature.user_inputs:
        node = placeholders.get(entry) if isinstance(entry, str) else None
        value = node.meta.get("val") if node is not None else entry
        if isinstance(value, torch.Tensor):
            inputs.append({"dtype": str(value.dtype).removeprefix("torch."),
                           "shape": [n if isinstance(n, int) else None for n in value.shape]})
        else:
            inputs.append({"value": value if isinstance(value, engine_saved.PLAIN_VALUES) else repr(value)})
    return inputs
