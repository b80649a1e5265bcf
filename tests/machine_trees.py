"""The recorded machines (tests/machines/<name>.tar.xz), each unpacked once per test session.

``machine_tree(name)`` works at collection time too (parametrize ids, subprocess env): the first
call for a name unpacks its archive into this session's temporary directory, removed at exit.
Imported by name (``from machine_trees import machine_tree``) because several conftest.py files
would compete for the module name ``conftest``; tests/conftest.py re-exports it as well.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from xlaunch.machine.archive import unpack_archive

ARCHIVES = Path(__file__).resolve().parent / "machines"
SUFFIX = ".tar.xz"
MACHINE_NAMES: list[str] = sorted(p.name[: -len(SUFFIX)] for p in ARCHIVES.glob(f"*{SUFFIX}"))

_unpacked: dict[str, Path] = {}
_session_dir: list[Path] = []


def _scratch() -> Path:
    """This session's directory: on tmpfs when there is one (creating ~30,000 small files on a
    busy ext4 disk took 50 s, on /dev/shm about 6 s)."""
    if not _session_dir:
        shm = "/dev/shm"
        where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
        path = Path(tempfile.mkdtemp(prefix="xlaunch-machines-", dir=where))
        atexit.register(shutil.rmtree, path, True)
        _session_dir.append(path)
    return _session_dir[0]


def machine_tree(name: str) -> Path:
    """The unpacked root (``sys/``, ``proc/``) of the recorded machine ``name``.

    Treat it as read-only: it is shared by the whole session (copy it to change files).
    """
    tree = _unpacked.get(name)
    if tree is None:
        if name not in MACHINE_NAMES:
            raise LookupError(f"no recorded machine {name!r}; recorded: {', '.join(MACHINE_NAMES)}")
        tree = _scratch() / name
        unpack_archive(str(ARCHIVES / f"{name}{SUFFIX}"), str(tree))
        _unpacked[name] = tree
    return tree
