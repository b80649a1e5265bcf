"""Messages quoted in reports and warnings: whole words only. No torch here."""
from __future__ import annotations

MAX_QUOTE = 400


def excerpt(text: object, limit: int = MAX_QUOTE) -> str:
    """The first line of ``text``; a first line longer than ``limit`` ends at its last sentence (or
    word) within the limit, followed by `` (...)``, never in the middle of a word."""
    lines = str(text).strip().splitlines()
    line = lines[0].strip() if lines else ""
    if len(line) <= limit:
        return line
    head = line[:limit]
    stop = max(head.rfind(end) for end in (". ", "! ", "? "))
    cut = head[:stop + 1] if stop > limit // 2 else head[:head.rfind(" ")].rstrip(",;:") if " " in head else head
    return cut + " (...)"
