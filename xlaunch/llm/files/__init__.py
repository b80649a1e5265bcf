"""Files :mod:`xlaunch.llm` reads: :mod:`~xlaunch.llm.files.checkpoint`, a Hugging Face safetensors checkpoint
directory read within bounds (the files transformers reads, every header checked); :func:`user_path`, a path
argument checked; :func:`packed_target`, where a packed file may be written, and
:func:`remove_killed_writers_files`; :func:`quoted`, another library's error in one line."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any, Optional

from xlaunch import userfiles


def user_path(value: Any, name: str, caller: str) -> Path:
    """``value`` (a str or os.PathLike) as a Path; anything else, or '', is one line naming ``caller``'s argument
    ``name`` (None or bytes failed inside pathlib; '' became the working directory)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{caller}: {name} must be a str or os.PathLike, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{caller}: {name} is empty")
    if "\0" in value:
        raise ValueError(f"{caller}: {name} holds a NUL character ({value!r})")
    return Path(value)


def quoted(error: BaseException, limit: Optional[int] = 300) -> str:
    """``Type: message`` on one line, its lines joined (cut at ``limit`` characters; None: whole): transformers'
    validation errors put the field on the first line and what is wrong with it on the next."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:limit]}"


def packed_target(path: Path) -> Optional[str]:
    """Why :func:`~xlaunch.llm.save_packed` would not write ``path`` (None: it would): a link or something other
    than a regular file there (a device would be renamed over), or a folder that takes no new file."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
        return f"{path} is " + ("a symlink; give the file's own path" if path.is_symlink() else
                                "not a regular file (never replaced)")
    why = userfiles.check_writable_dir(str(path.parent))
    return None if why is None else f"cannot write {path} ({why})"


def remove_killed_writers_files(path: Path, age: float = 900.0) -> int:
    """Remove the temporary files a killed ``save_packed`` left beside ``path`` (``.NAME.PID.RANDOM.tmp``, the
    size of the packed file: each kill left one more): regular files of a process gone from this machine and
    untouched for ``age`` seconds (a writer on another machine sharing the folder writes its own). Returns how many."""
    prefix, removed = f".{path.name}.", 0
    try:
        names = os.listdir(path.parent)
    except OSError:
        return 0
    for name in names:
        parts = name[len(prefix):].split(".")
        if not (name.startswith(prefix) and len(parts) == 3 and parts[0].isdigit() and parts[2] == "tmp"):
            continue
        try:
            info = os.lstat(path.parent / name)
            if stat.S_ISREG(info.st_mode) and time.time() - info.st_mtime > age and not _alive(int(parts[0])):
                os.unlink(path.parent / name)
                removed += 1
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
