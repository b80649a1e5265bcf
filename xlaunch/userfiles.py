"""Files a user hands us, read within bounds; files we write for them, never through a symlink.

The policy (docs/runner.md, "Hostile files, full disks, closed streams"), written once here:

* :func:`read_user_file` (and :func:`open_user_file`, for readers that stream, such as machine
  archives) reads only a *regular* file, at most ``limit`` bytes. It looks at the path before
  opening (a FIFO, device or socket is refused without being opened), opens with ``O_NONBLOCK``
  (a FIFO swapped in meanwhile cannot block the open) and checks the open descriptor again with
  ``fstat``: what is read is what was checked. A symlink to a regular
  file is read (the user named it); ``/dev/zero``, a FIFO with no writer, a directory or a
  file over the cap is one :class:`UserFileError` naming the file and the problem.
* :func:`read_head` reads the first bytes of such a file, of any size (a program's ``#!`` line).
* :func:`write_atomically` writes a whole file through a new temporary file in the same
  directory (``O_CREAT | O_EXCL | O_NOFOLLOW``), then renames it over the target: a reader
  never sees half a file, and a symlink planted at the target is replaced, never followed.
  A FIFO, device, socket or directory at the target is refused rather than replaced (as root,
  ``/dev/null`` would otherwise become a regular file). On any error (a full disk) the
  temporary file is removed and the error raised: the caller decides to warn and go on.
* :func:`write_all` writes a whole buffer to a descriptor: a write that stops short (a signal,
  a nearly full disk) is followed by the rest.

Light on purpose (``os`` and ``stat`` only): the launcher reads ``--config`` with it.
"""
from __future__ import annotations

import os
import stat

DEFAULT_LIMIT = 1 << 20          # 1 MiB: configs and search spaces are a few hundred bytes
UNCAPPED = 1 << 50               # files as big as they are (model shards): the reader bounds what it reads
_CHUNK = 1 << 16


class UserFileError(ValueError):
    """A file that is not read or not written; the message names the file and the problem."""


def kind_of(mode: int) -> str:
    """``a FIFO``, ``a character device``, ... for a ``st_mode``."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_user_file(path: str, limit: int = DEFAULT_LIMIT) -> int:
    """A read-only descriptor on the regular file ``path`` of at most ``limit`` bytes (by its
    size; readers still stop at ``limit``), or :class:`UserFileError`. The caller closes it."""
    shown = path or "''"
    try:
        before = os.stat(path)
    except (OSError, ValueError) as exc:      # ValueError: a NUL in the path
        raise UserFileError(f"cannot read {shown}: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(before.st_mode):
        raise UserFileError(f"{shown} is {kind_of(before.st_mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UserFileError(f"cannot read {shown}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserFileError(f"{shown} is {kind_of(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UserFileError(f"{shown} is {info.st_size} bytes; files over {limit} bytes are not read")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_file(path: str, limit: int = DEFAULT_LIMIT) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), or :class:`UserFileError`."""
    fd = open_user_file(path, limit)
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:               # grew after fstat, or a file whose size lies (procfs)
                raise UserFileError(f"{path} holds more than {limit} bytes; larger files are not read")
    except OSError as exc:
        raise UserFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_head(path: str, size: int) -> bytes:
    """The first ``size`` bytes of the regular file ``path``, whatever its length (a script's ``#!`` line, a
    binary's magic number); ``b""`` when it is no regular file or cannot be read (the caller says nothing)."""
    try:
        fd = open_user_file(path, UNCAPPED)
    except UserFileError:
        return b""
    try:
        return os.read(fd, size)
    except OSError:
        return b""
    finally:
        os.close(fd)


def read_user_text(path: str, limit: int = DEFAULT_LIMIT) -> str:
    """:func:`read_user_file` decoded as UTF-8 (:class:`UserFileError` when it is not); a leading
    byte-order mark (Windows editors write one) is dropped: TOML and JSON readers refuse it."""
    data = read_user_file(path, limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserFileError(f"{path} is not UTF-8 text") from None


def refuse_special(path: str) -> None:
    """:class:`UserFileError` when something other than a regular file or a symlink sits at
    ``path`` (nothing there is fine): the check before replacing a file."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        raise UserFileError(f"cannot write {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        raise UserFileError(f"{path!r} is {kind_of(info.st_mode)}, not a regular file (never replaced)")


def new_file(directory: str, name: str, mode: int = 0o644) -> tuple[int, str]:
    """A new, empty file in ``directory`` named after ``name`` (``.<name>.<random>.tmp``),
    created with ``O_EXCL | O_NOFOLLOW``: ``(fd, path)``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _attempt in range(100):
        path = os.path.join(directory, f".{name}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(path, flags, mode), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {directory!r}")


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: a write to a file may take fewer bytes than asked (a signal
    mid-write, a nearly full disk), and the rest follows until none is left or one raises."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomically(path: str, data: bytes, mode: int = 0o644) -> str:
    """Replace ``path`` by a regular file holding ``data`` (see the module docstring); returns
    ``path``. Raises :class:`UserFileError` for a special file at ``path``, OSError otherwise."""
    if not path:
        raise UserFileError("cannot write '': empty path")
    refuse_special(path)
    directory, name = os.path.split(path)
    fd, temporary = new_file(directory or os.curdir, name, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        refuse_special(path)                 # checked again right before the rename
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return path


def check_writable_dir(directory: str) -> str | None:
    """Why a new file cannot be created in ``directory`` (one is created and removed to find
    out: permissions, a read-only mount, ``/proc``), or None when it can."""
    try:
        fd, temporary = new_file(directory or os.curdir, "xlaunch-check")
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    os.close(fd)
    try:
        os.unlink(temporary)
    except OSError:
        pass
    return None


def _open_to_others(info: os.stat_result) -> bool:
    """Writable by another user: by others, or by a group not this process's own (a sticky folder is not)."""
    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return False
    return bool(info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid != os.getegid()))


def _trusted(info: os.stat_result) -> bool:
    return info.st_uid in (0, os.geteuid()) and not _open_to_others(info)


def untrusted(path: str) -> str | None:
    """Why code at ``path`` could have been planted by another user, or None when it could not: the
    file is a regular file (not a symlink) owned by this user or root and writable by no one else
    (a group-writable one only by this process's own group), and so is every folder above it (a
    folder others may write to must be sticky, as ``/tmp``): the check before loading a library."""
    try:
        info = os.lstat(path)
    except (OSError, ValueError) as exc:
        return f"cannot check {path}: {getattr(exc, 'strerror', None) or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is {kind_of(info.st_mode)}, not a regular file"
    if not _trusted(info):
        return f"{path} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}"
    above = os.path.dirname(os.path.abspath(path))
    for folder in dict.fromkeys((above, os.path.realpath(above))):    # the folders named, and those linked to
        reason = untrusted_folder(folder)
        if reason:
            return reason
    return None


def untrusted_folder(folder: str) -> str | None:
    """Why another user could put a file into ``folder`` (see :func:`untrusted`), or None."""
    while True:
        try:
            info = os.stat(folder)
        except OSError as exc:
            return f"cannot check {folder}: {exc.strerror or exc}"
        if not _trusted(info):
            return f"its folder {folder} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}"
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
