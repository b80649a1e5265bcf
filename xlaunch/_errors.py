"""Another library's exception quoted in one line of ours (its messages may span many lines)."""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (the distributed agent quotes errors too)
if TYPE_CHECKING:
    from typing import Optional


def error_line(error: BaseException, limit: "Optional[int]" = 300) -> str:
    """``Type: first line of its message``, that line cut at ``limit`` characters (None: whole)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:limit] if text else ''}"
