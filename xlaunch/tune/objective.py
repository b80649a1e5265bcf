"""The objective: a metric read from each instance's output, combined over instances.

``--metric REGEX`` must have exactly one capture group; the *last* match in an instance's
output is that instance's value; ``--aggregate`` combines instances (``sum`` for throughput,
``max`` for latency). Without a metric the objective is the launch's wall time, minimised.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

AGGREGATES = ("sum", "mean", "min", "max")
METRIC_TIME_LIMIT = 10.0      # seconds to read the metric from a run's logs, without --timeout
GOALS = ("max", "min")


class MetricError(ValueError):
    """A metric that cannot be used (bad regex, wrong number of groups)."""


@dataclass(frozen=True)
class Objective:
    metric: Optional[re.Pattern[str]]       # None: wall time
    aggregate: str = "sum"
    goal: str = "max"

    @property
    def label(self) -> str:
        if self.metric is None:
            return "wall time (s)"
        return f"{self.aggregate} over instances of /{self.metric.pattern}/"

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` beats ``b``."""
        return a > b if self.goal == "max" else a < b

    def sort_key(self, value: float) -> float:
        """Ascending sort puts the best first."""
        return -value if self.goal == "max" else value


def make_objective(metric: Optional[str], aggregate: Optional[str], goal: Optional[str]) -> Objective:
    """Check the options and build the objective; raises MetricError naming the option."""
    if aggregate is not None and aggregate not in AGGREGATES:
        raise MetricError(f"--aggregate: {aggregate!r} is not one of {', '.join(AGGREGATES)}")
    if goal is not None and goal not in GOALS:
        raise MetricError(f"--goal: {goal!r} is not one of {', '.join(GOALS)}")
    if metric is None:
        if aggregate is not None:
            raise MetricError("--aggregate: only applies with --metric")
        if goal == "max":
            raise MetricError("--goal: without --metric the objective is wall time, which is minimised")
        return Objective(None, "sum", "min")
    return Objective(compile_metric(metric), aggregate or "sum", goal or "max")


def compile_metric(text: str) -> re.Pattern[str]:
    try:
        pattern = re.compile(text, re.MULTILINE)
    except re.error as exc:
        raise MetricError(f"--metric: not a valid regular expression: {exc}") from None
    if pattern.groups != 1:
        raise MetricError(f"--metric: needs exactly one capture group (the number), found {pattern.groups}")
    return pattern


def last_value(pattern: re.Pattern[str], output: str) -> float | str:
    """The last match's group as a float, or the reason there is none (a string)."""
    last = None
    for last in pattern.finditer(output):
        pass
    if last is None:
        return "no metric"
    return _number(last.group(1))


# Matching runs in a child process so that it can be stopped: Python's re cannot be interrupted,
# and a pattern such as (a+)+$ backtracks for hours on one long line. The child reads the logs
# itself; stdlib only (-I -S: no site, starts in about 15 ms). It reads the last TAIL_BYTES of each
# log, from the first line that starts in them: the last match is the value, and a chatty program's
# gigabytes of output must not take gigabytes of memory to read.
TAIL_BYTES = 64 << 20
_MATCHER = """
import json, os, re, sys
pattern, flags, paths, tail = json.load(sys.stdin)
regex = re.compile(pattern, flags)
found = []
for path in paths:
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > tail:
                handle.seek(size - tail - 1)
                data = handle.read(tail + 1)
                data = data[data.find(b"\\n") + 1:] if b"\\n" in data else b""
            else:
                data = handle.read(tail)
            text = data.decode("utf-8", "replace")
    except FileNotFoundError:
        found.append(["no output", None])
        continue
    except OSError as error:
        found.append(["unreadable output (%s)" % (error.strerror or error), None])
        continue
    last = None
    for last in regex.finditer(text):
        pass
    if last is not None:
        found.append(["match", last.group(1) and last.group(1)[:100]])
    else:
        found.append(["no metric" + (" in the last %d MiB of its output" % (tail >> 20) if size > tail else ""), None])
json.dump(found, sys.stdout)
"""


def metric_values(pattern: re.Pattern[str], paths: Sequence[str], time_limit: float) -> list[float | str]:
    """:func:`last_value` for each file of ``paths`` (the reason as a string where there is no
    number), computed in a child process that is killed after ``time_limit`` seconds."""
    import json
    import subprocess
    import sys

    from xlaunch.tune.processes import snippet_call

    request = json.dumps([pattern.pattern, pattern.flags, list(paths), TAIL_BYTES])
    try:        # killed with the tuner: a pattern that backtracks must not spin on after a kill -9
        done = subprocess.run([sys.executable, "-I", "-S", "-c", snippet_call() + _MATCHER], input=request,
                              capture_output=True, text=True, timeout=time_limit)
    except subprocess.TimeoutExpired:
        return [f"matching the metric took over {time_limit:g}s (a pattern that backtracks, "
                "such as (a+)+$, on a long line?)"] * len(paths)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return [f"matching the metric failed: {last[:200]}"] * len(paths)
    return [_number(text) if kind == "match" else kind for kind, text in json.loads(done.stdout)]


def _number(text: Optional[str]) -> float | str:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"metric {text!r} is not a number"
    if not math.isfinite(value):
        return f"metric {text!r} is not finite"
    return value


def aggregate(values: Sequence[float], how: str) -> float:
    """``values`` combined; a sum past the largest float is ``inf`` (the caller refuses it)."""
    if not values:
        raise ValueError("no values to aggregate")
    if how in ("sum", "mean"):
        try:
            total = math.fsum(values)
        except OverflowError:            # 1e308 from each of two instances: a mean of them is still a number
            return math.inf if how == "sum" else math.fsum(v / len(values) for v in values)
        return total if how == "sum" else total / len(values)
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    raise ValueError(f"unknown aggregate {how!r}")


@dataclass(frozen=True)
class Summary:
    """Repeated measurements of one configuration: median and spread."""

    median: float
    low: float
    high: float
    count: int

    @property
    def spread(self) -> float:
        """(high - low) relative to the median; 0 for one sample."""
        return (self.high - self.low) / abs(self.median) if self.median else 0.0


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("no values to summarize")
    ordered = sorted(values)
    middle = len(ordered) // 2      # statistics.median's (a + b) / 2 is inf for two values near the largest float
    median = ordered[middle] if len(ordered) % 2 else ordered[middle - 1] / 2 + ordered[middle] / 2
    return Summary(median, ordered[0], ordered[-1], len(values))
