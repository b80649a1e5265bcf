"""``xlaunch [OPTIONS] PROGRAM [ARGS]...`` -- the command line, and nothing more.

Parsing (:mod:`.parse`, or click through :mod:`.click_command` for help, completion and errors)
turns argv (+ ``--config``) into :class:`~xlaunch.launcher.plan.options.Options`; the machine
is read once; :func:`~xlaunch.launcher.plan.planner.plan` decides; ``--dry-run`` prints the plan, else
the runner executes it. Bad input is one line ``xlaunch: error: <option>: <problem>`` and exit
status 2, before anything starts. Nothing here imports torch.
"""
from __future__ import annotations

import os
import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Mapping, Optional, Sequence, Union

from xlaunch._records import replace
from xlaunch.launcher.cli.parse import CommandLine, parse_fast, typed_spellings
from xlaunch.launcher.cli.spec import COMPLETE_VAR, NOT_OPTIONS
from xlaunch.launcher.errors import USAGE_EXIT_STATUS, LaunchInputError, OptionError
from xlaunch.launcher.plan.options import Options, build_options, flag_name
from xlaunch.launcher.plan.show import page_lost, write_page


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point. A Ctrl-C before the runner took over signals is exit 130 with
    no traceback (nothing had started). A closed or full stderr never stops a job
    (:mod:`.streams`)."""
    from xlaunch.launcher.cli.streams import prepare_standard_streams

    prepare_standard_streams()
    try:
        sys.exit(run(argv))
    except KeyboardInterrupt:
        sys.exit(128 + 2)


def run(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Parse, plan, and dry-run or execute. Returns the exit status."""
    environ = dict(os.environ if environ is None else environ)
    instruction = environ.get(COMPLETE_VAR)
    if instruction:
        from xlaunch.launcher.cli.click_command import shell_complete

        return shell_complete(instruction)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        line = parse_command_line(args)
    except OSError as exc:        # --help or --version to a full stdout (click writes them)
        return page_lost("--help" if {"-h", "--help"} & set(args) else "--version", exc)
    if isinstance(line, int):     # click printed the help or the version, or wrote the error
        return line
    params = line.params
    try:
        if params["show_cache"]:
            return _show_cache(line, environ)
        if params["check_isa"] or params["show_topology"]:
            return _machine_information(line, environ)
        options = options_from(line, environ, typed_spellings(args))
        return _launch(options, environ)
    except LaunchInputError as exc:
        option = _as_typed(exc.option, line, typed_spellings(args))
        return _usage_error(f"xlaunch: error: {option}: {exc.problem}")


def _as_typed(option: str, line: CommandLine, typed: Mapping[str, str]) -> str:
    """The option an error names, as the user spelled it: ``--core-list`` rather than
    ``--cores-list``, ``--ccl-worker-count`` rather than the ``--reserve-cores`` it stands for."""
    from xlaunch.launcher.cli import compat
    from xlaunch.launcher.plan.options import canonical_name

    name = canonical_name(option) if option.startswith("--") else None
    if name is None:
        return option
    if name in typed and compat.alias_note(typed[name]) is not None:
        return typed[name]
    if name not in line.given:           # set by an old spelling the user typed instead?
        for old in compat.BY_NAME:
            spelling = compat.BY_NAME[old]
            if old in line.given and spelling.to_options is not None \
                    and name in spelling.to_options(line.params[old]):
                return typed.get(old, compat.flags(spelling)[0])
    return option


def parse_command_line(args: Sequence[str]) -> Union[CommandLine, int]:
    """The fast parse, or click's when the fast parser leaves it to click (help, version, errors)."""
    line = parse_fast(args)
    if line is None:
        from xlaunch.launcher.cli import click_command as cli_click

        return cli_click.parse(args)
    return line


def _usage_error(line: str) -> int:
    sys.stderr.write(line.rstrip("\n").replace("\n", " ") + "\n")
    return USAGE_EXIT_STATUS


def _verbosity(line: CommandLine) -> int:
    return int(line.params["verbose"] or 0) - int(line.params["quiet"] or 0)


def options_from(line: CommandLine, environ: Mapping[str, str],
                 typed: Optional[Mapping[str, str]] = None) -> Options:
    """Options from the command line over the config file; the program checked and resolved.
    ``typed``: the flags as spelled (:func:`.parse.typed_spellings`), for the ``note:`` lines."""
    params = line.params
    for flag in ("torch", "probe"):
        if params[flag]:
            raise OptionError(f"--{flag}", "only applies with --check-isa")
    config: dict[str, Any] = {}
    source = None
    if params["config"] is not None:
        from xlaunch.launcher.plan.options import load_config_option

        config, source = load_config_option(params["config"])
        for key in config:
            if str(key).replace("-", "_") in ("config", "command", "program"):
                raise OptionError("--config", f"{key!r} cannot be set in a config file ({source})")
    from xlaunch.launcher.cli import compat

    cli = {name: value for name, value in params.items()
           if name not in NOT_OPTIONS and name not in compat.BY_NAME and name in line.given}
    old = {name: params[name] for name in compat.BY_NAME if name in line.given}
    typed = typed or {}
    all_of = {name: note for name in ("instance_idx", "nodes_list") if name in line.given   # -1: all of them
              and (note := compat.minus_one_note(name, typed.get(name) or flag_name(name), params[name]))}
    notes: tuple[str, ...] = tuple(note for name, flag in typed.items()
                                   if name not in all_of and (note := compat.alias_note(flag)) is not None)
    notes += tuple(all_of.values())
    if old:
        cli = {**compat.translate(old, cli), **cli}
        notes += tuple(f"{compat.flags(compat.BY_NAME[name])[0]} ({compat.BY_NAME[name].origin}) means "
                       f"{compat.BY_NAME[name].meaning}" for name in old)
    cli["verbosity"] = _verbosity(line)
    command = tuple(params["command"])
    options = build_options(
        cli, config, config_source=source, program=command[0] if command else None, args=command[1:]
    )
    if notes:
        options = replace(options, notes=notes)
    if options.json and not options.dry_run:
        raise OptionError("--json", "only applies with --dry-run, --check-isa or --show-topology")
    if options.log_dir is not None:
        _check_log_dir(options.log_dir)
        from xlaunch.launcher.run.logfiles import check_names

        check_names(options.log_dir, options.log_file_prefix, [0], onednn=options.kernel_report)
    if options.summary_json is not None:
        _check_output_file("--summary-json", options.summary_json, created_dir=options.log_dir)
    if options.program is None:
        if options.dry_run:
            return options
        raise OptionError("PROGRAM", "missing (usage: xlaunch [OPTIONS] PROGRAM [ARGS]...)")
    from xlaunch.launcher.cli.program import resolve_program

    return resolve_program(options, environ)


def _check_log_dir(path: str) -> None:
    """The log directory must be a directory, or creatable (its nearest existing parent writable)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise OptionError("--log-dir", f"{path!r} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise OptionError("--log-dir", f"{path!r} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise OptionError("--log-dir", f"cannot create {path!r} ({parent!r} is not a writable directory)")


def _check_output_file(option: str, path: str, created_dir: Optional[str] = None) -> None:
    """A file we will write at the end (atomically, by rename): nothing but a regular file or a
    symlink (replaced, not followed) may sit at ``path``, and a file must be creatable in its
    directory (tried: permissions, read-only mounts and /proc all say no). ``created_dir`` is a
    directory this run will create (``--log-dir``), checked on its own."""
    from xlaunch.userfiles import UserFileError, check_writable_dir, refuse_special

    try:
        refuse_special(path)
    except UserFileError as exc:
        raise OptionError(option, str(exc)) from None
    parent = os.path.dirname(os.path.abspath(path))
    if created_dir is not None and parent == os.path.abspath(created_dir) and not os.path.exists(parent):
        return                                  # --log-dir creates it; _check_log_dir checked that
    if not os.path.isdir(parent):
        problem = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise OptionError(option, f"cannot write {path!r} ({parent!r} {problem})")
    problem = check_writable_dir(parent)
    if problem is not None:
        raise OptionError(option, f"cannot write {path!r} in {parent!r}: {problem}")


def _machine_information(line: CommandLine, environ: Mapping[str, str]) -> int:
    params = line.params
    if params["check_isa"] and params["show_topology"]:
        raise OptionError("--show-topology", "conflicts with --check-isa (one at a time)")
    if params["command"]:
        flag = "--check-isa" if params["check_isa"] else "--show-topology"
        raise OptionError(flag, f"takes no PROGRAM (got {params['command'][0]!r})")
    for flag in ("torch", "probe"):
        if params[flag] and not params["check_isa"]:
            raise OptionError(f"--{flag}", "only applies with --check-isa")
    import json

    from xlaunch.launcher.plan.target import is_live, target_machine
    from xlaunch.machine import report

    machine = target_machine(environ)
    for flag, does in (("probe", "measures"), ("torch", "asks torch about")):
        if params[flag] and not is_live(machine):    # what it found would be shown as the recording's
            raise OptionError(f"--{flag}", f"{does} this machine, not the recorded one in XLAUNCH_FSROOT="
                                           f"{environ.get('XLAUNCH_FSROOT')} (unset XLAUNCH_FSROOT for this one)")
    if params["check_isa"]:
        result = report.isa_report(machine, with_torch=bool(params["torch"]), environ=dict(environ))
        if params["probe"]:
            from xlaunch.launcher.observe import probe

            try:
                measured = probe.run_probe(progress=probe.StepPrinter(sys.stderr))
            except probe.ProbeError as exc:
                sys.stderr.write(f"xlaunch: error: --probe: {exc}\n")
                return 1
            result["probe"] = measured
            report.apply_measurements(result, measured.get("verdicts") or {})   # one verdict per dtype
        text = "" if params["json"] else report.format_isa(result)
        if params["probe"] and not params["json"]:
            text = text.rstrip("\n") + "\n\n" + probe.format_probe(result["probe"])
        if params["json"]:
            text = json.dumps(result, indent=2, sort_keys=False)
    else:
        text = json.dumps(report.topology_json(machine), indent=2) if params["json"] else report.format_topology(machine)
    return write_page(text.rstrip("\n") + "\n", "--check-isa" if params["check_isa"] else "--show-topology")


def _show_cache(line: CommandLine, environ: Mapping[str, str]) -> int:
    """``--show-cache``: the engine cache's folder, cap and entries (reads its metadata only; no torch)."""
    params = line.params
    if params["command"]:
        raise OptionError("--show-cache", f"takes no PROGRAM (got {params['command'][0]!r})")
    for flag in ("check_isa", "show_topology", "torch", "probe"):
        if params[flag]:
            raise OptionError("--show-cache", f"conflicts with --{flag.replace('_', '-')} (one at a time)")
    from xlaunch.kernels.optimize.engines import cache

    try:
        limit = cache.max_bytes(environ)
    except ValueError as exc:
        raise OptionError(cache.SIZE_ENV, str(exc)) from None
    root = cache.cache_dir(environ)
    entries = cache.Cache(root, limit).entries()
    if params["json"]:
        import json

        text = json.dumps({"path": cache.Cache(root, limit).root, "max_bytes": limit,
                           "size": sum(item["size"] for item in entries), "entries": entries[::-1]}, indent=2)
    else:
        text = cache.describe(root, limit, entries)
    return write_page(text.rstrip("\n") + "\n", "--show-cache")


def _launch(options: Options, environ: Mapping[str, str]) -> int:
    if options.per_rank or options.nproc_per_node is not None:   # distributed: launcher/distributed/
        from xlaunch.launcher.distributed.launch import launch_distributed

        return launch_distributed(options, environ)

    from xlaunch.launcher.plan.planner import plan
    from xlaunch.launcher.plan.target import refuse_recorded, target_machine

    machine = target_machine(environ)
    the_plan = plan(options, machine, environ)
    refuse_recorded(machine, options.dry_run)
    if not options.dry_run:
        _check_exec_size(the_plan)
    if options.dry_run or options.verbosity > 0:   # only shown then; a plain run skips the import
        from xlaunch.machine.report import machine_summary

        the_plan = replace(the_plan, machine_summary=dict(machine_summary(machine)))
    quiet = options.verbosity < 0
    from xlaunch.launcher.plan.show import format_plan, message_lines

    if options.dry_run:
        if not quiet:
            sys.stderr.write(message_lines(options.notes, the_plan.warnings))
        if options.json:
            import json

            return write_page(json.dumps(the_plan.to_json(environ), indent=2) + "\n", "--dry-run")
        return write_page(format_plan(the_plan, environ, verbose=options.verbosity > 0), "--dry-run")
    if options.verbosity > 0:
        sys.stderr.write(format_plan(the_plan, environ, verbose=options.verbosity > 1))
    from xlaunch.launcher.run.runner import run_plan

    return run_plan(
        the_plan,
        log_dir=options.log_dir,
        log_file_prefix=options.log_file_prefix,
        keep_going=options.keep_going,
        grace_period=options.grace_period,
        quiet=quiet,
        summary_json=options.summary_json,
        notes=options.notes,   # printed with the plan warnings once the log files are open
    )


# Linux refuses any single argument or variable longer than MAX_ARG_STRLEN (32 pages) with E2BIG
_MAX_ARG_STRLEN = 32 * 4096


def _check_exec_size(the_plan: Any) -> None:
    """Refuse, before anything starts, an argv + environment that exec would refuse (E2BIG)."""
    try:
        limit = os.sysconf("SC_ARG_MAX")
    except (OSError, ValueError):
        limit = 2 * 1024 * 1024
    for inst in the_plan.instances:
        strings = [a.encode("utf-8", "surrogateescape") for a in inst.argv]
        strings += [f"{k}={v}".encode("utf-8", "surrogateescape") for k, v in inst.env.items()]
        longest = max(strings, key=len, default=b"")
        if len(longest) + 1 > _MAX_ARG_STRLEN:
            raise OptionError("ARGS", f"one argument or variable is {len(longest)} bytes long; Linux "
                                      f"execs none longer than {_MAX_ARG_STRLEN - 1} ({longest[:30]!r}...)")
        total = sum(len(b) + 1 + 8 for b in strings) + 16
        if total > limit:
            raise OptionError("ARGS", f"arguments and environment take {total} bytes with what xlaunch adds; "
                                      f"exec allows {limit} (shorten the arguments or the environment)")
