"""Files :mod:`xlaunch.llm` reads: :mod:`~xlaunch.llm.files.checkpoint`, a Hugging Face safetensors checkpoint
directory read within bounds (the files transformers reads, every header checked); :func:`user_path`, a path
argument checked; :func:`packed_target`, where a packed file may be written; :func:`quoted`, another library's
error in one line."""
from __future__ import annotations

import os
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
