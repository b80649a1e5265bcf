"""Parse the common ``xlaunch`` command lines without loading click (it costs ~30 ms to import).

:func:`parse_fast` reads argv with click's rules for this command -- options until the first
argument that is not one (or ``--``), ``--opt value`` and ``--opt=value``, the last value of a
repeated option wins, flags take no value -- and returns ``None`` for anything else: ``--help``,
``--version``, unknown or clustered options, a missing value, a flag given a value. Click then
parses the same argv and gives the help, the version or the error (:mod:`.click_command`).
tests/launcher/cli/test_cli_parse.py checks on generated command lines that whenever this parser
answers, click's answer is the same.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Sequence

from xlaunch._records import record
from xlaunch.launcher.cli.spec import COUNT, FLAG, OPTIONS, Opt


@record
class CommandLine:
    """A parsed command line: every parameter's value, and which options were given."""

    params: dict                 # parameter name -> value (None, or 0 for counts, when not given)
    given: frozenset             # names of the options given on the command line

    @property
    def command(self) -> tuple[str, ...]:
        return self.params["command"]


_BY_FLAG: dict[str, Opt] = {flag: opt for opt in OPTIONS for flag in opt.flags}


def defaults() -> dict:
    """Every parameter at its value when not given."""
    params: dict = {opt.name: (0 if opt.kind == COUNT else None) for opt in OPTIONS}
    params["command"] = ()
    return params


def parse_fast(args: Sequence[str]) -> CommandLine | None:
    """``args`` parsed as click would parse them, or ``None`` when click must decide."""
    params = defaults()
    given: set[str] = set()
    position = 0
    while position < len(args):
        arg = args[position]
        if arg == "--":
            position += 1
            break
        if len(arg) < 2 or arg[0] != "-":
            break                            # PROGRAM: it and everything after go to the program
        spelled, equals, inline = arg.partition("=")
        opt = _BY_FLAG.get(spelled)
        if opt is None:
            return None                      # --help, --version, unknown, clustered (-vv), -m=...
        if opt.kind == FLAG or opt.kind == COUNT:
            if equals:
                return None                  # a flag given a value: click says so
            params[opt.name] = True if opt.kind == FLAG else params[opt.name] + 1
            position += 1
        elif equals:
            params[opt.name] = inline
            position += 1
        elif position + 1 < len(args):
            params[opt.name] = args[position + 1]   # taken as is, even when it starts with "-"
            position += 2
        else:
            return None                      # the value is missing
        given.add(opt.name)
    params["command"] = tuple(args[position:])
    return CommandLine(params, frozenset(given))


def typed_spellings(args: Sequence[str]) -> dict[str, str]:
    """Parameter name -> the flag as typed (``ncores_per_instance`` -> ``--ncore_per_instance``),
    for the options before PROGRAM; the last spelling of a repeated option wins."""
    typed: dict[str, str] = {}
    position = 0
    while position < len(args):
        arg = args[position]
        if arg == "--" or len(arg) < 2 or arg[0] != "-":
            break
        spelled, equals, _inline = arg.partition("=")
        opt = _BY_FLAG.get(spelled)
        position += 1
        if opt is None:
            continue                          # clustered counts (-vv) or what click refused
        typed[opt.name] = spelled
        if opt.kind not in (FLAG, COUNT) and not equals:
            position += 1                     # its value
    return typed
