"""Where the compiled kernels of :mod:`xlaunch._native_build` are kept, and what builds leave there.

The cache folder (``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch``, else a folder of this
user's in the temporary directory), a build's folder made only where no other user could replace what is
built (:func:`build_folder`), whether a library there is whole (:func:`incomplete`), and the tidying each
build does (:func:`tidy_cache`). No torch here.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from xlaunch.userfiles import untrusted_folder


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch``; only an absolute path counts (the XDG rule: a
    relative ``XDG_CACHE_HOME`` is ignored), so the cache never follows the current directory. With neither
    (``HOME`` unset for a user that has no passwd entry: a container's ``--user``), ``xlaunch-cache-<uid>``
    in the temporary directory (a builder refuses it when another user made it)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "xlaunch"
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        return Path(home) / ".cache" / "xlaunch"
    return Path(tempfile.gettempdir()) / f"xlaunch-cache-{os.geteuid()}"


def incomplete(path: Path) -> Optional[str]:
    """Why ``path`` is not a whole 64-bit little-endian ELF library (truncated, or not ELF), or None.

    Loading a library shorter than its headers say crashes the process (SIGBUS), not an error."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header = handle.read(64)
            if len(header) < 64 or header[:6] != b"\x7fELF\x02\x01":
                return "not a 64-bit little-endian ELF file"
            phoff, shoff = struct.unpack_from("<QQ", header, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 54)
            handle.seek(phoff)
            table = handle.read(phentsize * phnum)
    except OSError as exc:
        return exc.strerror or str(exc)
    if phentsize < 56 or len(table) < phentsize * phnum or shoff + shentsize * shnum > size:
        return f"truncated ({size} bytes)"
    for index in range(phnum):
        offset, filesz = struct.unpack_from("<Q16xQ", table, index * phentsize + 8)
        if offset + filesz > size:
            return f"truncated ({size} bytes; a segment ends at {offset + filesz})"
    return None



KEPT_BUILDS = 4              # per level: the libraries of this many build keys stay (other torch versions, sources)
STALE_SCRATCH_S = 3600       # a build's scratch folder untouched this long was left by a killed build


def tidy_cache(folder: Path, stem: str, keep: Sequence[str]) -> tuple[int, int]:
    """Remove from ``folder`` what builds left behind; returns (files and folders removed, bytes).

    The scratch folders (``.build-*``) of builds killed before their clean-up (SIGKILL, a closed terminal:
    hundreds of MB of objects each), once untouched for :data:`STALE_SCRATCH_S`; and per level, all but the
    :data:`KEPT_BUILDS` most recently used libraries of ``stem`` (each source or torch change builds a new
    key, and nothing removed the old ones), never one named in ``keep``. Only regular files and folders of
    this user; a library a running process mapped stays mapped."""
    removed, freed = 0, 0
    now = time.time()
    by_level: dict[str, list[tuple[float, Path, int]]] = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0, 0
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid != os.geteuid():
            continue
        if entry.name.startswith(".build-") and entry.is_dir(follow_symlinks=False):
            try:                            # another build's scratch may go while it is looked at
                touched = max([info.st_mtime] + [sub.stat(follow_symlinks=False).st_mtime
                                                  for sub in os.scandir(entry.path) if not sub.is_symlink()])
                if now - touched > STALE_SCRATCH_S:
                    size = sum(f.stat().st_size for f in Path(entry.path).rglob("*")
                               if f.is_file() and not f.is_symlink())
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed, freed = removed + 1, freed + size
            except OSError:
                pass
            continue
        match = re.fullmatch(re.escape(stem) + r"-(\w+)-[0-9a-f]{16}\.so", entry.name)
        if match and entry.is_file(follow_symlinks=False) and entry.name not in keep:
            by_level.setdefault(match.group(1), []).append((max(info.st_atime, info.st_mtime), Path(entry.path),
                                                           info.st_size))
    for level, builds in by_level.items():
        kept = KEPT_BUILDS - sum(1 for name in keep if name.startswith(f"{stem}-{level}-"))
        for _, path, size in sorted(builds, reverse=True)[max(0, kept):]:
            try:
                path.unlink()
            except OSError:
                continue
            removed, freed = removed + 1, freed + size
    return removed, freed


def build_folder(folder: Path) -> None:
    """Make ``folder`` for a build, or ``RuntimeError``: not a symlink, and neither it nor a folder above it
    (as named, or where a link above leads) one another user may write (what is built there would never
    be loaded); checked before anything is created there, and again after."""
    def check(where: Path) -> None:
        for name in dict.fromkeys((str(where), os.path.realpath(where))):
            reason = untrusted_folder(name)
            if reason:
                raise RuntimeError(f"refusing to build into {folder}: another user could replace what is "
                                   f"built there ({reason})")

    existing = folder
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    check(existing)
    try:
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:              # XDG_CACHE_HOME a file, a read-only or full disk
        raise RuntimeError(f"cannot build into {folder}: {exc.strerror or exc}") from None
    if folder.is_symlink():
        raise RuntimeError(f"refusing to build into {folder}: it is a symlink")
    check(folder)
