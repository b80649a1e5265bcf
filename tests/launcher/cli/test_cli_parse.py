"""The fast parser answers only where click would answer the same (cli_parse.py)."""
from __future__ import annotations

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlaunch.launcher.cli import click_command as cli_click
from xlaunch.launcher.cli.parse import CommandLine, parse_fast
from xlaunch.launcher.cli.spec import COUNT, FLAG, OPTIONS

EVERY_FLAG = sorted({flag for opt in OPTIONS for flag in opt.flags})
ODD_TOKENS = ["--", "-", "", "-h", "--help", "--version", "-vv", "-mv", "-vq", "--nope", "-x", "--dry-run=1",
              "--dry-run=", "--ninstances=", "--ninstances=3", "--log-dir=a=b", "-m=x", "---", "--=", "=",
              "--verbose=2", "-v=1"]
VALUES = ["2", "0,2-3", "jemalloc", "a b", "$HOME", "-1", "--dry-run", "-v", "--", "prog.py", "true", "é"]


def click_parse(args: list[str]) -> CommandLine | None:
    """Click's answer, or None where click prints help/version or refuses the command line."""
    try:
        ctx = cli_click.command.make_context("xlaunch", list(args))
    except (click.exceptions.Exit, click.UsageError):
        return None
    return cli_click.command_line(ctx)


tokens = st.lists(st.one_of(st.sampled_from(EVERY_FLAG), st.sampled_from(ODD_TOKENS), st.sampled_from(VALUES)),
                  max_size=8)


@settings(max_examples=600, deadline=None)
@given(tokens)
def test_fast_parse_is_clicks_parse_whenever_it_answers(args: list[str]) -> None:
    fast = parse_fast(args)
    if fast is not None:
        assert fast == click_parse(args), args


@pytest.mark.parametrize("args", [
    ["--no-python", "true"],
    ["--ninstances", "2", "--ncores-per-instance=1", "-m", "pkg.mod", "--ninstances", "x"],
    ["-v", "--verbose", "-q", "--memory_allocator", "jemalloc", "--enable-jemalloc", "train.py", "--lr", "1"],
    ["--log-dir", "--help", "--", "-x", "--help"],     # a value may start with a dash; after -- it is PROGRAM
    ["--dry-run", "--json", "--check-isa"],
    ["--ncore_per_instance", "4", "--core_list", "0-3", "--log_path", "logs", "x.py"],
    [],
])
def test_common_command_lines_never_need_click(args: list[str]) -> None:
    fast = parse_fast(args)
    assert fast is not None and fast == click_parse(args)


@pytest.mark.parametrize("args", [["--help"], ["--ninstances", "2", "-h"], ["--version"], ["-vv", "x"],
                                  ["--nope"], ["--ninstances"], ["--dry-run=yes", "x"], ["-m=a"]])
def test_help_version_and_errors_are_left_to_click(args: list[str]) -> None:
    assert parse_fast(args) is None


def test_counts_flags_and_last_value_wins() -> None:
    line = parse_fast(["-v", "-v", "--quiet", "--ninstances", "1", "--ninstances=3", "--dry-run", "--dry-run", "p"])
    assert line is not None
    assert (line.params["verbose"], line.params["quiet"], line.params["ninstances"]) == (2, 1, "3")
    assert line.params["dry_run"] is True and line.command == ("p",)
    assert line.given == {"verbose", "quiet", "ninstances", "dry_run"}
    assert all(line.params[opt.name] == (0 if opt.kind == COUNT else None)
               for opt in OPTIONS if opt.name not in line.given)
    assert {o.kind for o in OPTIONS} == {FLAG, COUNT, "value"}


def test_every_option_is_in_click_and_in_the_fast_parser() -> None:
    """One table: click's command has exactly the table's parameters and spellings."""
    in_click = {p.name: tuple(p.opts) for p in cli_click.command.params
                if isinstance(p, click.Option) and p.name not in ("help", "version")}
    assert in_click == {opt.name: opt.flags for opt in OPTIONS}

