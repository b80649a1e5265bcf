"""Flat launcher config files (``key = value`` lines) written from option values."""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

from xlaunch.userfiles import write_atomically


def toml_value(value: Any) -> str:
    """One TOML value: bool, int, finite float, string, or a list of those."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} to a config file")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)   # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to a config file")


def dumps(table: Mapping[str, Any], header: str = "") -> str:
    """``table`` as TOML text, keys as given, with ``header`` as leading comment lines (one per
    newline; a control character in them, which TOML refuses in a comment, written as ``\\xNN``)."""
    lines = [f"# {comment_text(line)}".rstrip() for line in header.split("\n")] if header else []
    lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def write(path: str, table: Mapping[str, Any], header: str = "") -> None:
    """Write atomically (a reader never sees half a file), never through a symlink
    (:func:`xlaunch.userfiles.write_atomically`)."""
    write_atomically(path, dumps(table, header).encode("utf-8"))


def comment_text(text: str) -> str:
    """``text`` as TOML takes it in a comment: a tab and printable characters (a PROGRAM argument
    holding ESC made best.toml unreadable: ``Found invalid character '\\x1b'``)."""
    return "".join(f"\\x{ord(c):02x}" if (c < " " and c != "\t") or c == "\x7f" else c for c in text)
