"""``xlaunch [OPTIONS] PROGRAM [ARGS]...`` -- the command line (click), and nothing more.

Parsing turns argv (+ ``--config``) into :class:`~xlaunch.launcher.options.Options`; the machine
is read once; :func:`~xlaunch.launcher.plan.plan` decides; ``--dry-run`` prints the plan, else
the runner executes it. Bad input is one line ``xlaunch: error: <option>: <problem>`` and exit
status 2, before anything starts. Nothing here imports torch.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional, Sequence

import click

from xlaunch.launcher.errors import USAGE_EXIT_STATUS, LaunchInputError, OptionError
from xlaunch.launcher.options import (
    ALIASES,
    ALLOCATORS,
    BIND_TOOLS,
    CORE_TYPES,
    DTYPES,
    MEMBIND_POLICIES,
    OMP_RUNTIMES,
    Options,
    build_options,
)

# --help sections, in the order docs/launcher.md presents them
GROUP_INSTANCES = "Instances and cores"
GROUP_PROGRAM = "Program"
GROUP_TUNING = "Runtime tuning"
GROUP_SUPERVISION = "Supervision and output"
GROUP_MACHINE = "Machine information"
GROUP_DISTRIBUTED = "Distributed"
GROUP_ORDER = (GROUP_INSTANCES, GROUP_PROGRAM, GROUP_TUNING, GROUP_DISTRIBUTED, GROUP_SUPERVISION, GROUP_MACHINE)


class GroupedOption(click.Option):
    """A click option that knows its --help section and lists only its dash spellings there."""

    def __init__(self, *args: Any, group: str = GROUP_SUPERVISION, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def get_help_record(self, ctx: click.Context) -> Optional[tuple[str, str]]:
        record = super().get_help_record(ctx)
        if record is None:
            return None
        shown = [o for o in self.opts if "_" not in o]
        spelled = ", ".join(shown)
        if not self.is_flag and not self.count:
            spelled += " " + self.make_metavar(ctx) if _takes_ctx_metavar() else " " + self.make_metavar()
        return spelled, record[1]


def _takes_ctx_metavar() -> bool:
    import inspect

    return "ctx" in inspect.signature(click.Option.make_metavar).parameters


class GroupedCommand(click.Command):
    """A click command whose --help lists options by section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is None:
                continue
            group = getattr(param, "group", GROUP_SUPERVISION)
            sections.setdefault(group, []).append(record)
        for group in GROUP_ORDER + tuple(g for g in sections if g not in GROUP_ORDER):
            if group in sections:
                with formatter.section(group):
                    formatter.write_dl(sections[group])


def _spellings(*names: str) -> list[str]:
    """``ncores_per_instance`` -> ``--ncores-per-instance``, ``--ncores_per_instance`` (+ aliases)."""
    canonical = names[0]
    every = list(names) + [alias for alias, target in ALIASES.items() if target == canonical]
    flags: list[str] = []
    for name in every:
        for spelled in ("--" + name.replace("_", "-"), "--" + name):
            if spelled not in flags:
                flags.append(spelled)
    return flags


def _option(*names: str, group: str, help: str, short: Optional[str] = None, **kwargs: Any):
    decls = ([short] if short else []) + _spellings(*names) + [names[0]]
    kwargs.setdefault("default", None)
    return click.option(*decls, cls=GroupedOption, group=group, help=help, **kwargs)


def _choice(values: Sequence[str]) -> dict[str, Any]:
    """``metavar`` and shell completion for an option taking one of ``values`` (validated later,
    with the config file's values, by :mod:`~xlaunch.launcher.options`)."""
    return {
        "metavar": "[" + "|".join(values) + "]",
        "shell_complete": lambda _ctx, _param, incomplete: [v for v in values if v.startswith(incomplete)],
    }


CONTEXT = {
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
    "max_content_width": 100,
}


@click.command(
    "xlaunch",
    cls=GroupedCommand,
    context_settings=CONTEXT,
    help=(
        "Run PROGRAM (a Python script, -m MODULE, or with --no-python any executable) as one or "
        "more instances, each pinned to its own cores and memory, with OpenMP and allocator "
        "settings tuned for PyTorch on CPUs. Everything after PROGRAM is passed to it untouched."
    ),
)
# -- instances and cores
@_option("ninstances", group=GROUP_INSTANCES, metavar="N", help="Number of instances (default 1, or as many as fit).")
@_option("ncores_per_instance", group=GROUP_INSTANCES, metavar="C",
         help="Cores per instance (logical CPUs with --use-logical-cores).")
@_option("throughput_mode", group=GROUP_INSTANCES, is_flag=True,
         help="One instance per NUMA node with CPUs, using all its cores.")
@_option("latency_mode", group=GROUP_INSTANCES, is_flag=True, help="4 cores per instance, as many instances as fit.")
@_option("nodes_list", group=GROUP_INSTANCES, metavar="LIST", help="Use only these NUMA nodes, e.g. 0,2-3.")
@_option("cores_list", group=GROUP_INSTANCES, metavar="LIST",
         help="Use only these logical CPUs, e.g. 0-7,16 (mapped to their physical cores).")
@_option("use_logical_cores", group=GROUP_INSTANCES, is_flag=True,
         help="Use SMT siblings too; siblings stay in one instance.")
@_option("core_type", group=GROUP_INSTANCES, **_choice(CORE_TYPES),
         help="Hybrid parts: which cores to use (default performance).")
@_option("bind_numa_node", group=GROUP_INSTANCES, is_flag=True, help="No instance spans NUMA nodes.")
@_option("instance_idx", group=GROUP_INSTANCES, metavar="LIST",
         help="Start only these instances of the plan, e.g. 0,2-3.")
# -- program
@_option("module", group=GROUP_PROGRAM, short="-m", is_flag=True, help="PROGRAM is a module: python -m PROGRAM.")
@_option("no_python", group=GROUP_PROGRAM, is_flag=True, help="Execute PROGRAM directly (found on PATH).")
@_option("auto_optimize", group=GROUP_PROGRAM, is_flag=True,
         help="Inject xlaunch.kernels.optimize into the unmodified Python program.")
@_option("dtype", group=GROUP_PROGRAM, **_choice(DTYPES), help="With --auto-optimize: compute type.")
@_option("auto_optimize_verbose", group=GROUP_PROGRAM, is_flag=True,
         help="With --auto-optimize: report what was optimized.")
# -- runtime tuning
@_option("memory_allocator", group=GROUP_TUNING, **_choice(ALLOCATORS),
         help="Allocator to preload (auto: jemalloc, else tcmalloc, else tuned glibc).")
@_option("omp_runtime", group=GROUP_TUNING, **_choice(OMP_RUNTIMES),
         help="OpenMP runtime (auto: Intel OpenMP when libiomp5 is installed, else GNU).")
@_option("bind_with", group=GROUP_TUNING, **_choice(BIND_TOOLS),
         help="How instances are pinned (auto = native: sched_setaffinity + set_mempolicy).")
@_option("membind", group=GROUP_TUNING, **_choice(MEMBIND_POLICIES),
         help="Memory policy on the instance's NUMA nodes (default bind).")
@_option("benchmark", group=GROUP_TUNING, is_flag=True,
         help="Latency-tuned allocator settings: never give memory back.")
# -- distributed (docs/distributed.md; logic in launcher/distributed.py and launcher/ranks.py)
@_option("nproc_per_node", group=GROUP_DISTRIBUTED, metavar="N",
         help="Run N ranks on this node under torch's elastic agent (torchrun), each on its own slice.")
@_option("nnodes", group=GROUP_DISTRIBUTED, metavar="M|MIN:MAX", help="With --nproc-per-node: number of nodes (torchrun).")
@_option("node_rank", group=GROUP_DISTRIBUTED, metavar="R", help="With --nproc-per-node: this node's rank (static rendezvous).")
@_option("master_addr", group=GROUP_DISTRIBUTED, metavar="ADDR", help="With --nproc-per-node: address of node 0.")
@_option("master_port", group=GROUP_DISTRIBUTED, metavar="PORT", help="With --nproc-per-node: port on node 0.")
@_option("rdzv_backend", group=GROUP_DISTRIBUTED, metavar="NAME", help="With --nproc-per-node: rendezvous backend (c10d, static...).")
@_option("rdzv_endpoint", group=GROUP_DISTRIBUTED, metavar="HOST:PORT", help="With --nproc-per-node: rendezvous endpoint.")
@_option("rdzv_id", group=GROUP_DISTRIBUTED, metavar="ID", help="With --nproc-per-node: job id shared by all nodes.")
@_option("max_restarts", group=GROUP_DISTRIBUTED, metavar="K", help="With --nproc-per-node: worker group restarts allowed.")
@_option("per_rank", group=GROUP_DISTRIBUTED, is_flag=True,
         help="Inside torchrun/mpirun/srun ranks: pin this rank to its slice and become PROGRAM.")
@_option("reserve_cores", group=GROUP_DISTRIBUTED, metavar="K",
         help="Keep K cores of each slice out of OpenMP (collectives, data loading); oneCCL workers go there.")
# -- supervision and output
@_option("log_dir", group=GROUP_SUPERVISION, metavar="DIR", help="Write per-instance logs and xlaunch's log here.")
@_option("log_file_prefix", group=GROUP_SUPERVISION, metavar="PREFIX", help="Log file name prefix (default xlaunch).")
@_option("keep_going", group=GROUP_SUPERVISION, is_flag=True,
         help="Let other instances finish when one fails (default: fail fast).")
@_option("grace_period", group=GROUP_SUPERVISION, metavar="S",
         help="Seconds between SIGTERM and SIGKILL when stopping instances (default 5).")
@_option("summary_json", group=GROUP_SUPERVISION, metavar="FILE",
         help="Write the end-of-run summary (statuses, what was observed) as JSON to FILE.")
@_option("dry_run", group=GROUP_SUPERVISION, is_flag=True, help="Print the plan; start nothing.")
@_option("json", group=GROUP_SUPERVISION, is_flag=True,
         help="With --dry-run, --check-isa or --show-topology: print one JSON object.")
@_option("config", group=GROUP_SUPERVISION, metavar="FILE|PRESET",
         help="TOML file of options (flags override it), or a shipped preset: throughput, latency, single.")
@click.option("-v", "--verbose", "verbose", count=True, cls=GroupedOption, group=GROUP_SUPERVISION,
              help="More launcher messages (repeatable).")
@click.option("-q", "--quiet", "quiet", count=True, cls=GroupedOption, group=GROUP_SUPERVISION,
              help="Fewer launcher messages (warnings off).")
# -- machine information
@_option("check_isa", group=GROUP_MACHINE, is_flag=True, help="Print the instruction sets and dtype advice, then exit.")
@_option("torch", group=GROUP_MACHINE, is_flag=True, help="With --check-isa: also ask torch (imports it).")
@_option("probe", group=GROUP_MACHINE, is_flag=True,
         help="With --check-isa: measure GEMM/conv per dtype in a child process and show what oneDNN ran.")
@_option("show_topology", group=GROUP_MACHINE, is_flag=True, help="Print the machine model, then exit.")
@click.version_option(package_name="xlaunch", prog_name="xlaunch", message="%(prog)s %(version)s")
@click.argument("command", nargs=-1, type=click.Path(), metavar="PROGRAM [ARGS]...")
def command(**_: Any) -> None:
    """Parsing only; :func:`run` does the work with ``ctx.params``."""


def _add_compat_options() -> None:
    """ipexrun / run_cpu spellings (:mod:`xlaunch.launcher.compat`): accepted, not in --help."""
    from xlaunch.launcher.compat import SPELLINGS, flags

    for spelling in SPELLINGS:
        command.params.insert(-1, click.Option(flags(spelling) + [spelling.name], is_flag=not spelling.takes_value,
                                               default=None, hidden=True))


_add_compat_options()
NOT_OPTIONS = frozenset({"command", "verbose", "quiet", "config", "check_isa", "torch", "probe", "show_topology"})


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point. A Ctrl-C before the runner took over signals is exit 130 with
    no traceback (nothing had started)."""
    try:
        sys.exit(run(argv))
    except KeyboardInterrupt:
        sys.exit(128 + 2)


def run(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Parse, plan, and dry-run or execute. Returns the exit status."""
    environ = dict(os.environ if environ is None else environ)
    instruction = environ.get(COMPLETE_VAR)
    if instruction:
        return _shell_complete(instruction)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ctx = command.make_context("xlaunch", args)
    except click.exceptions.Exit as done:  # --help, --version
        return done.exit_code
    except click.UsageError as exc:
        return _usage_error(_click_error_line(exc))
    params = ctx.params
    try:
        if params["check_isa"] or params["show_topology"]:
            return _machine_information(ctx, environ)
        options = _options_from(ctx, environ)
        return _launch(options, environ)
    except LaunchInputError as exc:
        return _usage_error(exc.line())


COMPLETE_VAR = "_XLAUNCH_COMPLETE"


def _shell_complete(instruction: str) -> int:
    """Click's shell completion (``eval "$(_XLAUNCH_COMPLETE=bash_source xlaunch)"``; zsh_source,
    fish_source): option names, choices, and files for PROGRAM. Hidden compat spellings are not
    offered."""
    from click.shell_completion import shell_complete

    return shell_complete(command, {}, "xlaunch", COMPLETE_VAR, instruction)


def _usage_error(line: str) -> int:
    sys.stderr.write(line.rstrip("\n").replace("\n", " ") + "\n")
    return USAGE_EXIT_STATUS


def _click_error_line(exc: click.UsageError) -> str:
    """Click's usage errors as ``xlaunch: error: <option>: <problem>``."""
    if isinstance(exc, click.NoSuchOption):
        import difflib

        known = [o for p in command.params if isinstance(p, click.Option) for o in p.opts if "_" not in o]
        close = difflib.get_close_matches(exc.option_name.replace("_", "-"), known, n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        return f"xlaunch: error: {exc.option_name}: no such option{hint}"
    if isinstance(exc, click.BadOptionUsage):
        problem = "requires a value" if "requires an argument" in exc.message else exc.message
        return f"xlaunch: error: {exc.option_name}: {problem}"
    if isinstance(exc, click.BadParameter) and exc.param is not None:
        name = exc.param.opts[0] if getattr(exc.param, "opts", None) else exc.param.name
        return f"xlaunch: error: {name}: {exc.message}"
    return f"xlaunch: error: {exc.format_message()}"


def _given(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _verbosity(ctx: click.Context) -> int:
    return int(ctx.params["verbose"] or 0) - int(ctx.params["quiet"] or 0)


def _options_from(ctx: click.Context, environ: Mapping[str, str]) -> Options:
    """Options from the command line over the config file; the program checked and resolved."""
    params = ctx.params
    for flag in ("torch", "probe"):
        if params[flag]:
            raise OptionError(f"--{flag}", "only applies with --check-isa")
    config: dict[str, Any] = {}
    source = None
    if params["config"] is not None:
        from xlaunch.configs import load_config_option

        config, source = load_config_option(params["config"])
        for key in config:
            if str(key).replace("-", "_") in ("config", "command", "program"):
                raise OptionError("--config", f"{key!r} cannot be set in a config file ({source})")
    from xlaunch.launcher import compat

    cli = {name: value for name, value in params.items()
           if name not in NOT_OPTIONS and name not in compat.BY_NAME and _given(ctx, name)}
    old = {name: params[name] for name in compat.BY_NAME if _given(ctx, name)}
    notes = ()
    if old:
        cli = {**compat.translate(old, cli), **cli}
        notes = tuple(f"{compat.flags(compat.BY_NAME[name])[0]} ({compat.BY_NAME[name].origin}) means "
                      f"{compat.BY_NAME[name].meaning}" for name in old)
    cli["verbosity"] = _verbosity(ctx)
    command = tuple(params["command"])
    options = build_options(
        cli, config, config_source=source, program=command[0] if command else None, args=command[1:]
    )
    if notes:
        import dataclasses

        options = dataclasses.replace(options, notes=notes)
    if options.json and not options.dry_run:
        raise OptionError("--json", "only applies with --dry-run, --check-isa or --show-topology")
    if options.log_dir is not None:
        _check_log_dir(options.log_dir)
        from xlaunch.launcher.logfiles import check_names

        check_names(options.log_dir, options.log_file_prefix, [0])
    if options.summary_json is not None:
        _check_output_file("--summary-json", options.summary_json)
    if options.program is None:
        if options.dry_run:
            return options
        raise OptionError("PROGRAM", "missing (usage: xlaunch [OPTIONS] PROGRAM [ARGS]...)")
    return _resolve_program(options, environ)


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


def _check_output_file(option: str, path: str) -> None:
    """A file we will write at the end: its directory must exist and be writable."""
    if os.path.isdir(path):
        raise OptionError(option, f"{path!r} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise OptionError(option, f"cannot write {path!r} ({parent!r} is not a writable directory)")


def _resolve_program(options: Options, environ: Mapping[str, str]) -> Options:
    """Check PROGRAM exists; with --no-python, replace it by its path on PATH."""
    import dataclasses

    from xlaunch.launcher.which import which

    program = str(options.program)
    if options.no_python:
        path = environ.get("PATH", os.defpath)
        found = which(program, path=path)
        if found is None:
            where = "" if os.sep in program else " on PATH"
            raise OptionError("PROGRAM", f"{program!r} not found{where} (or not executable)")
        return dataclasses.replace(options, program=os.path.abspath(found) if os.sep in program else found)
    if options.module:
        problem = _module_problem(program, environ)
        if problem:
            raise OptionError("PROGRAM", problem)
        return options
    if os.path.isdir(program):
        if not os.path.isfile(os.path.join(program, "__main__.py")):
            raise OptionError("PROGRAM", f"directory {program!r} has no __main__.py")
    elif not os.path.isfile(program):
        raise OptionError("PROGRAM", f"no such file {program!r}")
    return options


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


def _load_machine(environ: Mapping[str, str]):
    from xlaunch.launcher.machine import MachineRootError, load_machine, recorded_root_problem

    root = environ.get("XLAUNCH_FSROOT") or None
    try:
        machine = load_machine(root)
    except MachineRootError as exc:
        raise OptionError("XLAUNCH_FSROOT", str(exc)) from None
    if os.path.realpath(machine.root) != "/":
        problem = recorded_root_problem(machine.root)
        if problem is not None:
            raise OptionError("XLAUNCH_FSROOT", problem)
    return machine


def _machine_information(ctx: click.Context, environ: Mapping[str, str]) -> int:
    params = ctx.params
    if params["check_isa"] and params["show_topology"]:
        raise OptionError("--show-topology", "conflicts with --check-isa (one at a time)")
    if params["command"]:
        flag = "--check-isa" if params["check_isa"] else "--show-topology"
        raise OptionError(flag, f"takes no PROGRAM (got {params['command'][0]!r})")
    for flag in ("torch", "probe"):
        if params[flag] and not params["check_isa"]:
            raise OptionError(f"--{flag}", "only applies with --check-isa")
    import json

    from xlaunch.launcher import report

    machine = _load_machine(environ)
    if params["check_isa"]:
        result = report.isa_report(machine, with_torch=bool(params["torch"]))
        text = "" if params["json"] else report.format_isa(result)
        if params["probe"]:
            from xlaunch.launcher import probe

            try:
                measured = probe.run_probe()
            except probe.ProbeError as exc:
                sys.stderr.write(f"xlaunch: error: --probe: {exc}\n")
                return 1
            result["probe"] = measured
            text = text if params["json"] else text.rstrip("\n") + "\n\n" + probe.format_probe(measured)
        if params["json"]:
            text = json.dumps(result, indent=2, sort_keys=False)
    else:
        text = json.dumps(report.topology_json(machine), indent=2) if params["json"] else report.format_topology(machine)
    sys.stdout.write(text.rstrip("\n") + "\n")
    return 0


def _launch(options: Options, environ: Mapping[str, str]) -> int:
    import dataclasses

    if options.per_rank or options.nproc_per_node is not None:   # distributed: launcher/distributed.py
        from xlaunch.launcher.distributed import launch_distributed

        return launch_distributed(options, environ)

    from xlaunch.launcher.plan import plan

    machine = _load_machine(environ)
    the_plan = plan(options, machine, environ)
    if not options.dry_run and os.path.realpath(machine.root) != "/":
        raise OptionError("XLAUNCH_FSROOT", f"{machine.root} is a recorded machine: its plans can only be printed (add --dry-run)")
    if not options.dry_run:
        _check_exec_size(the_plan)
    if options.dry_run or options.verbosity > 0:   # only shown then; a plain run skips the import
        from xlaunch.launcher.report import machine_summary

        the_plan = dataclasses.replace(the_plan, machine_summary=dict(machine_summary(machine)))
    quiet = options.verbosity < 0
    if not quiet:
        for note in options.notes:
            sys.stderr.write(f"xlaunch: note: {note}\n")
        for warning in the_plan.warnings:
            sys.stderr.write(f"xlaunch: warning: {warning}\n")
    if options.dry_run:
        if options.json:
            import json

            sys.stdout.write(json.dumps(the_plan.to_json(environ), indent=2) + "\n")
        else:
            sys.stdout.write(format_plan(the_plan, environ, verbose=options.verbosity > 0))
        return 0
    if options.verbosity > 0:
        sys.stderr.write(format_plan(the_plan, environ, verbose=options.verbosity > 1))
    from xlaunch.launcher.runner import run_plan

    return run_plan(
        the_plan,
        log_dir=options.log_dir,
        log_file_prefix=options.log_file_prefix,
        keep_going=options.keep_going,
        grace_period=options.grace_period,
        quiet=quiet,
        summary_json=options.summary_json,
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


def format_plan(the_plan: Any, environ: Mapping[str, str], *, verbose: bool = False) -> str:
    """The plan for people: one line per instance, then what the environment gets."""
    import shlex

    from xlaunch.cpulist import format_cpulist

    lines: list[str] = []
    summary = the_plan.machine_summary
    count = len(the_plan.instances)
    head = f"xlaunch plan: {count} instance{'s' if count != 1 else ''}"
    if summary:
        head += _describe_machine(summary)
    lines.append(head)
    for inst in the_plan.instances:
        mem = format_cpulist(inst.mem_nodes) or "-"
        lines.append(
            f"  [{inst.index}] cpus {format_cpulist(inst.cpus)} ({len(inst.cpus)})  "
            f"mem nodes {mem}  bind {inst.bind}/{inst.membind}"
        )
    if the_plan.idle_cpus:
        lines.append(f"  idle cpus: {format_cpulist(the_plan.idle_cpus)}")
    if the_plan.env_set:
        lines.append("  environment (every instance):")
        for name, value in sorted(the_plan.env_set.items()):
            lines.append(f"    {name}={value}")
    per_instance = sorted(
        {name for inst in the_plan.instances for name in inst.env if name not in the_plan.env_set
         and inst.env.get(name) != environ.get(name)}
    )
    for inst in the_plan.instances if per_instance else ():
        values = " ".join(f"{n}={shlex.quote(inst.env[n])}" for n in per_instance if n in inst.env)
        lines.append(f"  [{inst.index}] {values}")
    if the_plan.env_kept:
        kept = ", ".join(f"{k}={v}" for k, v in sorted(the_plan.env_kept.items()))
        lines.append(f"  kept from your environment: {kept}")
    if the_plan.instances and the_plan.instances[0].argv:
        shown = the_plan.instances if verbose else the_plan.instances[:1]
        for inst in shown:
            lines.append(f"  [{inst.index}] argv: {shlex.join(inst.argv)}")
    return "\n".join(lines) + "\n"


def _describe_machine(summary: Mapping[str, Any]) -> str:
    """`` on 112 cores, 224 allowed CPUs (0-223), NUMA nodes 0-1`` from the machine summary."""
    from xlaunch.cpulist import format_cpulist

    parts = []
    if summary.get("cores") is not None:
        parts.append(f"{summary['cores']} cores")
    if summary.get("cpus_allowed") is not None:
        allowed = f"{summary['cpus_allowed']} allowed CPUs"
        if summary.get("allowed_cpulist"):
            allowed += f" ({summary['allowed_cpulist']})"
        parts.append(allowed)
    nodes = summary.get("nodes")
    if isinstance(nodes, (list, tuple)) and nodes:
        parts.append(f"NUMA node{'s' if len(nodes) > 1 else ''} {format_cpulist(nodes)}")
    if summary.get("hybrid"):
        parts.append("hybrid")
    if summary.get("cpu_budget") is not None:
        parts.append(f"CPU budget {summary['cpu_budget']:g}")
    return " on " + ", ".join(parts) if parts else ""
