"""PROGRAM, checked before anything starts: a script Python can run, a module it can find, or
(``--no-python``) an executable on ``PATH``. Each problem is one :class:`OptionError` naming PROGRAM."""
from __future__ import annotations

import os
import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Mapping, Optional

from xlaunch._records import replace
from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.plan.options import Options


def resolve_program(options: Options, environ: Mapping[str, str]) -> Options:
    """Check PROGRAM exists; with --no-python, replace it by its path on PATH."""
    from xlaunch.launcher.plan.which import which

    program = str(options.program)
    if options.no_python:
        path = environ.get("PATH", os.defpath)
        found = which(program, path=path)
        if found is None:
            if os.sep in program and os.path.isfile(program):
                raise OptionError("PROGRAM", f"{program!r} is not executable (chmod +x it, or name its "
                                             "interpreter as PROGRAM)")
            where = "" if os.sep in program else " on PATH"
            raise OptionError("PROGRAM", f"{program!r} not found{where} (or not executable)")
        return replace(options, program=os.path.abspath(found) if os.sep in program else found)
    if options.module:
        problem = _module_problem(program, environ)
        if problem:
            raise OptionError("PROGRAM", problem)
        return options
    if os.path.isdir(program):
        if not os.path.isfile(os.path.join(program, "__main__.py")):
            raise OptionError("PROGRAM", f"directory {program!r} has no __main__.py")
    elif not os.path.isfile(program):
        if os.path.exists(program):     # a FIFO, a socket, a device: python would block or fail in every instance
            raise OptionError("PROGRAM", f"{program!r} is not a regular file")
        raise OptionError("PROGRAM", f"no such file {program!r}{_not_a_script_hint(program, environ)}")
    script = os.path.join(program, "__main__.py") if os.path.isdir(program) else program
    problem = _unreadable(script)
    if problem:     # python would start, then fail with [Errno 13] in every instance
        raise OptionError("PROGRAM", f"cannot read {script!r}: {problem}")
    problem = None if os.path.isdir(program) else _not_python(program)
    if problem:     # python would fail with a SyntaxError in every instance
        raise OptionError("PROGRAM", f"{program!r} {problem}")
    if program.startswith("-"):      # python would take -x.py for an option, and - for stdin
        return replace(options, program=os.path.join(os.curdir, program))
    return options


def _unreadable(path: str) -> Optional[str]:
    """Why this process (its effective user and groups, ACLs included) cannot read ``path``, or
    None. Opened, not judged from the mode bits: root reads a mode-000 file, and so would the
    instances, which run as this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        return (error.strerror or str(error)).lower()
    os.close(fd)
    return None


def _not_python(path: str) -> Optional[str]:
    """Why the file ``path`` is plainly no Python script (an executable binary, or a ``#!`` line naming
    another interpreter), or None. Only its first bytes are read."""
    from xlaunch.userfiles import read_head

    head = read_head(path, 512)
    if head.startswith(b"\x7fELF"):
        return "is an executable binary (ELF), not a Python script: add --no-python to run it"
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    interpreter = os.path.basename(words[0]) if words else b""
    if interpreter == b"env":      # #!/usr/bin/env [-S] [NAME=VALUE] python3 -u
        named = [w for w in words[1:] if not w.startswith(b"-") and b"=" not in w]
        interpreter = os.path.basename(named[0]) if named else b""
    if not interpreter or interpreter.startswith((b"python", b"pypy")):
        return None
    name = interpreter.decode("utf-8", "replace")
    return f"starts with #! naming {name!r}, not Python: add --no-python to run it with its own interpreter"


def _not_a_script_hint(program: str, environ: Mapping[str, str]) -> str:
    """For ``xlaunch python x.py`` or ``xlaunch make``: what to type instead. An interpreter's name is
    told to go whether or not it is on PATH (Debian has ``python3`` and no ``python``)."""
    from xlaunch.launcher.plan.which import which

    if os.sep in program:
        return ""
    on_path = which(program, path=environ.get("PATH", os.defpath)) is not None
    if program.startswith("python"):
        return (f" (xlaunch runs a Python PROGRAM with its own interpreter: drop {program!r}"
                + (f", or add --no-python to run {program!r} from PATH)" if on_path else ")"))
    return f" (to run {program!r} from PATH, add --no-python)" if on_path else ""


def _module_problem(name: str, environ: Mapping[str, str]) -> Optional[str]:
    """Why ``python -m name`` would not find ``name``, or None; imports nothing.

    The top-level package is found as Python would (cwd, PYTHONPATH, sys.path); a dotted name is
    then followed through the package directories on disk (namespace packages included). A
    package found in a zip or by a custom importer is not looked into.
    """
    import importlib.machinery

    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return f"{name!r} is not a module name"
    top = parts[0]
    if top in sys.builtin_module_names:
        return None
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    search = [os.getcwd(), *extra, *[p for p in sys.path if p]]
    spec = importlib.machinery.PathFinder.find_spec(top, search)
    if spec is None:
        return f"no module named {top!r}"
    locations = list(spec.submodule_search_locations or [])
    for depth, part in enumerate(parts[1:], start=1):
        parent = ".".join(parts[:depth])
        if not locations:
            return f"{parent!r} is not a package, so it has no module {part!r}"
        if not all(os.path.isdir(d) for d in locations):
            return None  # a zip or a custom importer: let Python decide
        found = importlib.machinery.PathFinder.find_spec(part, locations)
        if found is None:
            return f"no module named {'.'.join(parts[:depth + 1])!r}"
        locations = list(found.submodule_search_locations or [])
    return None
