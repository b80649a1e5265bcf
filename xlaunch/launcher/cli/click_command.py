"""The click command built from :mod:`.spec`: ``--help`` by section, ``--version``, shell
completion, and the parse of every command line :func:`.parse.parse_fast` leaves to click.

Imported only for those; a plain launch never loads click (docs/launcher.md, "Start-up cost").
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import click

from xlaunch.launcher.cli.parse import CommandLine
from xlaunch.launcher.cli.spec import (
    COMPLETE_VAR,
    COUNT,
    FLAG,
    GROUP_ORDER,
    GROUP_SUPERVISION,
    HELP_FLAGS,
    OPTIONS,
    Opt,
)


class GroupedOption(click.Option):
    """A click option that knows its --help section and lists only its dash spellings there."""

    def __init__(self, *args: Any, group: str = GROUP_SUPERVISION, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def get_help_record(self, ctx: click.Context) -> Optional[tuple[str, str]]:
        record = super().get_help_record(ctx)
        if record is None:
            return None
        spelled = ", ".join(o for o in self.opts if "_" not in o)
        if not self.is_flag and not self.count:
            spelled += " " + (self.make_metavar(ctx) if _takes_ctx_metavar() else self.make_metavar())
        return spelled, record[1]


def _takes_ctx_metavar() -> bool:
    import inspect

    return "ctx" in inspect.signature(click.Option.make_metavar).parameters


class GroupedCommand(click.Command):
    """A click command whose --help lists options by section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                sections.setdefault(getattr(param, "group", GROUP_SUPERVISION), []).append(record)
        for group in GROUP_ORDER + tuple(g for g in sections if g not in GROUP_ORDER):
            if group in sections:
                with formatter.section(group):
                    formatter.write_dl(sections[group])


def _click_option(opt: Opt) -> click.Option:
    settings: dict[str, Any] = {"default": None}
    if opt.kind == FLAG:
        settings["is_flag"] = True
    elif opt.kind == COUNT:
        settings = {"count": True}
    else:
        settings["metavar"] = opt.metavar
    if opt.choices:
        choices = opt.choices
        settings["shell_complete"] = lambda _ctx, _param, incomplete: [v for v in choices if v.startswith(incomplete)]
    return GroupedOption([*opt.flags, opt.name], group=opt.group, help=opt.help, hidden=opt.hidden, **settings)


def _build_command() -> click.Command:
    params: list[click.Parameter] = [_click_option(opt) for opt in OPTIONS]
    params.append(click.Argument(["command"], nargs=-1, type=click.Path(), metavar="PROGRAM [ARGS]..."))
    command = GroupedCommand(
        "xlaunch",
        params=params,
        context_settings={"allow_interspersed_args": False, "help_option_names": list(HELP_FLAGS),
                          "max_content_width": 100},
        help=("Run PROGRAM (a Python script, -m MODULE, or with --no-python any executable) as one or more "
              "instances, each pinned to its own cores and memory, with OpenMP and allocator settings tuned "
              "for PyTorch on CPUs. Everything after PROGRAM is passed to it untouched."),
    )
    return click.version_option(package_name="xlaunch", prog_name="xlaunch", message="%(prog)s %(version)s")(command)


command = _build_command()


def parse(args: Sequence[str]) -> Union[CommandLine, int]:
    """Click's parse of ``args``: a :class:`CommandLine`, or the exit status once click has
    printed the help or the version, or once a usage error was written as one line."""
    try:
        ctx = command.make_context("xlaunch", list(args))
    except click.exceptions.Exit as done:  # --help, --version
        return done.exit_code
    except click.UsageError as exc:
        import sys

        from xlaunch.launcher.errors import USAGE_EXIT_STATUS

        sys.stderr.write(error_line(exc) + "\n")
        return USAGE_EXIT_STATUS
    return command_line(ctx)


def command_line(ctx: click.Context) -> CommandLine:
    """A :class:`CommandLine` from a click context (the options given are those from argv)."""
    given = frozenset(name for name in ctx.params if name != "command" and _from_command_line(ctx, name))
    params = dict(ctx.params)
    params["command"] = tuple(params["command"])
    return CommandLine(params, given)


def _from_command_line(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def error_line(exc: click.UsageError) -> str:
    """Click's usage errors as one line ``xlaunch: error: <option>: <problem>``."""
    if isinstance(exc, click.NoSuchOption):
        import difflib

        known = [o for p in command.params if isinstance(p, click.Option) for o in p.opts if "_" not in o]
        close = difflib.get_close_matches(exc.option_name.replace("_", "-"), known, n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        line = f"xlaunch: error: {exc.option_name}: no such option{hint}"
    elif isinstance(exc, click.BadOptionUsage):
        problem = "requires a value" if "requires an argument" in exc.message else exc.message
        line = f"xlaunch: error: {exc.option_name}: {problem}"
    elif isinstance(exc, click.BadParameter) and exc.param is not None:
        name = exc.param.opts[0] if getattr(exc.param, "opts", None) else exc.param.name
        line = f"xlaunch: error: {name}: {exc.message}"
    else:
        line = f"xlaunch: error: {exc.format_message()}"
    return line.rstrip("\n").replace("\n", " ")


def shell_complete(instruction: str) -> int:
    """Click's shell completion (``eval "$(_XLAUNCH_COMPLETE=bash_source xlaunch)"``; zsh_source,
    fish_source): option names, choices, and files for PROGRAM. Hidden spellings are not offered."""
    from click.shell_completion import shell_complete as complete

    return complete(command, {}, "xlaunch", COMPLETE_VAR, instruction)
