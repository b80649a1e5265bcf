"""``xlaunch-tune [OPTIONS] [LAUNCHER OPTIONS] PROGRAM [ARGS]...`` -- the command line.

Launcher options given here (``--ncores-per-instance 2``, ``--config base.toml``, ...) are fixed
for every trial; the space varies the rest. Bad input is one line
``xlaunch-tune: error: <option>: <problem>`` and exit status 2, before anything runs.
Exit status: 0 when a best configuration was found, 1 when every trial failed, 130 when
interrupted (results so far are written).
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import click

from xlaunch.launcher.api import USAGE_EXIT_STATUS, LaunchInputError, click_options
from xlaunch.tune.objective import AGGREGATES, GOALS
from xlaunch.tune.strategies import STRATEGIES

PROG = "xlaunch-tune"
DEFAULT_SAMPLED_TRIALS = 20
MAX_SEED = 2**32 - 1            # what Optuna's TPE (numpy's RandomState) takes; the same for every strategy
MAX_TIMEOUT = 10**6             # seconds (11.5 days); past ~2.1e6 the metric matcher's wait overflowed poll()
# launcher parameters that make no sense as fixed trial options (the tuner manages them)
NOT_FIXED = frozenset({"command", "verbose", "quiet", "check_isa", "torch", "show_topology", "dry_run",
                       "json", "log_dir", "log_file_prefix", "instance_idx", "version"})
LAUNCHER_PARAMS = [p for p in click_options() if p.name not in NOT_FIXED]
LAUNCHER_NAMES = frozenset(p.name for p in LAUNCHER_PARAMS)


class UsageError(Exception):
    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option}: {problem}")
        self.line = f"{PROG}: error: {option}: {problem}"


class TuneCommand(click.Command):
    """--help: the tuner's options, then the launcher options that can be fixed."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        own, fixed = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                (fixed if param.name in LAUNCHER_NAMES else own).append(record)
        with formatter.section("Tuning"):
            formatter.write_dl(own)
        with formatter.section("Launcher options fixed for every trial (see xlaunch --help)"):
            formatter.write_dl(fixed)


def _tune_options(function: Any) -> Any:
    options = [
        click.option("--space", metavar="FILE.toml", help="Search space: a [space] table of launcher option names -> "
                     "lists of values (default: derived from the machine)."),
        click.option("--metric", metavar="REGEX", help="Regex with one group matched against each instance's "
                     "output; the last match is the instance's value (default: wall time, minimised)."),
        click.option("--aggregate", metavar="[" + "|".join(AGGREGATES) + "]",
                     help="Combine instances' values (default sum)."),
        click.option("--goal", metavar="[" + "|".join(GOALS) + "]", help="Maximise or minimise (default max with --metric)."),
        click.option("--strategy", metavar="[" + "|".join(STRATEGIES) + "]", default="grid", show_default=True,
                     help="grid: every valid point; random; tpe: Optuna's TPE (pip install 'xlaunch[tune]')."),
        click.option("--trials", metavar="N", help=f"Configurations to measure (grid: all; else {DEFAULT_SAMPLED_TRIALS})."),
        click.option("--repeats", metavar="R", default="1", show_default=True,
                     help="Runs per configuration; the median counts, the spread is reported."),
        click.option("--final-rounds", metavar="K", default="3", show_default=True,
                     help="Interleaved re-measurement rounds of the best against the runner-up (0: none)."),
        click.option("--timeout", metavar="S", help="Seconds per run before it is stopped and marked failed."),
        click.option("--seed", metavar="N", help="Seed for random and tpe."),
        click.option("--output-dir", metavar="DIR", help="Write trials.csv, trials.json, best.toml, tune.png and "
                     "every run's logs here."),
        click.option("--resume", is_flag=True, help="Continue the session in --output-dir (same space and program)."),
        click.option("--no-plot", is_flag=True, help="Write no tune.png in --output-dir (matplotlib is not imported)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


@click.command(PROG, cls=TuneCommand, context_settings={"allow_interspersed_args": False,
                                                         "help_option_names": ["-h", "--help"],
                                                         "max_content_width": 100},
               help="Find the fastest xlaunch configuration for PROGRAM: run it through the launcher for each "
                    "point of a search space and report the best (see docs/tune.md).")
@_tune_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="PROGRAM [ARGS]...")
def command(**_: Any) -> None:
    """Parsing only; :func:`run` does the work."""


command.params[len(command.params) - 1:len(command.params) - 1] = LAUNCHER_PARAMS


@dataclass
class Settings:
    strategy: str
    trials: int
    repeats: int
    final_rounds: int
    timeout: Optional[float]
    seed: Optional[int]
    output_dir: Optional[str]
    resume: bool
    as_json: bool
    plot: bool = True


def main(argv: Optional[Sequence[str]] = None) -> None:
    from xlaunch.launcher.api import prepare_standard_streams

    prepare_standard_streams()    # as the launcher's: a closed or full stderr/stdout never stops a session
    sys.exit(run(argv))


def run(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if environ is None else environ)
    try:
        ctx = command.make_context(PROG, args)
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.UsageError as exc:
        return _usage(f"{PROG}: error: {_click_problem(exc)}")
    try:
        return _tune(ctx, environ)
    except UsageError as exc:
        return _usage(exc.line)


def _usage(line: str) -> int:
    sys.stderr.write(line.replace("\n", " ") + "\n")
    return USAGE_EXIT_STATUS


def _click_problem(exc: click.UsageError) -> str:
    if isinstance(exc, click.NoSuchOption):
        return f"{exc.option_name}: no such option"
    if isinstance(exc, click.BadOptionUsage):
        return f"{exc.option_name}: {'requires a value' if 'requires an argument' in exc.message else exc.message}"
    return exc.format_message()


def _number(params: Mapping[str, Any], name: str, kind: type, minimum: float, maximum: Optional[int] = None) -> Any:
    text = params[name]
    if text is None:
        return None
    option = "--" + name.replace("_", "-")
    from xlaunch.launcher.api import strict_float, strict_int

    try:
        value = strict_int(text) if kind is int else strict_float(text)
    except ValueError:
        raise UsageError(option, f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if value == float("inf"):
        raise UsageError(option, f"must be a finite number, got {text!r}")
    if not value >= minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum:g}" if maximum is None else f"between {minimum:g} and {maximum}"
        raise UsageError(option, f"must be {bounds}, got {text!r}")
    return value


def _tune(ctx: click.Context, environ: Mapping[str, str]) -> int:
    from xlaunch.launcher.api import build_options
    from xlaunch.tune.candidate import Program
    from xlaunch.tune.objective import MetricError, make_objective
    from xlaunch.tune.space import SpaceError, default_space, parse_space

    params = ctx.params
    command_line = tuple(params["command"])
    if not command_line:
        raise UsageError("PROGRAM", f"missing (usage: {PROG} [OPTIONS] PROGRAM [ARGS]...)")
    strategy = str(params["strategy"]).lower()
    if strategy not in STRATEGIES:
        raise UsageError("--strategy", f"{params['strategy']!r} is not one of {', '.join(STRATEGIES)}")
    try:
        objective = make_objective(params["metric"], params["aggregate"], params["goal"])
    except MetricError as exc:
        option, _, problem = str(exc).partition(": ")
        raise UsageError(option, problem) from None

    # fixed launcher options: the command line over the --config file, checked by the launcher
    fixed = {name: params[name] for name in LAUNCHER_NAMES if name != "config" and _given(ctx, name)}
    base_config: dict[str, Any] = {}
    base_source = None
    try:
        if params["config"] is not None:
            from xlaunch.launcher.api import load_config_option

            base_config, base_source = load_config_option(params["config"])
        base = build_options(fixed, base_config, config_source=base_source)
    except LaunchInputError as exc:
        raise UsageError(exc.option, exc.problem) from None
    if "summary_json" in fixed:          # each run writes its own: the user's file would never be written
        raise UsageError("--summary-json", f"{PROG} keeps each run's summary (runs/NNNN-rK/summary.json in "
                         "--output-dir); give it to xlaunch when you run best.toml")

    try:
        if params["space"] is not None:
            space = parse_space(_read(params["space"]), params["space"], fixed=fixed, base_config=base_config)
        else:
            machine = _machine(environ)
            space = default_space(machine, fixed=fixed, base_config=base_config)
    except SpaceError as exc:
        raise UsageError("--space", str(exc)) from None

    settings = _settings(params, strategy, space.size)
    program = Program(command_line, fixed, base_config, base_source, environ)
    from xlaunch.tune.trial import Launch

    launch = Launch(command_line, timeout=settings.timeout, grace=base.grace_period, environ=environ)
    return _session(space, program, objective, settings, launch)


def _machine(environ: Mapping[str, str]) -> Any:
    from xlaunch.machine import MachineRootError, load_machine

    try:
        return load_machine(environ.get("XLAUNCH_FSROOT") or None)
    except MachineRootError as exc:
        raise UsageError("XLAUNCH_FSROOT", str(exc)) from None


def _read(path: str) -> str:
    """The space file: a regular file of at most 1 MiB (xlaunch.userfiles)."""
    from xlaunch.userfiles import UserFileError, read_user_text

    try:
        return read_user_text(path)
    except UserFileError as exc:
        raise UsageError("--space", str(exc)) from None


def _given(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _settings(params: Mapping[str, Any], strategy: str, size: int) -> Settings:
    trials = _number(params, "trials", int, 1)
    if trials is None:
        trials = size if strategy == "grid" else min(DEFAULT_SAMPLED_TRIALS, size)
    output_dir = params["output_dir"]
    if params["resume"] and output_dir is None:
        raise UsageError("--resume", "needs --output-dir (where the earlier session wrote its results)")
    if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError("--output-dir", f"{output_dir!r} exists and is not a directory")
    return Settings(
        strategy=strategy,
        trials=trials,
        repeats=_number(params, "repeats", int, 1),
        final_rounds=_number(params, "final_rounds", int, 0),
        timeout=_number(params, "timeout", float, 0.001, MAX_TIMEOUT),
        seed=_number(params, "seed", int, 0, MAX_SEED),
        output_dir=output_dir,
        resume=bool(params["resume"]),
        as_json=bool(params["as_json"]),
        plot=not params["no_plot"],
    )


def _session(space: Any, program: Any, objective: Any, settings: Settings, launch: Any) -> int:
    import shutil

    from xlaunch.tune import records
    from xlaunch.tune.candidate import Skipped, base_config_notes, prepare
    from xlaunch.tune.report import Progress
    from xlaunch.tune.session import Tuner
    from xlaunch.tune.strategies import StrategyError, import_optuna, make_strategy

    sig = records.signature({
        "command": list(program.command), "space": space.to_json(), "fixed": dict(program.fixed),
        "base_config": dict(program.base_config), "metric": objective.metric.pattern if objective.metric else None,
        "aggregate": objective.aggregate, "goal": objective.goal, records.PROGRAM_DIGEST: records.program_digest(
            list(program.command))})
    # the program itself must be runnable: the launcher's check, once, before anything is written
    with tempfile.TemporaryDirectory(prefix="xlaunch-tune-") as scratch:
        probe = prepare(program, {}, os.path.join(scratch, "candidate.toml"))
    if isinstance(probe, Skipped) and probe.reason.startswith("PROGRAM:"):
        raise UsageError("PROGRAM", probe.reason.split(": ", 1)[1])
    out = settings.output_dir
    previous, previous_skipped = _earlier(out, settings, sig)
    if settings.strategy == "tpe":
        try:
            import_optuna()
        except StrategyError as exc:
            raise UsageError("--strategy", str(exc)) from None
    if out is not None:
        from xlaunch.userfiles import check_writable_dir

        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            raise UsageError("--output-dir", f"cannot create {out!r}: {exc.strerror or exc}") from None
        problem = check_writable_dir(out)
        if problem is not None:
            raise UsageError("--output-dir", f"cannot write in {out!r}: {problem}")
        try:
            held = records.lock(out)
        except records.ResumeError as exc:
            raise UsageError("--output-dir", str(exc)) from None
        try:           # again under the lock: a session that started meanwhile may have written there
            previous, previous_skipped = _earlier(out, settings, sig)
        except UsageError:
            os.close(held)
            raise
    workdir = out if out is not None else tempfile.mkdtemp(prefix="xlaunch-tune-")
    try:
        try:
            storage = os.path.join(out, records.STUDY_DB) if out is not None else None
            strategy = make_strategy(settings.strategy, space, goal=objective.goal, seed=settings.seed,
                                     storage=storage, resume=settings.resume)
        except StrategyError as exc:
            raise UsageError("--strategy", str(exc)) from None
        for note in base_config_notes(program, "in --output-dir" if out is not None else "in its temporary folder"):
            sys.stderr.write(f"{PROG}: warning: --config: {note}\n")
        dims = space.shown()
        sys.stderr.write(f"{PROG}: {space.source}: {dims} ({space.size} points); {settings.strategy}, "
                         f"up to {settings.trials} configuration(s) x {settings.repeats} run(s)"
                         + (f", resuming after {len(previous)}" if previous else "") + "\n")
        bar = Progress(settings.trials)

        def on_change(tuner: Tuner, event: str) -> None:
            best = tuner.best() if event != "final" else None
            text = f"best #{best.number} {best.value:.4g}" if best is not None and best.value is not None else ""
            if event.startswith("start"):
                text = f"running #{event.split()[1]}  {text}"
            elif event == "final":
                text = "re-measuring best vs runner-up"
            bar.update(len(tuner.records), settings.trials, text)
            if out is not None and event in ("trial", "skipped"):
                _save(os.path.join(out, records.TRIALS_JSON), lambda: records.save_json(out, records.document(tuner, sig)))

        tuner = Tuner(space=space, program=program, objective=objective, strategy=strategy, launch=launch,
                      workdir=workdir, trials=settings.trials, repeats=settings.repeats,
                      final_rounds=settings.final_rounds, previous=previous, previous_skipped=previous_skipped,
                      on_change=on_change)
        saved = _stop_on_signals()
        try:
            outcome = tuner.run()
        finally:
            bar.close()
            _restore_signals(saved)
        written = _write_outputs(out, tuner, outcome, sig, program, settings.plot) if out is not None else []
        doc = {**records.document(tuner, sig, outcome), "files": written} if settings.as_json else None
        from xlaunch.tune.report import print_results
        from xlaunch.tune.processes import to_stdout

        to_stdout(lambda: print_results(tuner, outcome, written, doc), f": they are in {out}" if written else "")
        if outcome.interrupted:
            return 130
        return 0 if outcome.best is not None else 1
    finally:
        if out is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            os.close(held)


def _earlier(out: Optional[str], settings: Settings, sig: dict) -> tuple[list, list]:
    """The earlier session's trials and skipped points (--resume), or the check that there is none."""
    from xlaunch.tune import records

    if out is None:
        return [], []
    try:
        if settings.resume:
            return records.load(out, sig)
        records.check_fresh(out)
        return [], []
    except records.ResumeError as exc:
        raise UsageError("--resume" if settings.resume else "--output-dir", str(exc)) from None


def _interrupt(number: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {number}")


def _stop_on_signals() -> dict[int, Any]:
    """SIGTERM and SIGHUP end the session like Ctrl-C: the running trial is stopped (nothing is
    left running) and the results so far are written."""
    import signal

    saved = {}
    for number in (signal.SIGTERM, signal.SIGHUP):
        try:
            saved[number] = signal.signal(number, _interrupt)
        except ValueError:      # not the main thread
            pass
    return saved


def _restore_signals(saved: dict[int, Any]) -> None:
    import signal

    for number, handler in saved.items():
        signal.signal(number, handler)


_unsaved: list[str] = []


def _save(path: str, write: Any) -> Optional[str]:
    """Run ``write()`` (which writes ``path``); a file that cannot be written (a full disk, a
    special file planted at its path) is a warning, once per file, and the session goes on."""
    from xlaunch.userfiles import UserFileError

    try:
        return write()
    except (OSError, UserFileError) as exc:
        problem = getattr(exc, "strerror", None) or str(exc)
        line = f"{PROG}: warning: cannot write {path}: {problem}"
        if line not in _unsaved:
            _unsaved.append(line)
            sys.stderr.write(line + "\n")
        return None


def _write_outputs(out: str, tuner: Any, outcome: Any, sig: dict, program: Any, plotted: bool) -> list[str]:
    from xlaunch.tune import records

    def plot() -> Optional[str]:
        from xlaunch.tune.plot import PlotError, save_plot

        title = f"xlaunch-tune: {shlex.join(program.command)}"
        try:
            png = save_plot(os.path.join(out, "tune.png"), tuner, outcome, title=title[:100])
        except PlotError as error:       # values no axis holds, matplotlib's own failure: the plot only
            sys.stderr.write(f"{PROG}: warning: no tune.png: {error}\n")
            return None
        if png is None:
            sys.stderr.write(f"{PROG}: matplotlib is not installed: no tune.png (pip install 'xlaunch[tune]')\n")
        return png

    writes = [(records.TRIALS_JSON, lambda: records.save_json(out, records.document(tuner, sig, outcome))),
              (records.TRIALS_CSV, lambda: records.save_csv(out, tuner))]
    if outcome.best is not None:
        writes.append((records.BEST_TOML, lambda: records.save_best(
            out, outcome.best, list(program.command), tuner.objective.label, outcome.final)))
    if plotted:
        writes.append(("tune.png", plot))
    return [path for path in (_save(os.path.join(out, name), write) for name, write in writes) if path]
