"""A node-local copy of a file that many processes map read-only (a packed LLM file, a GGUF).

A mapped file's pages live in the page cache once, on the NUMA node of whichever process read them
first: on a machine of several nodes, the instances on the other nodes read every page across the
interconnect, whatever their memory binding (``xlaunch``'s summary names such files). :func:`placed`
gives a process whose CPUs all lie in one node a copy of the file for that node: written by the first
process of the node that asks (its writes, and the reads of the node's processes after it, put the
copy's pages on that node), then mapped by the others. One copy per node, instead of one shared
across the interconnect or one per process. On a machine of one node, or for a process whose CPUs
span nodes, it is the file itself.

A copy sits beside the file, hidden (``.<name>.node<N>.<key>``; ``key`` hashes the file's path, inode,
size and modification time, so a changed file gets a new copy and the node's old one is removed), or,
where that folder cannot be written, under ``$XLAUNCH_CACHE_DIR/node-copies`` (refused when another user could
write there: :func:`xlaunch.userfiles.untrusted_folder`). A copy is used only when written by this user, root
or the file's owner; another's is rewritten. It is written under a lock
to a new temporary file (:func:`xlaunch.userfiles.new_file`: ``O_EXCL | O_NOFOLLOW``) and renamed into
place: a link planted at its name or the lock's is never written through. No torch here.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, Iterable, Optional

from xlaunch import userfiles

COPY_CHUNK = 8 << 20
_OPEN_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class NodeCopyError(OSError):
    """A node copy that cannot be made (the message is one line)."""


def home_node(machine: Any, cpus: Iterable[int]) -> Optional[int]:
    """The one NUMA node holding every CPU of ``cpus``, on a machine with CPUs in two nodes or more; None
    otherwise (one node, or ``cpus`` spanning nodes). Nodes without CPUs (memory-only: CXL, HBM) are not homes."""
    with_cpus = [node for node in machine.nodes if node.cpus]
    if len(with_cpus) < 2:
        return None
    wanted = set(cpus)
    homes = {node.id for node in with_cpus if wanted & set(node.cpus)}
    return homes.pop() if len(homes) == 1 else None


def _key(source: Path) -> str:
    info = os.stat(source)
    identity = f"{os.path.realpath(source)}:{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _writable(folder: Path) -> bool:
    return userfiles.check_writable_dir(str(folder)) is None


def _fallback_folder(source: Path) -> Path:
    base = os.environ.get("XLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "xlaunch")
    folder = Path(base) / "node-copies" / hashlib.sha256(os.path.realpath(source).encode()).hexdigest()[:12]
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    reason = userfiles.untrusted_folder(str(folder))
    if reason:                  # another user could put a copy of other bytes there (or swap ours) for us to map
        raise NodeCopyError(errno.EPERM, f"a node-local copy of {source}: not in {folder}, another user could "
                                         f"replace it ({reason})")
    return folder


def _is_copy_of(path: Path, source: os.stat_result) -> bool:
    """A finished copy of the file: a regular file of its size, written by this user, root or the file's owner
    (another's, of the same size but other bytes, is replaced: its weights are not the file's)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    return (stat.S_ISREG(info.st_mode) and info.st_size == source.st_size
            and info.st_uid in (0, os.geteuid(), source.st_uid) and not info.st_mode & stat.S_IWOTH)


def node_copy(path: Any, node: int, folder: Any = None) -> Path:
    """The copy of ``path`` for NUMA node ``node`` (written by this process when missing or stale); returns its
    path. ``folder``: where copies go (default: beside the file, else the cache)."""
    source = Path(path)
    try:
        info = os.stat(source)
        if not stat.S_ISREG(info.st_mode):
            raise NodeCopyError(errno.EINVAL, f"{source}: not a regular file")
        where = Path(folder) if folder is not None else (source.parent if _writable(source.parent)
                                                          else _fallback_folder(source))
        stem = f".{source.name}.node{node}"
        target = where / f"{stem}.{_key(source)}"
        if _is_copy_of(target, info):
            return target
        lock_fd = os.open(where / f"{stem}.lock", os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o644)
        with os.fdopen(lock_fd) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _is_copy_of(target, info):     # another process of the node may have written it
                _write(source, target)
                finished = re.compile(re.escape(stem) + r"\.[0-9a-f]{12}")
                for old in where.iterdir():
                    if old.name != target.name and finished.fullmatch(old.name):
                        old.unlink(missing_ok=True)        # the node's copy of an older version of the file
        return target
    except NodeCopyError:
        raise
    except OSError as error:
        raise NodeCopyError(error.errno, f"a node-local copy of {source}: {error.strerror or error}") from None


def _write(source: Path, target: Path) -> None:
    fd, temporary = userfiles.new_file(str(target.parent), target.name)
    try:
        with open(source, "rb") as reading, os.fdopen(fd, "wb") as writing:
            shutil.copyfileobj(reading, writing, COPY_CHUNK)
            writing.flush()
            os.fsync(writing.fileno())
        os.replace(temporary, target)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise


def placed(path: Any) -> Path:
    """The file this process should map for ``path``: its node's copy (:func:`node_copy`) when the CPUs it may
    run on all lie in one node of a machine of several (the machine model's, ``XLAUNCH_FSROOT`` included),
    else ``path`` itself."""
    from xlaunch.machine import current_machine

    node = home_node(current_machine(), os.sched_getaffinity(0))
    return Path(path) if node is None else node_copy(path, node)
