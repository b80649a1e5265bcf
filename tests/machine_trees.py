"""The recorded machines (tests/machines/<name>.tar.xz), each unpacked once per test session.

``machine_tree(name)`` works at collection time too (parametrize ids, subprocess env): the first
call for a name unpacks its archive into this session's temporary directory. tests/conftest.py makes
that directory in the session's first process and names it in ``XLAUNCH_TEST_MACHINES``, so the
pytest-xdist workers and the pytest runs the tests start share one unpacked copy (each worker unpacked
all of them before: ~0.8 s of CPU and 107 MB of tmpfs a worker); it removes it at the end. Without
it (a lone script), the directory is this process's own, removed at exit.
Imported by name (``from machine_trees import machine_tree``) because several conftest.py files
would compete for the module name ``conftest``; tests/conftest.py re-exports it as well.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import psutil

from xlaunch.machine.archive import unpack_archive

ARCHIVES = Path(__file__).resolve().parent / "machines"
SUFFIX = ".tar.xz"
MACHINE_NAMES: list[str] = sorted(p.name[: -len(SUFFIX)] for p in ARCHIVES.glob(f"*{SUFFIX}"))

SHARED_ENV = "XLAUNCH_TEST_MACHINES"

_unpacked: dict[str, Path] = {}
_session_dir: list[Path] = []


OWNER = "owner.pid"          # in each directory: the pid of the process that made it
STALE_S = 3600               # a directory from before OWNER was written: stale after an hour


def make_scratch() -> Path:
    """A new private directory: on tmpfs when there is one (creating ~30,000 small files on a busy
    ext4 disk took 50 s, on /dev/shm about 6 s). The directories of sessions that were killed (107 MB
    of memory each on tmpfs) are removed first."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    remove_stale(Path(where or tempfile.gettempdir()))
    path = Path(tempfile.mkdtemp(prefix="xlaunch-machines-", dir=where))
    (path / OWNER).write_text(f"{os.getpid()}\n")
    return path


def remove_stale(parent: Path) -> list[Path]:
    """Remove this user's ``xlaunch-machines-*`` directories whose maker has ended (a session killed
    before its clean-up); returns them."""
    removed = []
    for path in parent.glob("xlaunch-machines-*"):
        if not usable(str(path)):
            continue
        try:
            owner = int((path / OWNER).read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and psutil.pid_exists(owner):
            continue
        if owner is None and time.time() - path.stat().st_mtime < STALE_S:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def usable(path: str | None) -> bool:
    """``path`` is a directory (not a link) of this user that no one else may write: a shared one to use."""
    try:
        info = os.lstat(path) if path else None
    except OSError:
        return False
    return info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _scratch() -> Path:
    """This session's directory: the shared one ``XLAUNCH_TEST_MACHINES`` names, else one of this process's own."""
    if not _session_dir:
        shared = os.environ.get(SHARED_ENV)
        if usable(shared):
            path = Path(shared)
        else:
            path = make_scratch()
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
        with open(tree.parent / f".{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)       # the session's other processes wait for this one's tree
            if not tree.is_dir():
                # Unpacked aside, then renamed: a process that took no lock sees the whole tree or none.
                staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=tree.parent))
                try:
                    unpack_archive(str(ARCHIVES / f"{name}{SUFFIX}"), str(staging / name))
                    os.rename(staging / name, tree)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        _unpacked[name] = tree
    return tree
