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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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


MAX_ARCHIVE_BYTES = 64 << 20      # the compressed file (recordings are tens of KB)
MAX_UNPACKED_BYTES = 128 << 20    # everything it expands to, headers included (the largest test tree: 11 MB)
MAX_MEMBERS = 200_000             # files and directories (a 2-socket Xeon recording: about 3,000)
MAX_DECODER_MEMORY = 256 << 20    # xz's decoder (xz -9 needs 65 MiB)


def unpack_archive(archive: str, dest: str) -> None:
    """Unpack ``archive`` into the new directory ``dest``.

    A recording holds only regular files and directories under relative paths, so that is all
    this accepts: a link, device, absolute path or ``..`` refuses the whole archive (ValueError).
    The archive is streamed (decompressed as it is read, never whole in memory) and capped: past
    :data:`MAX_UNPACKED_BYTES` expanded or :data:`MAX_MEMBERS` members it is refused, so a
    decompression bomb costs a bounded amount of time, memory and disk. On any refusal ``dest``
    is removed again. Files are written with bare ``os.write`` (about 3x faster than tarfile's
    extraction for 10,000 small files).
    """
    os.makedirs(dest)
    try:
        with _open_stream(archive) as stream:
            try:
                tar = tarfile.open(fileobj=stream, mode="r|")
            except tarfile.ReadError:
                raise ValueError("not a tar archive (plain, .gz or .xz)") from None
            with tar:
                _extract(tar, archive, dest)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _extract(tar: tarfile.TarFile, archive: str, dest: str) -> None:
    from xlaunch.userfiles import write_all

    made = {dest}
    for count, member in enumerate(tar, 1):
        if count > MAX_MEMBERS:
            raise ValueError(f"{archive}: more than {MAX_MEMBERS} members (a recording has a few thousand)")
        parts = member.name.rstrip("/").split("/")
        if member.name.startswith("/") or "" in parts or ".." in parts \
                or not (member.isreg() or member.isdir()) or member.issparse():
            raise ValueError(f"{archive}: refusing member {member.name!r} (links, devices, "
                             f"absolute and '..' paths are not part of a recording)")
        path = os.path.join(dest, *parts)
        if member.isdir():
            os.makedirs(path, exist_ok=True)
            made.add(path)
            continue
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        source = tar.extractfile(member)
        if source is None:       # pragma: no cover - a regular member always has a file
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            written = 0
            while written < member.size:
                block = source.read(min(1 << 20, member.size - written))
                if not block:
                    raise ValueError(f"{archive}: truncated at {member.name!r}")
                write_all(fd, block)
                written += len(block)
        finally:
            os.close(fd)


class _Stream(io.RawIOBase):
    """The tar stream of an archive (xz, gzip or plain), decompressed as it is read.

    Refuses to give more than MAX_UNPACKED_BYTES, and the xz decoder may use at most
    MAX_DECODER_MEMORY (an xz header may ask for a 1.5 GiB dictionary). Concatenated xz streams
    and gzip members are read one after the other, as ``xz -d`` and ``gzip -d`` do."""

    def __init__(self, raw: io.BufferedReader, archive: str) -> None:
        self._raw = raw
        self._archive = archive
        self._total = 0
        magic = raw.peek(6)[:6]
        self._kind = "xz" if magic.startswith(b"\xfd7zXZ\x00") else "gz" if magic.startswith(b"\x1f\x8b") else None
        self._decoder: Any = self._new_decoder()

    def _new_decoder(self) -> Any:
        if self._kind == "xz":
            return lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=MAX_DECODER_MEMORY)
        if self._kind == "gz":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        return None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer)) if self._decoder is None else self._decompress(len(buffer))
        self._total += len(data)
        if self._total > MAX_UNPACKED_BYTES:
            raise ValueError(f"{self._archive}: expands to more than {MAX_UNPACKED_BYTES >> 20} MiB "
                             "(a recording is a few MB)")
        buffer[:len(data)] = data
        return len(data)

    def _decompress(self, wanted: int) -> bytes:
        pending = b""
        while True:
            decoder = self._decoder
            if decoder.eof:                      # the next stream (member), if any
                pending = decoder.unused_data.lstrip(b"\0")     # xz pads streams with zeros
                while not pending:
                    more = self._raw.read(1 << 16)
                    if not more:
                        return b""
                    pending = more.lstrip(b"\0")
                self._decoder = decoder = self._new_decoder()
            if self._kind == "xz":
                chunk = pending or (self._raw.read(1 << 16) if decoder.needs_input else b"")
                if decoder.needs_input and not chunk:
                    raise EOFError("compressed data ends early")
            else:
                chunk = pending or decoder.unconsumed_tail or self._raw.read(1 << 16)
                if not chunk:
                    raise EOFError("compressed data ends early")
            pending = b""
            data = decoder.decompress(chunk, wanted)
            if data:
                return data

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open_stream(archive: str) -> io.BufferedReader:
    """The tar stream of ``archive``, decompressed as it is read and capped (:class:`_Stream`)."""
    return io.BufferedReader(_Stream(_open_archive(archive), archive), 1 << 20)


def _open_archive(archive: str) -> io.BufferedReader:
    """The archive file itself: a regular file of at most MAX_ARCHIVE_BYTES, opened without
    blocking (:func:`xlaunch.userfiles.open_user_file`: a FIFO or device is refused, never read)."""
    from xlaunch.userfiles import open_user_file

    return open(open_user_file(archive, MAX_ARCHIVE_BYTES), "rb", closefd=True)


def cache_dir() -> str:
    """Where archives named by ``XLAUNCH_FSROOT`` are unpacked."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaunch", "machines")


def unpacked_root(archive: str) -> str:
    """The directory holding ``archive`` unpacked (done once per content; safe to race)."""
    digest = hashlib.sha256()
    with _open_archive(archive) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    base = cache_dir()
    final = os.path.join(base, digest.hexdigest()[:20])
    if os.path.isdir(final):
        return final
    try:
        os.makedirs(base, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".unpacking-", dir=base)
    except OSError as exc:
        raise ValueError(f"no place to unpack it: {base}: {exc.strerror or exc} (set XDG_CACHE_HOME to a "
                         "writable directory, or unpack it with tar -xf and name the folder)") from None
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
