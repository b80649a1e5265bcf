"""Per-instance and launcher log files under ``--log-dir``: checked, created and opened safely.

* Names: ``<prefix>_instance_<i>.log`` and ``<prefix>_launcher.log`` (and, with ``--kernel-report``,
  ``<prefix>_instance_<i>_onednn.log`` for oneDNN's verbose lines); a prefix that makes a name
  longer than the file system allows is an input error, found before anything is created.
* Directories: created as needed; when opening then fails, the directories this call created
  are removed again, so a refused run leaves nothing behind.
* A log file of an earlier run is never overwritten: it is renamed to
  ``<name>.<its mtime as YYYYmmdd-HHMMSS>`` first (the rename moves a symlink itself, never its
  target).
* Files are created with ``O_EXCL | O_NOFOLLOW``: a symlink planted at a log path is never followed.

Every failure is a :class:`~xlaunch.launcher.errors.OptionError` naming ``--log-dir`` or
``--log-file-prefix``: one line for the user, exit status 2, nothing started.
"""
from __future__ import annotations

import os
import stat
import time
from typing import BinaryIO, Iterable, Optional, TextIO

from xlaunch._records import factory, record
from xlaunch.launcher.errors import OptionError

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def instance_log_name(prefix: str, index: int) -> str:
    return f"{prefix}_instance_{index}.log"


def launcher_log_name(prefix: str) -> str:
    return f"{prefix}_launcher.log"


def onednn_log_name(prefix: str, index: int) -> str:
    return f"{prefix}_instance_{index}_onednn.log"


def check_names(log_dir: str, prefix: str, indices: Iterable[int], *, onednn: bool = False) -> None:
    """Refuse a prefix whose longest file name the file system under ``log_dir`` cannot hold."""
    indices = list(indices)
    names = [launcher_log_name(prefix)] + [instance_log_name(prefix, i) for i in indices]
    names += [onednn_log_name(prefix, i) for i in indices] if onednn else []
    longest = max(names, key=lambda n: len(os.fsencode(n)))
    limit = _name_max(log_dir)
    if len(os.fsencode(longest)) > limit:
        raise OptionError("--log-file-prefix", f"too long: log file name {longest[:40]!r}... would have "
                                               f"{len(os.fsencode(longest))} bytes (the limit is {limit})")


@record(frozen=False)
class LogFiles:
    """Open log files of one run; :meth:`close` closes them all."""

    instances: dict[int, BinaryIO] = factory(dict)
    launcher: Optional[TextIO] = None
    onednn: dict[int, BinaryIO] = factory(dict)    # --kernel-report: oneDNN's verbose lines per instance
    kept: list[str] = factory(list)      # earlier logs renamed aside
    _moves: list[tuple[str, str]] = factory(list)   # (log path, where it was kept)
    _created: list[str] = factory(list)

    def undo(self) -> None:
        """Close, remove the files this run created, and put earlier logs back."""
        self.close()
        for path in self._created:
            _quietly(os.unlink, path)
        for path, aside in reversed(self._moves):
            _quietly(os.rename, aside, path)

    def close(self) -> None:
        for log in self.instances.values():
            log.close()
        for log in self.onednn.values():
            log.close()
        if self.launcher is not None:
            self.launcher.close()


def open_log_files(log_dir: str, prefix: str, indices: Iterable[int], onednn: bool = False) -> LogFiles:
    """Create ``log_dir`` if needed and open every log file, or raise :class:`OptionError`.
    ``onednn``: also one file per instance for oneDNN's verbose lines (``--kernel-report``)."""
    indices = list(indices)
    check_names(log_dir, prefix, indices, onednn=onednn)
    created = _make_dirs(log_dir)
    files = LogFiles()
    try:
        for index in indices:
            files.instances[index] = os.fdopen(_create(log_dir, instance_log_name(prefix, index), files), "wb")
            if onednn:
                # unbuffered: a full disk fails the write of a line (counted by the filter), never close()
                files.onednn[index] = os.fdopen(_create(log_dir, onednn_log_name(prefix, index), files), "wb", 0)
        fd = _create(log_dir, launcher_log_name(prefix), files)
        files.launcher = open(fd, "w", encoding="utf-8", errors="replace")
    except BaseException:
        files.undo()
        for path in reversed(created):
            _quietly(os.rmdir, path)
        raise
    return files


def _quietly(call, *paths: str) -> None:
    try:
        call(*paths)
    except OSError:
        pass


def _create(log_dir: str, name: str, files: LogFiles) -> int:
    path = os.path.join(log_dir, name)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise OptionError("--log-dir", f"cannot use {path!r}: {error.strerror}") from None
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise OptionError("--log-dir", f"{path!r} is a directory, not a log file")
        aside = _keep_aside(path)
        files.kept.append(aside)
        files._moves.append((path, aside))
    try:
        fd = os.open(path, _FLAGS, 0o644)
        files._created.append(path)
        return fd
    except OSError as error:
        raise OptionError("--log-dir", f"cannot create {path!r}: {error.strerror}") from None


def _keep_aside(path: str) -> str:
    """Rename an earlier run's log to ``<path>.<mtime>`` (``-N`` added on a clash); return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.lstat(path).st_mtime))
    target, n = f"{path}.{stamp}", 1
    while os.path.lexists(target):
        n += 1
        target = f"{path}.{stamp}-{n}"
    try:
        os.rename(path, target)
    except OSError as error:
        raise OptionError("--log-dir", f"cannot keep the earlier log {path!r} aside: {error.strerror}") from None
    return target


def _make_dirs(log_dir: str) -> list[str]:
    """``mkdir -p log_dir``; return the directories created, outermost first."""
    missing: list[str] = []
    path = os.path.abspath(log_dir)
    while not os.path.isdir(path):
        if os.path.lexists(path):
            raise OptionError("--log-dir", f"{path!r} exists and is not a directory")
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    created: list[str] = []
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except OSError as error:
            for done in reversed(created):
                _quietly(os.rmdir, done)
            raise OptionError("--log-dir", f"cannot create {path!r}: {error.strerror}") from None
        created.append(path)
    return created


def _name_max(log_dir: str) -> int:
    path = os.path.abspath(log_dir)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return os.pathconf(path, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
