"""Per-instance and launcher log files under ``--log-dir``: checked, created and opened safely.

* Names: ``<prefix>_instance_<i>.log`` (``<prefix>_rank_<i>.log`` for the ranks of
  ``--nproc-per-node``) and ``<prefix>_launcher.log`` (and, with ``--kernel-report``,
  ``<prefix>_instance_<i>_onednn.log`` for oneDNN's verbose lines); a prefix that makes a name
  longer than the file system allows is an input error, found before anything is created.
* Directories: created as needed; when opening then fails, the directories this call created
  are removed again, so a refused run leaves nothing behind.
* A log file of an earlier run is never overwritten: it is renamed to
  ``<name>.<its mtime as YYYYmmdd-HHMMSS>`` first (the rename moves a symlink itself, never its
  target). So are the logs of instances an earlier, larger run had and this one does not
  (``instance_3.log`` of a 4-instance run when 2 instances run now), so that no log under its
  plain name is older than the run.
* Files are created with ``O_EXCL | O_NOFOLLOW``: a symlink planted at a log path is never followed.
* Writing never fails the job: a write that fails (a full file system) stops that log, and
  :class:`LogWriter` counts what it dropped for the runner to report.

Every failure to open is a :class:`~xlaunch.launcher.errors.OptionError` naming ``--log-dir`` or
``--log-file-prefix``: one line for the user, exit status 2, nothing started.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterable, Optional

from xlaunch._records import factory, record
from xlaunch.launcher.errors import OptionError

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_TRIES = 20          # runs sharing a --log-dir that create the same log at the same moment
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1      # <fcntl.h>, <linux/fs.h>
_renameat2 = None           # libc's renameat2, False where it has none (loaded on first use)


def instance_log_name(prefix: str, index: int, kind: str = "instance") -> str:
    return f"{prefix}_{kind}_{index}.log"


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


class LogWriter:
    """One open log file. Every byte given is written, until a write fails (``ENOSPC``, ``EFBIG``,
    ``EIO``): from then on nothing more is written and :attr:`dropped_lines` counts the lines
    that did not reach the file, so the log is whole up to one point and never has holes."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: Optional[int] = fd
        self.path = path
        self.written = 0
        self.dropped_lines = 0
        self.problem: Optional[str] = None

    def write(self, data: bytes) -> None:
        if self.problem is not None or self._fd is None:
            self.dropped_lines += data.count(b"\n")
            return
        view = memoryview(data)
        while view:
            try:
                count = os.write(self._fd, view)
            except InterruptedError:
                continue
            except OSError as error:
                self.problem = error.strerror or str(error)
                self.dropped_lines += max(1, bytes(view).count(b"\n"))
                return
            self.written += count
            view = view[count:]

    def write_text(self, text: str) -> None:
        self.write(text.encode("utf-8", "replace"))

    def flush(self) -> None:
        """Nothing is buffered: each :meth:`write` went to the file."""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@record(frozen=False)
class LogFiles:
    """Open log files of one run; :meth:`close` closes them all."""

    instances: dict[int, LogWriter] = factory(dict)
    launcher: Optional[LogWriter] = None
    onednn: dict[int, LogWriter] = factory(dict)   # --kernel-report: oneDNN's verbose lines per instance
    kept: list[str] = factory(list)      # earlier logs renamed aside
    _moves: list[tuple[str, str]] = factory(list)   # (log path, where it was kept)
    _created: list[str] = factory(list)

    def undo(self) -> None:
        """Close, remove the files this run created, and put earlier logs back."""
        self.close()
        for path in self._created:
            _quietly(os.unlink, path)
        for path, aside in reversed(self._moves):
            _quietly(_rename_noreplace, aside, path)   # unless another run has made a log there since

    def close(self) -> None:
        for log in self.instances.values():
            log.close()
        for log in self.onednn.values():
            log.close()
        if self.launcher is not None:
            self.launcher.close()


def open_log_files(log_dir: str, prefix: str, indices: Iterable[int], *, total: Optional[int] = None,
                   kind: str = "instance", onednn: bool = False) -> LogFiles:
    """Create ``log_dir`` if needed and open every log file, or raise :class:`OptionError`.

    ``total``: how many instances (or ranks) the plan has; earlier logs of indices from ``total``
    on are set aside too (``--instance-idx`` runs of one plan may share a directory, so logs of
    indices inside the plan are left to their own launches). ``onednn``: also one file per
    instance for oneDNN's verbose lines (``--kernel-report``).
    """
    indices = list(indices)
    check_names(log_dir, prefix, indices, onednn=onednn)
    created = _make_dirs(log_dir)
    files = LogFiles()
    try:
        for index in indices:
            path = os.path.join(log_dir, instance_log_name(prefix, index, kind))
            files.instances[index] = LogWriter(_create(log_dir, instance_log_name(prefix, index, kind), files), path)
            if onednn:
                path = os.path.join(log_dir, onednn_log_name(prefix, index))
                files.onednn[index] = LogWriter(_create(log_dir, onednn_log_name(prefix, index), files), path)
        path = os.path.join(log_dir, launcher_log_name(prefix))
        files.launcher = LogWriter(_create(log_dir, launcher_log_name(prefix), files), path)
        if total is not None:
            _set_aside_stale(log_dir, prefix, kind, max(total, max(indices, default=-1) + 1), files)
    except BaseException:
        files.undo()
        for path in reversed(created):
            _quietly(os.rmdir, path)
        raise
    return files


def _set_aside_stale(log_dir: str, prefix: str, kind: str, total: int, files: LogFiles) -> None:
    """Keep aside ``<prefix>_<kind>_<i>.log`` for every ``i >= total`` (an earlier, larger run's)."""
    pattern = re.compile(re.escape(f"{prefix}_{kind}_") + r"(\d+)\.log")
    try:
        names = os.listdir(log_dir)
    except OSError:
        return
    for name in sorted(names):
        found = pattern.fullmatch(name)
        if found is None or int(found.group(1)) < total:
            continue
        path = os.path.join(log_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            continue
        _note_aside(files, path, _keep_aside(path))


def _quietly(call, *paths: str) -> None:
    try:
        call(*paths)
    except OSError:
        pass


def _note_aside(files: LogFiles, path: str, aside: Optional[str]) -> None:
    if aside is not None:
        files.kept.append(aside)
        files._moves.append((path, aside))


def _create(log_dir: str, name: str, files: LogFiles) -> int:
    """Open a new log at ``log_dir/name``, an earlier one set aside first. Another run sharing the
    directory may set it aside or create it in between: each step is atomic and tried again."""
    path = os.path.join(log_dir, name)
    for _attempt in range(_CREATE_TRIES):
        try:
            mode: Optional[int] = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as error:
            raise OptionError("--log-dir", f"cannot use {path!r}: {error.strerror}") from None
        if mode is not None:
            if stat.S_ISDIR(mode):
                raise OptionError("--log-dir", f"{path!r} is a directory, not a log file")
            _note_aside(files, path, _keep_aside(path))
        try:
            fd = os.open(path, _FLAGS, 0o644)
        except FileExistsError:          # another run created it since: set that one aside as well
            continue
        except OSError as error:
            raise OptionError("--log-dir", f"cannot create {path!r}: {error.strerror}") from None
        files._created.append(path)
        return fd
    raise OptionError("--log-dir", f"cannot create {path!r}: other runs keep creating it")


def _keep_aside(path: str) -> Optional[str]:
    """Rename an earlier run's log to ``<path>.<mtime>`` (``-N`` added on a clash), never over an
    existing file; return the new name, or None when it is gone already (another run moved it)."""
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.lstat(path).st_mtime))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise OptionError("--log-dir", f"cannot keep the earlier log {path!r} aside: {error.strerror}") from None
    target, n = f"{path}.{stamp}", 1
    while True:
        try:
            _rename_noreplace(path, target)
            return target
        except FileExistsError:
            n += 1
            target = f"{path}.{stamp}-{n}"
        except FileNotFoundError:
            return None
        except OSError as error:
            raise OptionError("--log-dir", f"cannot keep the earlier log {path!r} aside: {error.strerror}") from None


def _rename_noreplace(source: str, target: str) -> None:
    """``rename`` that fails with ``FileExistsError`` rather than replace ``target``
    (``renameat2(RENAME_NOREPLACE)``; where the C library or the file system lacks it, a check just
    before a plain rename)."""
    import ctypes

    global _renameat2
    if _renameat2 is None:
        _renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", False)
    if _renameat2:
        if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), source, None, target)
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)
    os.rename(source, target)


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
