"""A point of the space as the launcher sees it: a config file, checked by ``xlaunch --dry-run``.

:func:`prepare` merges the point over the fixed options with the launcher's own
:func:`~xlaunch.launcher.plan.options.build_options`, writes the result as a flat config file, and
runs the launcher's command line on it in-process with ``--dry-run --json``: the same path
``xlaunch --config FILE PROGRAM`` takes, so a point it rejects (an option conflict, a shape
that does not fit the machine, a library that is not installed) is skipped with the launcher's
own message, and a point it accepts is run from exactly that file.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from xlaunch.launcher.api import SETTABLE, OptionError, Options, build_options, option_fields
from xlaunch.tune import tomlfile
from xlaunch.tune.space import Point

# set by xlaunch-tune for every trial, never written to a trial's config file
MANAGED = frozenset({"log_dir", "log_file_prefix", "dry_run", "json", "verbosity"})


@dataclass(frozen=True)
class Program:
    """What every trial runs: ``PROGRAM ARGS`` plus the options fixed for every trial."""

    command: tuple[str, ...]                        # PROGRAM [ARGS]...
    fixed: Mapping[str, Any] = field(default_factory=dict)    # command-line launcher options
    base_config: Mapping[str, Any] = field(default_factory=dict)
    base_source: Optional[str] = None               # the --config file, if any
    environ: Optional[Mapping[str, str]] = None     # None: os.environ


@dataclass(frozen=True)
class Candidate:
    """A point the launcher accepted."""

    point: Point
    table: dict[str, Any]                           # the config file's content
    instances: tuple[int, ...]                      # instance indices of its plan
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Skipped:
    point: Point
    reason: str



def base_config_notes(program: Program, where: str) -> list[str]:
    """What of the ``--config`` file the trials do not use (``where``: where their runs are kept): its
    summary-json (best.toml keeps it), and the options the tuner sets for every trial (dropped without
    a word before, from best.toml too)."""
    from xlaunch.launcher.api import canonical_name

    given = {canonical_name(str(key)) for key in program.base_config}
    notes = []
    if "summary_json" in given:
        notes.append(f"summary-json in {program.base_source} is not written by the trials (each keeps "
                     f"runs/NNNN-rK/summary.json {where}); best.toml keeps it")
    unused = sorted(given & MANAGED)
    if unused:
        names = ", ".join(name.replace("_", "-") for name in unused)
        notes.append(f"{names} in {program.base_source}: not used (set by xlaunch-tune for every trial, logs in "
                     f"runs/NNNN-rK/ {where}) and not written to best.toml")
    return notes

def config_table(options: Options, point: Point) -> dict[str, Any]:
    """Every launcher option that differs from its default (and every dimension of ``point``),
    in the launcher's field order, as config-file keys and values."""
    defaults = Options()
    dims = {key.replace("-", "_") for key in point}
    table: dict[str, Any] = {}
    for name in option_fields():
        if name not in SETTABLE or name in MANAGED:
            continue
        value = getattr(options, name)
        if value == getattr(defaults, name) and name not in dims:
            continue
        if value is None:        # a dimension left at "decide from the machine" cannot be written
            continue
        table[name.replace("_", "-")] = list(value) if isinstance(value, tuple) else value
    if options.membind_nodes is not None:   # numactl's --membind 1: the nodes, written as the launcher reads them
        table["membind"] = list(options.membind_nodes)
    return table


def prepare(program: Program, point: Point, path: str) -> Candidate | Skipped:
    """Check ``point`` through the launcher; on success ``path`` holds its config file."""
    cli = {**program.fixed, **{key.replace("-", "_"): value for key, value in point.items()}}
    try:
        options = build_options(cli, program.base_config, config_source=program.base_source)
    except OptionError as exc:
        return Skipped(point, f"{exc.option}: {exc.problem}")
    table = config_table(options, point)
    tomlfile.write(path, table, "xlaunch config written by xlaunch-tune")
    code, out, err = dry_run(path, program.command, program.environ)
    if code != 0:
        lines = [line for line in err.splitlines() if "error:" in line] or err.splitlines() or [f"exit {code}"]
        return Skipped(point, lines[0].split("error: ", 1)[-1].strip())
    plan = json.loads(out)
    indices = tuple(int(instance["index"]) for instance in plan["instances"])
    return Candidate(point, table, indices, tuple(plan.get("warnings", ())))


def dry_run(config_path: str, command: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> tuple[int, str, str]:
    """``xlaunch --config FILE --dry-run --json PROGRAM ARGS`` in-process: (status, stdout, stderr)."""
    from xlaunch.launcher.api import run_command_line

    out, err = io.StringIO(), io.StringIO()
    argv = ["--config", config_path, "--dry-run", "--json", "-q", "--", *command]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_command_line(argv, os.environ if environ is None else environ)
    return code, out.getvalue(), err.getvalue()

