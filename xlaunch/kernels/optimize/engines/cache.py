"""The on-disk cache of chosen routes: built once per machine, loaded by every later process.

Layout under ``$XLAUNCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch``)::

    engines/v1/<key>/entry.json     route, what it kept, the report, each file's size and sha256
    engines/v1/<key>/model.onnx     the route's artifacts (none for eager, torch, inductor)
    engines/v1/<key>.lock           flock'd while one process builds that entry

The key hashes the model (its classes, their forward code, the module tree, every state_dict
tensor's bytes), the sample's input signature (batch size excluded), the routes asked for, the
thread count, the CPU's ISA flags and the versions of torch, the engines and xlaunch.

Writers never corrupt an entry: a process builds it in a private temporary folder and renames the
folder into place (atomic; a second writer's rename fails and its copy is dropped). Processes that
want one key wait on its lock, so ``xlaunch --ninstances 4`` builds once and three instances load.
Readers trust nothing: the entry folder and files are opened without following symlinks, must be
a directory and regular files, ``entry.json`` is read up to 1 MiB, each artifact up to the size it
declares (at most :data:`MAX_ARTIFACT`) and checked against its sha256. A bad entry is
:class:`CorruptEntry`: the caller warns, removes it and builds again.

No torch, typing or shutil at import: the launcher imports :func:`cache_dir` (``--auto-optimize``
points every instance at one cache).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import time

TYPE_CHECKING = False   # the launcher imports cache_dir: typing stays off its path
if TYPE_CHECKING:
    from typing import Any, Iterator, Mapping, Optional

CACHE_ENV = "XLAUNCH_CACHE_DIR"
FORMAT = 1
SUBDIR = os.path.join("engines", f"v{FORMAT}")
ENTRY = "entry.json"
MAX_ENTRY_BYTES = 1 << 20
MAX_ARTIFACT = 8 << 30
LOCK_POLL_S = 0.1
VERSIONED = ("torch", "onnxruntime", "openvino", "onnx", "xlaunch")


class CorruptEntry(Exception):
    """A cache entry that cannot be trusted; the message says why."""


def cache_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """``$XLAUNCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch``."""
    environ = os.environ if environ is None else environ
    given = environ.get(CACHE_ENV, "")
    if given:
        return os.path.abspath(os.path.expanduser(given))
    base = environ.get("XDG_CACHE_HOME", "") or os.path.join(environ.get("HOME", "") or os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "xlaunch")


def library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    return versions


def model_key(model: Any, sample_spec: tuple, routes: tuple, threads: int, isa: str, level: str,
              flags: Mapping[str, Any]) -> str:
    """The cache key of one (model, input signature, routes, machine, libraries)."""
    import torch

    digest = hashlib.blake2b(digest_size=20)

    def add(text: Any) -> None:
        digest.update(repr(text).encode() + b"\0")

    add((FORMAT, routes, threads, isa, level, sorted(flags.items()), sorted(library_versions().items())))
    add(sample_spec)
    add(repr(model))
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__)):
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        add((cls.__module__, cls.__qualname__))
        if code is not None:
            digest.update(code.co_code)
            add(code.co_consts)
    for name, tensor in model.state_dict().items():
        add((name, str(tensor.dtype), tuple(tensor.shape)))
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        if not flat.numel():
            continue
        try:
            digest.update(flat.view(torch.uint8).numpy().data)
        except (RuntimeError, TypeError):   # quantized and other tensors without a byte view
            import io

            buffer = io.BytesIO()
            torch.save(tensor, buffer)
            digest.update(buffer.getvalue())
    return digest.hexdigest()


class Cache:
    """One cache folder (created 0700 on first write)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, SUBDIR)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _ensure_root(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        info = os.lstat(self.root)
        if not stat.S_ISDIR(info.st_mode):
            raise OSError(errno.ENOTDIR, f"{self.root} is not a directory")

    @contextlib.contextmanager
    def lock(self, key: str, on_wait: Any = None) -> Iterator[None]:
        """Held while this process reads or builds ``key``; others wait (``on_wait()`` is called
        once when they start waiting). The kernel drops the lock if the holder dies."""
        import fcntl

        self._ensure_root()
        fd = os.open(os.path.join(self.root, key + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        time.sleep(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)   # closing the descriptor releases the lock

    # -- reading ----------------------------------------------------------------------------------
    def read(self, key: str) -> Optional[tuple[dict[str, Any], dict[str, bytes]]]:
        """``(entry, files)`` or None when there is no entry; :class:`CorruptEntry` when it is bad."""
        path = self.path(key)
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptEntry(f"{path} is not a plain directory ({exc.strerror})") from None
        try:
            raw = _read_file(dir_fd, ENTRY, MAX_ENTRY_BYTES)
            try:
                entry = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise CorruptEntry(f"{ENTRY} is not valid JSON ({exc})") from None
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
                raise CorruptEntry(f"{ENTRY} is not an entry of this format for this key")
            declared = entry.get("files")
            if not isinstance(declared, dict):
                raise CorruptEntry(f"{ENTRY} lists no files")
            files = {}
            for name, meta in declared.items():
                if not isinstance(name, str) or os.sep in name or name in (".", "..", ENTRY) or not isinstance(meta, dict):
                    raise CorruptEntry(f"{ENTRY} names a bad file {name!r}")
                size = meta.get("size")
                if not isinstance(size, int) or not 0 <= size <= MAX_ARTIFACT:
                    raise CorruptEntry(f"{name}: bad size {size!r}")
                content = _read_file(dir_fd, name, size)
                if len(content) != size or hashlib.sha256(content).hexdigest() != meta.get("sha256"):
                    raise CorruptEntry(f"{name} does not match its recorded size and sha256")
                files[name] = content
            return entry, files
        finally:
            os.close(dir_fd)

    # -- writing ----------------------------------------------------------------------------------
    def write(self, key: str, route: str, state: dict[str, Any], report: dict[str, Any],
              files: Mapping[str, bytes]) -> bool:
        """Publish an entry atomically; False when another process published it first."""
        self._ensure_root()
        temporary = os.path.join(self.root, f".tmp-{key}-{os.getpid()}-{os.urandom(4).hex()}")
        os.mkdir(temporary, 0o700)
        try:
            entry = {"format": FORMAT, "key": key, "route": route, "state": state, "report": report,
                     "created": time.time(), "versions": library_versions(),
                     "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                               for name, data in files.items()}}
            for name, data in files.items():
                _write_new(os.path.join(temporary, name), data)
            _write_new(os.path.join(temporary, ENTRY), json.dumps(entry, indent=1).encode("utf-8"))
            try:
                os.rename(temporary, self.path(key))
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return False
                raise
            return True
        finally:
            if os.path.lexists(temporary):
                import shutil

                shutil.rmtree(temporary, ignore_errors=True)

    def remove(self, key: str) -> None:
        """Move a (corrupt) entry aside atomically, then delete it (a symlink is unlinked, not followed)."""
        path = self.path(key)
        if not os.path.lexists(path):
            return
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
        trash = os.path.join(self.root, f".trash-{key}-{os.getpid()}-{os.urandom(4).hex()}")
        os.rename(path, trash)
        import shutil

        shutil.rmtree(trash, ignore_errors=True)


def _read_file(dir_fd: int, name: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file in ``dir_fd`` (symlinks, FIFOs, devices refused)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise CorruptEntry(f"{name}: cannot open ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptEntry(f"{name} is not a regular file")
        if info.st_size > limit:
            raise CorruptEntry(f"{name} is larger than expected ({info.st_size} > {limit} bytes)")
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_new(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)
