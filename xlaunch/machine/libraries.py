"""Find the allocator and OpenMP runtime libraries xlaunch can preload.

Search order is preference order: the running Python's prefix (the venv) and torch's bundled
libs, ``$VIRTUAL_ENV``, ``$CONDA_PREFIX``, ``$LD_LIBRARY_PATH``, the ldconfig cache
(``/etc/ld.so.cache``, parsed here; ``/etc/ld.so.conf`` when there is no cache), then the
multiarch and plain system directories. Libraries are looked up on the real filesystem:
they are what children of this process will load, whatever ``XLAUNCH_FSROOT`` says.
"""
from __future__ import annotations

import os
import stat
import struct
import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterable, Mapping, Optional

from xlaunch.machine.model import Library

# kind -> file names, most specific (versioned soname) first.
LIBRARY_NAMES: dict[str, tuple[str, ...]] = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so.1", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc.so.4", "libtcmalloc.so"),
    "tcmalloc_minimal": ("libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so"),
    "iomp": ("libiomp5.so",),
    "gomp": ("libgomp.so.1", "libgomp.so"),
    "omp": ("libomp.so.5", "libomp.so"),
}
_KIND_OF_NAME = {name: kind for kind, names in LIBRARY_NAMES.items() for name in names}

LD_CACHE = "/etc/ld.so.cache"
LD_CONF = "/etc/ld.so.conf"
MULTIARCH = {
    "x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu",
    "ppc64le": "powerpc64le-linux-gnu", "s390x": "s390x-linux-gnu",
}
SYSTEM_DIRS = ("/usr/lib", "/usr/local/lib", "/lib", "/usr/lib64", "/lib64")

_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_ARCH_FLAGS = {"x86_64": 0x0300, "aarch64": 0x0A00}   # ldconfig FLAG_*_LIB64 bits


def find_libraries(
    env: Optional[Mapping[str, str]] = None,
    *,
    prefixes: Optional[Iterable[str]] = None,
    ld_cache: str = LD_CACHE,
    ld_conf: str = LD_CONF,
    system_dirs: Optional[Iterable[str]] = None,
) -> tuple[Library, ...]:
    """Every library of :data:`LIBRARY_NAMES` found, in search order, one entry per real file."""
    env = os.environ if env is None else env
    found: list[Library] = []
    seen: set[tuple[int, int]] = set()

    def consider(path: str, kind: str, source: str) -> None:
        try:
            st = os.stat(path)      # one system call: exists, is a file, and which file (links too)
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            return
        seen.add((st.st_dev, st.st_ino))
        found.append(Library(kind=kind, path=path, source=source))

    for directory, source in _search_dirs(env, prefixes, ld_cache, ld_conf, system_dirs):
        if directory == LD_CACHE_MARKER:
            for name, path in _ld_cache_entries(ld_cache):
                consider(path, _KIND_OF_NAME[name], source)
            continue
        if not os.path.isdir(directory):
            continue
        for kind, candidates in LIBRARY_NAMES.items():   # stat a few names: no listdir of /usr/lib
            for name in candidates:
                consider(os.path.join(directory, name), kind, source)
    return tuple(found)


LD_CACHE_MARKER = "\0ld.so.cache"


def _search_dirs(
    env: Mapping[str, str],
    prefixes: Optional[Iterable[str]],
    ld_cache: str,
    ld_conf: str,
    system_dirs: Optional[Iterable[str]],
) -> list[tuple[str, str]]:
    dirs: list[tuple[str, str]] = []
    if prefixes is None:
        prefixes = [sys.prefix] + ([env["VIRTUAL_ENV"]] if env.get("VIRTUAL_ENV") else [])
    for prefix in prefixes:
        dirs.append((os.path.join(prefix, "lib"), "venv"))
        python = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        dirs.append((os.path.join(prefix, "lib", python, "site-packages", "torch", "lib"), "torch"))
    if env.get("CONDA_PREFIX"):
        dirs.append((os.path.join(env["CONDA_PREFIX"], "lib"), "conda"))
    for entry in env.get("LD_LIBRARY_PATH", "").split(":"):
        if entry:
            dirs.append((entry, "LD_LIBRARY_PATH"))
    if os.path.isfile(ld_cache):
        dirs.append((LD_CACHE_MARKER, "ldconfig"))
    else:
        dirs += [(d, "ld.so.conf") for d in read_ld_conf(ld_conf)]
    machine = os.uname().machine if hasattr(os, "uname") else ""
    if system_dirs is None:
        triplet = MULTIARCH.get(machine)
        if triplet:
            dirs += [(f"/usr/lib/{triplet}", "multiarch"), (f"/lib/{triplet}", "multiarch"),
                     (f"/usr/local/lib/{triplet}", "multiarch")]
        system_dirs = SYSTEM_DIRS
    dirs += [(d, "system") for d in system_dirs]
    return dirs


def _ld_cache_entries(path: str) -> list[tuple[str, str]]:
    """(soname, path) pairs of the libraries we look for, in cache order (preferred first)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return []
    machine = os.uname().machine if hasattr(os, "uname") else ""
    wanted_arch = _ARCH_FLAGS.get(machine)
    return [
        (key, value)
        for flags, key, value in parse_ld_cache(data, wanted=_KIND_OF_NAME)
        if wanted_arch is None or flags & 0xFF00 == wanted_arch
    ]


def parse_ld_cache(data: bytes, wanted: Optional[Iterable[str]] = None) -> list[tuple[int, str, str]]:
    """Entries ``(flags, soname, path)`` of an ldconfig cache (glibc new format, or old
    ``ld.so-1.7.0`` with or without a new-format section), only sonames in ``wanted`` if
    given. Malformed data gives ``[]``."""
    keep = None if wanted is None else {name.encode() for name in wanted}
    try:
        if data.startswith(_NEW_MAGIC):
            return _parse_new(data, 0, keep)
        if data.startswith(_OLD_MAGIC):
            (count,) = struct.unpack_from("<I", data, 12)
            after_old = 16 + count * 12
            new_at = (after_old + 7) & ~7
            if data[new_at:new_at + len(_NEW_MAGIC)] == _NEW_MAGIC:
                return _parse_new(data, new_at, keep)
            entries = []
            for i in range(count):
                flags, key, value = struct.unpack_from("<iII", data, 16 + i * 12)
                soname = _c_bytes(data, after_old + key)
                if keep is None or soname in keep:
                    entries.append((flags, soname.decode(), _c_bytes(data, after_old + value).decode()))
            return entries
    except (struct.error, IndexError, UnicodeDecodeError):
        return []
    return []


def _parse_new(data: bytes, base: int, keep: Optional[set[bytes]]) -> list[tuple[int, str, str]]:
    # Header: magic[17] version[3] nlibs len_strings flags pad[3] extension_offset unused[3];
    # then nlibs entries (flags, key, value, osversion, hwcap: 24 bytes); offsets from ``base``.
    (count,) = struct.unpack_from("<I", data, base + 20)
    entries = []
    for flags, key, value, _, _ in struct.iter_unpack("<iIIIQ", data[base + 48:base + 48 + count * 24]):
        soname = _c_bytes(data, base + key)
        if keep is None or soname in keep:
            entries.append((flags, soname.decode(), _c_bytes(data, base + value).decode()))
    return entries


def _c_bytes(data: bytes, offset: int) -> bytes:
    return data[offset:data.index(b"\0", offset)]


def read_ld_conf(path: str = LD_CONF, _depth: int = 0) -> list[str]:
    """Directories named by ``ld.so.conf`` and its ``include`` globs, in order."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    dirs: list[str] = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("include") and _depth < 4:
            pattern = line[len("include"):].strip()
            if not os.path.isabs(pattern):
                pattern = os.path.join(os.path.dirname(path), pattern)
            import glob   # only when there is no ld.so.cache

            for included in sorted(glob.glob(pattern)):
                dirs += read_ld_conf(included, _depth + 1)
        elif line.startswith("/"):
            dirs.append(line)
    return dirs
