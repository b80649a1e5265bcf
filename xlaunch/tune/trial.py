"""One measured launch: ``python -m xlaunch --config FILE --log-dir DIR PROGRAM ARGS`` as a child.

The launcher runs in its own session (process group) with its console output in
``DIR/console.log`` and each instance's output in ``DIR/trial_instance_<i>.log`` (the runner's
own per-instance logs), which is where the metric is read. With ``kernel-report`` in the trial's
configuration, the launcher also writes ``DIR/summary.json``, read for the kernels column. At ``timeout`` the launcher gets
SIGTERM -- it forwards it to every instance's process group and SIGKILLs them after its grace
period -- and if it is still there ``grace + 5`` s later its group is SIGKILLed (its instances
die with it: the runner starts them with a parent-death signal). Nothing is left running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from xlaunch.tune import tomlfile
from xlaunch.tune.candidate import Candidate
from xlaunch.tune.objective import Objective, aggregate, last_value

LOG_PREFIX = "trial"
SUMMARY_JSON = "summary.json"


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


def run_once(launch: Launch, candidate: Candidate, objective: Objective, directory: str) -> RunResult:
    """Run ``candidate`` once with logs in ``directory`` (created) and measure it."""
    os.makedirs(directory, exist_ok=True)
    config = os.path.join(directory, "trial.toml")
    tomlfile.write(config, candidate.table, "xlaunch config written by xlaunch-tune")
    argv = [launch.python, "-m", "xlaunch", "--config", config, "-q", "--log-dir", directory,
            "--log-file-prefix", LOG_PREFIX]
    summary = os.path.join(directory, SUMMARY_JSON)
    if candidate.table.get("kernel-report") is True:
        argv += ["--summary-json", summary]
    argv += list(launch.command)
    environ = dict(os.environ if launch.environ is None else launch.environ)
    timed_out = False
    with open(os.path.join(directory, "console.log"), "wb") as console:
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
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
    kernels = _kernel_cells(summary, candidate.instances) if "--summary-json" in argv else ()
    values: list[Optional[float]] = []
    problems: list[str] = []
    for index in candidate.instances:
        found = _instance_value(objective, directory, index)
        values.append(found if isinstance(found, float) else None)
        if isinstance(found, str):
            problems.append(f"{found} from instance {index}")
    if timed_out:
        return RunResult(False, wall, None, tuple(values), f"timeout after {launch.timeout:g}s", directory, kernels)
    if proc.returncode != 0:
        return RunResult(False, wall, None, tuple(values), _failure(proc.returncode, directory), directory, kernels)
    if objective.metric is None:
        return RunResult(True, wall, wall, tuple(values), "", directory, kernels)
    if problems:
        return RunResult(False, wall, None, tuple(values), problems[0], directory, kernels)
    value = aggregate([v for v in values if v is not None], objective.aggregate)
    return RunResult(True, wall, value, tuple(values), "", directory, kernels)


def _kernel_cells(path: str, instances: Sequence[int]) -> tuple[str, ...]:
    """What each instance's kernels ran, in a few words, from the launcher's ``--summary-json``."""
    import json

    from xlaunch.launcher.api import kernel_cell

    try:
        with open(path, encoding="utf-8") as handle:
            rows = {row.get("index"): row for row in json.load(handle).get("instances", [])}
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(kernel_cell(((rows.get(index) or {}).get("observed") or {}).get("kernels")) for index in instances)


def _instance_value(objective: Objective, directory: str, index: int) -> float | str | None:
    if objective.metric is None:
        return None
    path = os.path.join(directory, f"{LOG_PREFIX}_instance_{index}.log")
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "no output"
    return last_value(objective.metric, text)


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the launcher (it stops its instances), SIGKILL its group if it outstays."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace + 5.0)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _failure(code: int, directory: str) -> str:
    """``exit 3 (instance 1: killed by SIGSEGV)`` from the launcher's status and log summary."""
    detail = ""
    try:
        with open(os.path.join(directory, f"{LOG_PREFIX}_launcher.log"), encoding="utf-8", errors="replace") as log:
            rows = [line.split("summary: ", 1)[1] for line in log if "summary: " in line]
    except OSError:
        rows = []
    for row in rows:
        parts = row.split()
        if len(parts) >= 4 and parts[0].isdigit():
            text = " ".join(parts[2:-1])
            if text != "exit 0":
                detail = f" (instance {parts[0]})" if text == f"exit {code}" else f" (instance {parts[0]}: {text})"
                break
    if not rows:     # the launcher itself failed: its last line says why
        try:
            with open(os.path.join(directory, "console.log"), encoding="utf-8", errors="replace") as console:
                lines = [line.strip() for line in console if line.strip()]
            if lines:
                detail = f" ({lines[-1][:200]})"
        except OSError:
            pass
    return f"exit {code}{detail}"
