"""Launcher presets (``throughput``, ``latency``, ...) and config-file reading.

``--config NAME`` finds ``xlaunch/configs/NAME.toml`` (shipped with the package, read through
:mod:`importlib.resources`); anything else is a path to a TOML file. A config file is a flat
table of option names (``ninstances = 2``, ``memory-allocator = "jemalloc"``); command-line
flags override it. TOML is read with :mod:`tomllib` (Python 3.11+), else ``tomli`` when
installed, else a small reader for the flat subset presets use.

A config file is a file a user hands us: read through :mod:`xlaunch.userfiles` (a regular file
of at most 1 MiB; a FIFO, device or directory is refused without blocking), and nested no
deeper than :data:`MAX_NESTING` arrays/tables before the TOML reader sees it.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["ConfigError", "MAX_NESTING", "preset_names", "load_config", "parse_toml"]

MAX_NESTING = 32
"""Arrays and inline tables nested deeper than this are refused (the TOML readers recurse)."""


class ConfigError(ValueError):
    """A config that cannot be found or read; the message says which and why."""


def preset_names() -> tuple[str, ...]:
    """Names of the presets shipped in this package, sorted."""
    from importlib import resources

    names = []
    for entry in resources.files(__name__).iterdir():
        if entry.name.endswith(".toml"):
            names.append(entry.name[: -len(".toml")])
    return tuple(sorted(names))


def load_config(spec: str) -> tuple[dict[str, Any], str]:
    """Read a preset by name or a TOML file by path; return ``(table, source)``.

    ``source`` is the file read (``preset:throughput`` for a shipped preset).
    Raises :class:`ConfigError` when the file is missing, unreadable or not valid TOML.
    """
    from importlib import resources

    bare = os.sep not in spec and not spec.endswith(".toml")
    if bare and spec in preset_names():
        if os.path.isfile(spec):        # the file shadowed the preset without a word
            raise ConfigError(f"{spec!r} names a preset and the file {spec} here: write ./{spec} for the file")
        text = resources.files(__name__).joinpath(f"{spec}.toml").read_text(encoding="utf-8")
        return _parse(text, f"preset:{spec}"), f"preset:{spec}"    # a folder named so (results/) is no config
    if bare and not os.path.exists(spec):
        known = ", ".join(preset_names()) or "none"
        raise ConfigError(f"no preset named {spec!r} (presets: {known}) and no such file")
    from xlaunch.userfiles import UserFileError, read_user_text

    try:
        text = read_user_text(spec)
    except UserFileError as exc:
        raise ConfigError(str(exc)) from None
    return _parse(text, spec), spec


def _parse(text: str, source: str) -> dict[str, Any]:
    try:
        table = parse_toml(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from None
    for key, value in table.items():     # no command line can hold one: a path with it was a traceback
        if _holds_nul(value):
            raise ConfigError(f"{source}: {key!r} holds a NUL character")
    return table


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    return False


def parse_toml(text: str) -> dict[str, Any]:
    """Parse TOML text; raise ValueError when invalid or nested deeper than :data:`MAX_NESTING`."""
    depth = nesting_depth(text)
    if depth > MAX_NESTING:
        raise ValueError(f"arrays or tables nested {depth} deep (at most {MAX_NESTING})")
    try:
        import tomllib as toml_reader  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - exercised on 3.9/3.10 only
        try:
            import tomli as toml_reader  # type: ignore[no-redef]
        except ModuleNotFoundError:
            return _parse_flat_toml(text)
    try:
        return toml_reader.loads(text)
    except toml_reader.TOMLDecodeError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:      # not expected below MAX_NESTING; never a traceback all the same
        raise ValueError("nested too deep") from None


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in TOML ``text``, outside strings and comments.

    A table header (``[a]``, ``[[a]]``) counts as one or two levels, closed on its line. Stops
    counting once past :data:`MAX_NESTING` (the answer is then just "too deep").
    """
    depth = deepest = 0
    position, end = 0, len(text)
    while position < end:
        char = text[position]
        if char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_NESTING:
                    return deepest
        elif char in "]}":
            depth = max(0, depth - 1)
        elif char == "#":
            newline = text.find("\n", position)
            position = end if newline < 0 else newline
            continue
        elif char in "\"'":
            position = _string_end(text, position)
            continue
        position += 1
    return deepest


def _string_end(text: str, start: int) -> int:
    """Index just past the TOML string starting at ``start`` (basic or literal, one-line or
    multi-line); the end of ``text`` when it is not closed (the reader then says why)."""
    quote = text[start]
    if text.startswith(quote * 3, start):
        close = text.find(quote * 3, start + 3)
        while quote == '"' and close > 0 and _escaped(text, close):
            close = text.find(quote * 3, close + 1)
        if close < 0:
            return len(text)
        close += 3
        while close < len(text) and text[close] == quote:    # up to two quotes may end the content
            close += 1
        return close
    position = start + 1
    while position < len(text):
        char = text[position]
        if char == "\\" and quote == '"':
            position += 2
            continue
        if char == quote or char == "\n":
            return position + 1
        position += 1
    return len(text)


def _escaped(text: str, index: int) -> bool:
    """Whether the character at ``index`` follows an odd number of backslashes."""
    count = 0
    while index - count - 1 >= 0 and text[index - count - 1] == "\\":
        count += 1
    return count % 2 == 1


def _parse_flat_toml(text: str) -> dict[str, Any]:
    """The flat subset of TOML presets use: ``key = "str" | 'str' | int | float | bool | [ints]``."""
    table: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = stripped.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"line {number}: expected key = value")
        table[key.strip().strip('"')] = _flat_value(value.strip(), number)
    return table


def _flat_value(text: str, number: int) -> Any:
    if text[:1] in "\"'":
        quote = text[0]
        end = text.find(quote, 1)
        if end < 0 or text[end + 1 :].strip()[:1] not in ("", "#"):
            raise ValueError(f"line {number}: bad string")
        return text[1:end]
    text = text.split("#", 1)[0].strip()
    if text in ("true", "false"):
        return text == "true"
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_flat_value(item.strip(), number) for item in inner.split(",") if item.strip()]
    try:
        return int(text.replace("_", ""))
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"line {number}: cannot read value {text!r}") from None
