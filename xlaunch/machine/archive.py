"""Recorded machines as one compressed tarball: write one, unpack one safely.

A machine archive holds a recorded root (``sys/``, ``proc/``) at its top level. ``XLAUNCH_FSROOT``
may name one directly: it is unpacked once into ``$XDG_CACHE_HOME/xlaunch/machines/<digest>``
(default ``~/.cache``), keyed by the archive's content, and read from there. Imported only when
an archive is written or read, so ``tarfile``/``lzma`` stay off the launch path.
"""
from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import tarfile
import tempfile
import zlib

ARCHIVE_SUFFIXES = (".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar")
UNREADABLE = (OSError, EOFError, ValueError, tarfile.TarError, lzma.LZMAError, zlib.error)
"""What reading a damaged, truncated or hostile archive (or a full disk) may raise."""


def is_archive(path: str) -> bool:
    """Whether ``path`` names a file with a tarball suffix."""
    return path.endswith(ARCHIVE_SUFFIXES) and os.path.isfile(path)


def write_archive(tree: str, archive: str) -> int:
    """Pack the directory ``tree`` into the ``.tar.xz`` file ``archive``; returns its member count.

    Byte-for-byte reproducible: sorted members, no owners, times or permissions beyond 644/755.
    """
    members = 0
    with tarfile.open(archive, "w:xz", format=tarfile.PAX_FORMAT) as tar:
        for directory, subdirs, files in os.walk(tree):
            subdirs.sort()
            relative_dir = os.path.relpath(directory, tree)
            for name in [*(d + "/" for d in subdirs), *sorted(files)]:
                relative = os.path.normpath(os.path.join(relative_dir, name))
                info = tarfile.TarInfo(relative)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if name.endswith("/"):
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    with open(os.path.join(directory, name), "rb") as handle:
                        data = handle.read()
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))
                members += 1
    return members


def unpack_archive(archive: str, dest: str) -> None:
    """Unpack ``archive`` into the new directory ``dest``.

    A recording holds only regular files and directories under relative paths, so that is all
    this accepts: a link, device, absolute path or ``..`` refuses the whole archive (ValueError)
    before anything is written. Stricter than tarfile's ``data`` filter, and without its
    per-member ``realpath``; the archive is decompressed into memory once (recordings are a few
    MB) and files are written with bare ``os.write``: about 3x faster for 10,000 small files.
    """
    raw = _decompressed(archive)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(raw))
    except tarfile.ReadError:
        raise ValueError("not a tar archive (plain, .gz or .xz)") from None
    with tar:
        members = tar.getmembers()
        for member in members:
            parts = member.name.rstrip("/").split("/")
            if member.name.startswith("/") or "" in parts or ".." in parts \
                    or not (member.isreg() or member.isdir()) or member.issparse():
                raise ValueError(f"{archive}: refusing member {member.name!r} (links, devices, "
                                 f"absolute and '..' paths are not part of a recording)")
        os.makedirs(dest)
        made = {dest}
        for member in members:
            path = os.path.join(dest, *member.name.rstrip("/").split("/"))
            if member.isdir():
                os.makedirs(path, exist_ok=True)
                made.add(path)
                continue
            parent = os.path.dirname(path)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            data = raw[member.offset_data:member.offset_data + member.size]
            if len(data) != member.size:
                raise ValueError(f"{archive}: truncated at {member.name!r}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


def _decompressed(archive: str) -> bytes:
    """The tar stream of ``archive`` (xz, gzip or plain), in memory."""
    with open(archive, "rb") as handle:
        data = handle.read()
    if data.startswith(b"\xfd7zXZ\x00"):
        return lzma.decompress(data)
    if data.startswith(b"\x1f\x8b"):
        import gzip

        return gzip.decompress(data)
    return data


def cache_dir() -> str:
    """Where archives named by ``XLAUNCH_FSROOT`` are unpacked."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaunch", "machines")


def unpacked_root(archive: str) -> str:
    """The directory holding ``archive`` unpacked (done once per content; safe to race)."""
    digest = hashlib.sha256()
    with open(archive, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    base = cache_dir()
    final = os.path.join(base, digest.hexdigest()[:20])
    if os.path.isdir(final):
        return final
    os.makedirs(base, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".unpacking-", dir=base)
    try:
        unpack_archive(archive, os.path.join(staging, "root"))
        try:
            os.rename(os.path.join(staging, "root"), final)
        except OSError:
            if not os.path.isdir(final):     # not another process winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
