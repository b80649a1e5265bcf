"""Small, fast, never-raising readers for sysfs/procfs files under a root directory.

sysfs files are tiny and are read with one ``os.read``; anything missing or unreadable is
``None`` so callers can degrade and say so in :class:`Notes`.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

from xlaunch.cpulist import CpuListError, parse_cpulist

_CHUNK = 65536


class Notes:
    """Collects what could not be read and what was assumed instead (each message once)."""

    def __init__(self) -> None:
        self._items: list[str] = []

    def add(self, message: str) -> None:
        if message not in self._items:
            self._items.append(message)

    def as_tuple(self) -> tuple[str, ...]:
        return tuple(self._items)


def join(root: str, relative: str) -> str:
    """``<root>/<relative>``; ``relative`` is written without a leading slash."""
    return os.path.join(root, relative)


def read_text(path: str, limit: int = _CHUNK) -> Optional[str]:
    """The stripped text of a small file, or None when it is missing or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


def read_until_blank_line(path: str, limit: int = 1 << 20) -> Optional[str]:
    """The first block of a file (up to its first empty line), e.g. one cpuinfo processor."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
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


def read_int(path: str) -> Optional[int]:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def read_cpulist(path: str, notes: Optional[Notes] = None) -> Optional[tuple[int, ...]]:
    """A kernel CPU/node list file; None when missing, or (with a note) when it does not parse."""
    text = read_text(path)
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
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            ids.append(int(name[len(prefix):]))
    return sorted(ids)


def status_fields(text: str) -> dict[str, str]:
    """``Key:\\tvalue`` lines (``/proc/self/status``, ``meminfo``) as a dict."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields
