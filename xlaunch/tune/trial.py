"""One measured launch: ``python -m xlaunch --config FILE --log-dir DIR PROGRAM ARGS`` as a child.

The launcher runs in its own session (process group) with its console output in
``DIR/console.log``, each instance's output in ``DIR/trial_instance_<i>.log`` (the runner's own
per-instance logs, where the metric is read) and its summary in ``DIR/summary.json`` (which
instance failed first; with ``kernel-report`` in the trial's configuration, what each
instance's kernels ran, for the kernels column). ``DIR`` is made anew for the run: nothing in it was planted, nothing
is written through a symlink. At ``timeout`` the launcher gets SIGTERM -- it forwards it to
every instance's process group and SIGKILLs them after its grace period -- and if it is still
there ``grace + 5`` s later its group is SIGKILLed (its instances die with it: the runner
starts them with a parent-death signal). Nothing is left running. Reading the metric is
time-bounded too (:func:`.objective.metric_values`), per trial: the runs of one trial (its
repeats, its final rounds) share one :class:`MatchBudget`, so a pattern that backtracks costs a
trial its limit once, not once per run.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from xlaunch.tune import tomlfile
from xlaunch.tune.candidate import Candidate
from xlaunch.tune.objective import METRIC_TIME_LIMIT, Objective, aggregate, metric_values
from xlaunch.userfiles import read_user_file

LOG_PREFIX = "trial"
SUMMARY = "summary.json"


@dataclass
class MatchBudget:
    """Seconds a trial may spend reading its metric, over all its runs."""

    total: float
    left: float = -1.0

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = self.total


def read_metric(objective: Objective, paths: Sequence[str], budget: MatchBudget) -> list[float | str]:
    """:func:`.objective.metric_values` within what is left of ``budget`` (spent as it runs)."""
    assert objective.metric is not None
    if budget.left <= 0:
        return [f"matching the metric took this trial's {budget.total:g}s in earlier runs"] * len(paths)
    started = time.monotonic()
    try:
        found = metric_values(objective.metric, paths, budget.left)
    finally:
        budget.left = max(0.0, budget.left - (time.monotonic() - started))
    return found


@dataclass(frozen=True)
class RunResult:
    """One launch of one configuration."""

    ok: bool
    wall_time: float
    value: Optional[float] = None                      # the objective (None when failed)
    instance_values: tuple[Optional[float], ...] = ()   # per instance, in plan order
    reason: str = ""                                   # why it failed
    directory: str = ""
    kernels: tuple[str, ...] = ()                      # per instance, with kernel-report: what oneDNN ran

    def to_json(self) -> dict:
        return {
            "status": "ok" if self.ok else "failed",
            "reason": self.reason,
            "value": self.value,
            "instance_values": list(self.instance_values),
            "wall_time": round(self.wall_time, 4),
            "directory": self.directory,
            **({"kernels": list(self.kernels)} if self.kernels else {}),
        }


@dataclass
class Launch:
    """How to start the launcher for a trial."""

    command: Sequence[str]                          # PROGRAM [ARGS]...
    timeout: Optional[float] = None
    grace: float = 5.0
    environ: Optional[Mapping[str, str]] = None
    python: str = field(default_factory=lambda: sys.executable)

    @property
    def metric_time_limit(self) -> float:
        """How long reading the metric may take: ``timeout`` (2 s at least), else 10 s."""
        return max(2.0, self.timeout) if self.timeout is not None else METRIC_TIME_LIMIT


def run_once(launch: Launch, candidate: Candidate, objective: Objective, directory: str,
             budget: Optional[MatchBudget] = None) -> RunResult:
    """Run ``candidate`` once with logs in ``directory`` (made anew) and measure it; reading the
    metric spends ``budget`` (the trial's; a budget of its own when None)."""
    config = os.path.join(directory, "trial.toml")
    try:
        fresh_directory(directory)
        tomlfile.write(config, candidate.table, "xlaunch config written by xlaunch-tune")
        console_fd = os.open(os.path.join(directory, "console.log"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:     # a full disk, a read-only directory: this run fails, the session goes on
        return RunResult(False, 0.0, None, (), f"cannot write {directory}: {error.strerror or error}", directory)
    from xlaunch.tune.processes import tethered

    argv = [launch.python, "-m", "xlaunch", "--config", config, "-q", "--log-dir", directory,
            "--log-file-prefix", LOG_PREFIX, "--summary-json", os.path.join(directory, SUMMARY), "--",
            *launch.command]
    environ = dict(os.environ if launch.environ is None else launch.environ)
    timed_out = False
    with open(console_fd, "wb") as console:
        started = time.monotonic()
        proc = subprocess.Popen(tethered(argv), stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                                env=environ, start_new_session=True)
        try:
            proc.wait(timeout=launch.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(proc, launch.grace)
        except BaseException:
            stop(proc, launch.grace)
            raise
        wall = time.monotonic() - started
    kernels = _kernel_cells(os.path.join(directory, SUMMARY), candidate.instances) \
        if candidate.table.get("kernel-report") is True else ()
    if timed_out:
        return RunResult(False, wall, None, (), f"timeout after {launch.timeout:g}s", directory, kernels)
    if proc.returncode != 0:
        return RunResult(False, wall, None, (), _failure(proc.returncode, directory), directory, kernels)
    if objective.metric is None:
        return RunResult(True, wall, wall, (None,) * len(candidate.instances), "", directory, kernels)
    noun = log_noun(candidate.table)
    paths = [os.path.join(directory, f"{LOG_PREFIX}_{noun}_{index}.log") for index in candidate.instances]
    found = read_metric(objective, paths, budget if budget is not None else MatchBudget(launch.metric_time_limit))
    values = tuple(value if isinstance(value, float) else None for value in found)
    problems = [f"{value} from {noun} {index}" + (_lost_output(directory, noun, index) if value.startswith("no ") else "")
                for index, value in zip(candidate.instances, found) if isinstance(value, str)]
    if problems:
        return RunResult(False, wall, None, values, problems[0], directory, kernels)
    value = aggregate([v for v in values if v is not None], objective.aggregate)
    if not math.isfinite(value):                # 1e308 from each instance: past the largest float
        return RunResult(False, wall, None, values, f"the {objective.aggregate} over instances is not finite "
                         f"({', '.join(f'{v:g}' for v in values if v is not None)})"[:200], directory, kernels)
    return RunResult(True, wall, value, values, "", directory, kernels)


def log_noun(table: Mapping[str, object]) -> str:
    """``rank`` when the launch goes through the torchrun front (``nproc-per-node``: its logs are
    ``trial_rank_<i>.log``), else ``instance`` (``trial_instance_<i>.log``)."""
    return "rank" if table.get("nproc-per-node") is not None else "instance"


def _lost_output(directory: str, noun: str, index: int) -> str:
    """Why instance ``index``'s log may lack its metric when the run could not write it all (a full
    disk): the launcher's own count (``instance 1: 1 line(s) missing at the end of its log (...)``),
    else a full file system under ``directory``; "" when its log was written whole."""
    import re

    try:
        text = read_user_file(os.path.join(directory, f"{LOG_PREFIX}_launcher.log"), 16 << 20).decode("utf-8", "replace")
    except ValueError:                              # UserFileError: missing, not a regular file, too large
        text = ""
    said = re.search(rf"^\S+ \S+ (?:warning: )?{noun} {index}: (\d+ line\(s\) missing at the end of its log|cannot "
                     rf"write its log) .*?\((.+?)\)", text, re.MULTILINE)
    if said is not None:
        return f" (its log is cut short: {said.group(2)})"
    try:
        full = os.statvfs(directory).f_bavail == 0
    except OSError:
        full = False
    return f" (its log may be cut short: no space left under {directory})" if full else ""


def _kernel_cells(path: str, instances: Sequence[int]) -> tuple[str, ...]:
    """What each instance's kernels ran, in a few words, from the launcher's ``--summary-json``."""
    from xlaunch.launcher.api import kernel_cell

    try:
        rows = {row.get("index"): row for row in json.loads(read_user_file(path, 16 << 20)).get("instances", [])}
    except (OSError, ValueError, AttributeError):   # UserFileError is a ValueError
        return ()
    return tuple(kernel_cell(((rows.get(index) or {}).get("observed") or {}).get("kernels")) for index in instances)


def fresh_directory(directory: str) -> None:
    """Make ``directory`` anew (an earlier one of that name is removed), so everything in it was
    created by this run: nothing planted there is followed. Its parent (``runs``, ``final``) must
    be a real directory: a symlink, a FIFO or a file there is removed and replaced by one."""
    parent = os.path.dirname(directory)
    if parent:
        if os.path.lexists(parent) and (os.path.islink(parent) or not os.path.isdir(parent)):
            os.unlink(parent)
        os.makedirs(parent, exist_ok=True)
    if os.path.lexists(directory):
        if os.path.isdir(directory) and not os.path.islink(directory):
            shutil.rmtree(directory)
        else:
            os.unlink(directory)
    os.mkdir(directory)


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the launcher (it stops its instances), SIGKILL its group if it outstays. A second
    Ctrl-C (or SIGTERM) while it is being stopped sends the launcher a second SIGTERM, on which it
    kills every instance at once, and the tuner waits for that: it never leaves before its launcher
    and the launcher's instances are gone."""
    if proc.poll() is not None:
        return
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace + 5.0)
        return
    except subprocess.TimeoutExpired:
        pass
    except BaseException:
        _signal(proc, signal.SIGTERM)           # the launcher's "received SIGTERM again: killing ... now"
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        finally:                                # it outstayed, or a third Ctrl-C: its group is killed
            _signal(proc, signal.SIGKILL, group=True)
            proc.wait()
        raise
    _signal(proc, signal.SIGKILL, group=True)
    proc.wait()


def _signal(proc: subprocess.Popen, number: int, group: bool = False) -> None:
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, number) if group else os.kill(proc.pid, number)
    except ProcessLookupError:
        pass


def _failure(code: int, directory: str) -> str:
    """``exit 3 (instance 1)`` or ``exit 139 (instance 1: killed by SIGSEGV)``: the launcher's
    status and the instance that failed first, from its ``--summary-json``.

    Under fail-fast the launcher exits with the first failure's status and stops the others,
    whose status then says why (``killed by SIGTERM (stopped after instance 1 failed)``): the
    instance named is one with the launcher's status that failed on its own."""
    try:
        doc = json.loads(read_user_file(os.path.join(directory, SUMMARY), 16 << 20))
        instances = [i for i in doc["instances"] if isinstance(i, dict)]
    except (ValueError, KeyError, TypeError):
        instances = []
    if instances:
        failed = [i for i in instances if i.get("exit_code") not in (0, None)]
        own = [i for i in failed if not _stopped_by_launcher(str(i.get("status", "")))]
        first = next((i for group in ([i for i in own if i.get("exit_code") == code], own,
                                      [i for i in failed if i.get("exit_code") == code], failed) for i in group), None)
        if first is None:
            return f"exit {code}"
        status = str(first.get("status", ""))
        if status == f"exit {code}":
            return f"exit {code} (instance {first.get('index')})"
        return f"exit {code} (instance {first.get('index')}: {status[:200]})"
    try:       # the launcher itself failed before any instance: its last line says why
        text = read_user_file(os.path.join(directory, "console.log"), 16 << 20).decode("utf-8", "replace")
    except ValueError:
        text = ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"exit {code} ({lines[-1][:200]})" if lines else f"exit {code}"


def _stopped_by_launcher(status: str) -> bool:
    """``killed by SIGTERM (stopped after instance 1 failed)``, ``... (SIGTERM forwarded)``: the
    launcher signalled it (the reason it appends); ``killed by SIGSEGV (core dumped)`` is its own."""
    reason = status.rpartition(" (")[2]
    return status.startswith("killed by") and (reason.startswith("stopped after") or reason.endswith("forwarded)"))
