"""Small, fast, never-raising readers for sysfs/procfs files under a root directory.

sysfs files are tiny and are read with one ``os.read``; anything missing or unreadable is
``None`` so callers can degrade and say so in :class:`Notes`.
"""
from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

from xlaunch.cpulist import CpuListError, format_cpulist, parse_cpulist
from xlaunch.userfiles import kind_of

_CHUNK = 65536
_MISSING = (errno.ENOENT, errno.ENOTDIR)


class Notes:
    """Collects what could not be read and what was assumed instead (each message once).

    A per-CPU message (:meth:`add_cpu`) is one line for every CPU it applies to, ``cpu0-1023: ...``,
    not a line per CPU (a 1024-CPU tree without ``topology/`` would print 2,048 lines).
    """

    def __init__(self) -> None:
        self._items: dict[str, Optional[list[int]]] = {}    # message -> CPUs (None: not per CPU)

    def add(self, message: str) -> None:
        self._items.setdefault(message, None)

    def add_cpu(self, cpu: int, message: str) -> None:
        cpus = self._items.setdefault("cpu\0" + message, [])
        if cpus is not None and cpu not in cpus[-1:]:
            cpus.append(cpu)

    def as_tuple(self) -> tuple[str, ...]:
        return tuple(message if cpus is None else f"cpu{format_cpulist(cpus)}: {message[4:]}"
                     for message, cpus in self._items.items())


def join(root: str, relative: str) -> str:
    """``<root>/<relative>``; ``relative`` is written without a leading slash."""
    return os.path.join(root, relative)


def _open_regular(path: str, notes: Optional[Notes]) -> Optional[int]:
    """A non-blocking descriptor on the regular file ``path``, or None.

    A missing file is None without a word (callers say what they assume). A FIFO, device,
    socket or directory is refused before it is opened (a FIFO with no writer would block an
    ordinary open forever), and anything else unreadable (a symlink loop, no permission) is
    None too; both with a note naming the file when ``notes`` is given.
    """
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            try:
                mode = os.fstat(fd).st_mode   # what is read is what was checked
            except OSError:
                os.close(fd)
                raise
            if stat.S_ISREG(mode):
                return fd
            os.close(fd)
    except (OSError, ValueError) as exc:      # ValueError: a NUL in the path
        if notes is not None and getattr(exc, "errno", None) not in _MISSING:
            notes.add(f"{path}: {getattr(exc, 'strerror', None) or exc}; ignored")
        return None
    if notes is not None:
        notes.add(f"{path} is {kind_of(mode)}, not a regular file; ignored")
    return None


def read_text(path: str, limit: int = _CHUNK, notes: Optional[Notes] = None) -> Optional[str]:
    """The stripped text of a small regular file, or None when it is missing, unreadable, not a
    regular file (see :func:`_open_regular`) or larger than ``limit`` bytes (a cut list would read
    as a shorter, valid one; sysfs lists of 8,192 CPUs are about 20 KiB)."""
    fd = _open_regular(path, notes)
    if fd is None:
        return None
    try:
        data = os.read(fd, limit + 1)
    except OSError as exc:
        if notes is not None:
            notes.add(f"{path}: {exc.strerror or exc}; ignored")
        return None
    finally:
        os.close(fd)
    if len(data) > limit:
        if notes is not None:
            notes.add(f"{path} is larger than {limit} bytes; ignored")
        return None
    return data.decode("utf-8", "replace").strip()


def read_until_blank_line(path: str, limit: int = 1 << 20, notes: Optional[Notes] = None) -> Optional[str]:
    """The first block of a file (up to its first empty line), e.g. one cpuinfo processor."""
    fd = _open_regular(path, notes)
    if fd is None:
        return None
    data = b""
    try:
        while len(data) < limit:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            data += chunk
            if b"\n\n" in data:
                break
    except OSError:
        if not data:
            return None
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace")
    return text.split("\n\n", 1)[0]


def decimal(text: Optional[str]) -> Optional[int]:
    """``text`` as a non-negative integer when it is ASCII digits only, else None.

    ``str.isdigit`` alone is not enough: ``"\u00b2".isdigit()`` is True and ``int`` refuses it.
    """
    if text and text.isascii() and text.isdigit():
        return int(text)
    return None


def read_int(path: str, notes: Optional[Notes] = None) -> Optional[int]:
    """An integer file such as ``topology/core_id`` (``-1``, unknown on some kernels, included)."""
    text = read_text(path, notes=notes)
    if text is not None and text.startswith("-"):
        number = decimal(text[1:])
        return None if number is None else -number
    return decimal(text)


def read_cpulist(path: str, notes: Optional[Notes] = None) -> Optional[tuple[int, ...]]:
    """A kernel CPU/node list file; None when missing, or (with a note) when it does not parse."""
    text = read_text(path, notes=notes)
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except CpuListError as exc:
        if notes is not None:
            notes.add(f"{path}: unreadable list ({exc})")
        return None


def list_numbered(path: str, prefix: str) -> list[int]:
    """Ids N of the entries ``<prefix>N`` in a directory (``cpu12`` -> 12), sorted; [] if none."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    ids = []
    for name in names:
        number = decimal(name[len(prefix):]) if name.startswith(prefix) else None
        if number is not None and name == f"{prefix}{number}":     # the kernel writes no leading zeros
            ids.append(number)
    return sorted(ids)


def status_fields(text: str) -> dict[str, str]:
    """``Key:\\tvalue`` lines (``/proc/self/status``, ``meminfo``) as a dict."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields
