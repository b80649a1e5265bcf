"""``which``: find an executable on a PATH string (``shutil.which`` costs ~4 ms of imports here)."""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional


def which(program: str, path: Optional[str] = None) -> Optional[str]:
    """The first executable regular file named ``program`` on ``path`` (default ``$PATH``);
    a name containing ``/`` is checked as given. None when not found."""
    def runnable(candidate: str) -> bool:
        return os.path.isfile(candidate) and os.access(candidate, os.X_OK)

    if os.sep in program:
        return program if runnable(program) else None
    search = os.environ.get("PATH", os.defpath) if path is None else path
    for directory in search.split(os.pathsep):
        candidate = os.path.join(directory or os.curdir, program)
        if runnable(candidate):
            return candidate
    return None
