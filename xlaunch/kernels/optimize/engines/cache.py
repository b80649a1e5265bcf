"""The on-disk cache of chosen routes: built once per machine, loaded by every later process.

Layout under ``$XLAUNCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch``)::

    engines/v2/<key>/entry.json     route, what it kept, the report, the decision (route, reason,
                                    incumbent, medians), the model's class, the choice key, each
                                    file's size and sha256
    engines/v2/<key>/model.onnx     the route's artifacts (none for eager, torch, inductor)
    engines/v2/<key>.lock           flock'd while one process reads or builds that entry

The key (:mod:`.key`) hashes what runs: the normalized code reached from the modules' classes,
the modules' attributes, the module tree, every state_dict tensor's bytes, the sample's input
signature (batch size excluded), the routes asked for, dtype, level, flags, the thread count, the
CPU's ISA flags and the libraries' versions; equal in every process. The *choice key* leaves the
weights' values out: :meth:`Cache.decision` finds the decision of a model that differs only in
them (the incumbent :func:`.policy.choose` keeps unless beaten).

Bounded: at most ``$XLAUNCH_CACHE_MAX_SIZE`` (default 4 GiB) of entries; each write evicts the
least recently used (a read marks an entry used: its folder's mtime), never one whose lock is
held. ``xlaunch --show-cache`` prints :func:`describe` of :meth:`Cache.entries`.

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
SIZE_ENV = "XLAUNCH_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 4 << 30   # about 20 ResNet-50-sized entries of two engines each
STALE_TEMPORARY_S = 24 * 3600   # a builder's temporary folder this old was left by a killed process
FORMAT = 2   # 2: the key of .key (normalized code, no addresses), last use and size kept
SUBDIR = os.path.join("engines", f"v{FORMAT}")
ENTRY = "entry.json"
MAX_ENTRY_BYTES = 1 << 20
MAX_ARTIFACT = 8 << 30
LOCK_POLL_S = 0.1
VERSIONED = ("torch", "onnxruntime", "openvino", "onnx", "onnxscript", "nncf", "numpy", "xlaunch")


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


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"4G"``, ``"500MiB"``, ``"750M"``, ``"1048576"`` in bytes (binary units); ValueError when not a size."""
    spelled = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (spelled[:-1], spelled[-1]) if spelled[-1:] in _UNITS and spelled[-1:] else (spelled, "")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not value >= 0 or value != value:
        raise ValueError(f"{SIZE_ENV} must be a size such as 4G, 500M or a number of bytes, not {text!r}")
    return int(value * _UNITS[unit])


def max_bytes(environ: Optional[Mapping[str, str]] = None) -> int:
    """The cache's size cap: ``$XLAUNCH_CACHE_MAX_SIZE``, else :data:`DEFAULT_MAX_BYTES` (4 GiB)."""
    environ = os.environ if environ is None else environ
    given = environ.get(SIZE_ENV, "").strip()
    return parse_size(given) if given else DEFAULT_MAX_BYTES


def library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    return versions


def model_keys(model: Any, sample_spec: tuple, routes: tuple, threads: int, isa: str, level: str,
               flags: Mapping[str, Any], dtype: str = "float32") -> tuple[str, str]:
    """``(key, choice key)`` of one (model, input signature, routes, machine, libraries): :mod:`.key`."""
    from xlaunch.kernels.optimize.engines import key

    return key.model_keys(model, sample_spec, routes, threads, isa, level, flags, library_versions(), dtype)


def model_key(model: Any, sample_spec: tuple, routes: tuple, threads: int, isa: str, level: str,
              flags: Mapping[str, Any], dtype: str = "float32") -> str:
    """The cache key (:func:`model_keys`' first)."""
    return model_keys(model, sample_spec, routes, threads, isa, level, flags, dtype)[0]


class Cache:
    """One cache folder (created 0700 on first write), at most ``limit`` bytes of entries
    (default :func:`max_bytes`): each write evicts the least recently used entries beyond it."""

    def __init__(self, root: str, limit: Optional[int] = None) -> None:
        self.root = os.path.join(root, SUBDIR)
        self.limit = max_bytes() if limit is None else limit

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
            try:
                os.utime(dir_fd)   # the folder's mtime is its last use (what eviction goes by)
            except OSError:
                pass
            return entry, files
        finally:
            os.close(dir_fd)

    # -- writing ----------------------------------------------------------------------------------
    def write(self, key: str, route: str, state: dict[str, Any], report: dict[str, Any],
              files: Mapping[str, bytes], meta: Optional[Mapping[str, Any]] = None) -> bool:
        """Publish an entry atomically, then evict beyond the cap; False when another process
        published it first. ``meta``: more JSON facts for the entry (``model``: what
        ``xlaunch --show-cache`` names it; ``decision``: what :func:`.policy.choose` kept and the
        measurements behind it; ``choice_key``: the key without the weights, see :meth:`decision`)."""
        self._ensure_root()
        temporary = os.path.join(self.root, f".tmp-{key}-{os.getpid()}-{os.urandom(4).hex()}")
        os.mkdir(temporary, 0o700)
        try:
            entry = {**dict(meta or {}), "format": FORMAT, "key": key, "route": route, "state": state,
                     "report": report, "created": time.time(), "versions": library_versions(),
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
            self.evict(keep=key)
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


    # -- size cap, listing, decisions --------------------------------------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """Every entry, least recently used first: ``key``, ``size`` (bytes on disk), ``used``
        (last use, epoch seconds), and from its ``entry.json`` (unreadable: ``route`` "?"):
        ``route``, ``model``, ``sample``, ``created``, ``choice_key``, ``decision``."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        found = []
        for name in names:
            path = os.path.join(self.root, name)
            if name.startswith(".") or name.endswith(".lock"):
                continue
            try:
                info = os.lstat(path)
                if not stat.S_ISDIR(info.st_mode):
                    continue
                size = sum(os.lstat(os.path.join(path, f)).st_size for f in os.listdir(path))
            except OSError:
                continue
            item: dict[str, Any] = {"key": name, "size": size, "used": info.st_mtime, "route": "?"}
            try:
                dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    entry = json.loads(_read_file(dir_fd, ENTRY, MAX_ENTRY_BYTES).decode("utf-8"))
                finally:
                    os.close(dir_fd)
                if isinstance(entry, dict):
                    report = entry.get("report") if isinstance(entry.get("report"), dict) else {}
                    item.update(route=entry.get("route", "?"), model=entry.get("model", ""),
                                sample=report.get("sample", ""), created=entry.get("created"),
                                choice_key=entry.get("choice_key"), decision=entry.get("decision"))
            except (OSError, CorruptEntry, ValueError, UnicodeDecodeError):
                pass
            found.append(item)
        return sorted(found, key=lambda item: (item["used"], item["key"]))

    def stored_decision(self, key: str) -> Optional[dict[str, Any]]:
        """The decision stored in ``key``'s entry (its ``entry.json`` only, bounded, no symlink
        followed), or None (no entry, no decision, unreadable: :meth:`read` will say)."""
        try:
            dir_fd = os.open(self.path(key), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            entry = json.loads(_read_file(dir_fd, ENTRY, MAX_ENTRY_BYTES).decode("utf-8"))
        except (OSError, CorruptEntry, ValueError, UnicodeDecodeError):
            return None
        finally:
            os.close(dir_fd)
        decision = entry.get("decision") if isinstance(entry, dict) and entry.get("key") == key else None
        return decision if isinstance(decision, dict) else None

    def decision(self, choice_key: str) -> Optional[dict[str, Any]]:
        """The latest decision stored with an entry of the same model code, inputs, machine and
        libraries (``choice_key``, the key without the weights): the incumbent a new build must
        beat. ``{"route": ..., ...}`` or None."""
        matches = [item for item in self.entries() if item.get("choice_key") == choice_key
                   and isinstance(item.get("decision"), dict) and item["decision"].get("route")]
        return matches[-1]["decision"] if matches else None

    def evict(self, keep: Optional[str] = None) -> list[str]:
        """Remove the least recently used entries until the rest fit in ``self.limit`` (never
        ``keep``, never one a process holds the lock of); also builders' temporary folders left
        for a day. Returns the keys removed."""
        import fcntl

        now = time.time()
        try:
            for name in os.listdir(self.root):
                path = os.path.join(self.root, name)
                if name.startswith((".tmp-", ".trash-")) and now - os.lstat(path).st_mtime > STALE_TEMPORARY_S:
                    import shutil

                    shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        entries = self.entries()
        total = sum(item["size"] for item in entries)
        removed = []
        for item in entries:   # least recently used first
            if total <= self.limit:
                break
            key = item["key"]
            if key == keep:
                continue
            lock_path = os.path.join(self.root, key + ".lock")
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:   # being read or rebuilt right now
                    continue
                try:
                    self.remove(key)
                    os.unlink(lock_path)
                except OSError:
                    continue
            finally:
                os.close(fd)
            total -= item["size"]
            removed.append(key)
        return removed


def describe(root: str, limit: int, entries: list[dict[str, Any]]) -> str:
    """``xlaunch --show-cache``: the folder, its cap, and one line per entry, most recent first."""
    total = sum(item["size"] for item in entries)
    lines = [f"engine cache: {os.path.join(root, SUBDIR)}",
             f"size: {_size(total)} of {_size(limit)} ({len(entries)} entr{'y' if len(entries) == 1 else 'ies'}; cap: ${SIZE_ENV}, "
             f"default {_size(DEFAULT_MAX_BYTES)}; least recently used evicted first)"]
    engines = os.path.dirname(os.path.join(root, SUBDIR))
    try:
        older = sorted(name for name in os.listdir(engines) if name.startswith("v") and name != f"v{FORMAT}")
    except OSError:
        older = []
    if older:
        lines.append(f"older formats, never read again (remove them): {', '.join(os.path.join(engines, n) for n in older)}")
    for item in reversed(entries):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(item["used"]))
        what = " ".join(part for part in (item.get("model") or "", item.get("sample") or "") if part) or "-"
        lines.append(f"  {item['key'][:12]}  {item['route']:<12} {_size(item['size']):>9}  used {used}  {what}")
    return "\n".join(lines)


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


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
    from xlaunch.userfiles import write_all

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


read_regular = _read_file   # for the saved models of :mod:`.saved`: the same bounded, no-symlink reads
write_new = _write_new
