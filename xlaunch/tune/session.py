"""The tuning loop: ask the strategy, check the point through the launcher, measure it
``repeats`` times, record it, and at the end re-measure the winner against the runner-up,
interleaved, before declaring it.

A configuration whose program fails, times out or prints no metric is recorded as failed with
the reason and never chosen; the loop goes on. Ctrl-C stops the running trial (nothing is left
running) and ends the session with what was measured so far.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from xlaunch.tune.candidate import Candidate, Program, Skipped, prepare
from xlaunch.tune.objective import Objective, Summary, summarize
from xlaunch.tune.space import Point, Space, point_key
from xlaunch.tune.strategies import Strategy
from xlaunch.tune.trial import Launch, MatchBudget, RunResult, run_once
from xlaunch.userfiles import UserFileError

CANDIDATE_FILE = ".candidate.toml"      # where each point is checked by the launcher's --dry-run


@dataclass
class TrialRecord:
    """One configuration, measured ``len(runs)`` times."""

    number: int
    point: Point
    table: dict[str, Any]                 # its launcher config file
    instances: tuple[int, ...]
    runs: list[dict[str, Any]] = field(default_factory=list)   # RunResult.to_json() each
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(run["status"] == "ok" for run in self.runs)

    @property
    def reason(self) -> str:
        return next((run["reason"] for run in self.runs if run["status"] != "ok"), "")

    @property
    def summary(self) -> Optional[Summary]:
        values = [run["value"] for run in self.runs if run["status"] == "ok"]
        return summarize(values) if self.ok and values else None

    @property
    def value(self) -> Optional[float]:
        summary = self.summary
        return summary.median if summary else None

    @property
    def kernels(self) -> str:
        """What oneDNN ran in the last run with a kernel report (``xlaunch --kernel-report``): one
        text for all instances when they agree, else one per instance; "-" when none."""
        cells = next((run["kernels"] for run in reversed(self.runs) if run.get("kernels")), [])
        unique = list(dict.fromkeys(cells))
        return "-" if not unique else unique[0] if len(unique) == 1 else " | ".join(cells)

    @property
    def wall_time(self) -> Optional[float]:
        walls = [run["wall_time"] for run in self.runs]
        return statistics.median(walls) if walls else None

    def to_json(self) -> dict[str, Any]:
        summary = self.summary
        return {
            "number": self.number,
            "config": dict(self.point),
            "status": "ok" if self.ok else "failed",
            "reason": self.reason,
            "value": summary.median if summary else None,
            "low": summary.low if summary else None,
            "high": summary.high if summary else None,
            "repeats": len(self.runs),
            "wall_time": self.wall_time,
            "instances": list(self.instances),
            "runs": list(self.runs),
            "launch_config": dict(self.table),
            "warnings": list(self.warnings),
        }


@dataclass
class Final:
    """The winner re-measured against the runner-up, interleaved."""

    numbers: tuple[int, int]                        # trial numbers: best, runner-up of the search
    values: dict[int, list[float]]                  # trial number -> re-measured values
    failures: dict[int, list[str]]
    winner: Optional[int]

    def to_json(self) -> dict[str, Any]:
        medians = {n: summarize(v).median for n, v in self.values.items() if v}
        return {
            "rounds": max((len(v) + len(self.failures.get(n, ())) for n, v in self.values.items()), default=0),
            "candidates": [
                {"number": n, "values": self.values.get(n, []), "median": medians.get(n),
                 "failures": self.failures.get(n, [])}
                for n in self.numbers
            ],
            "winner": self.winner,
        }


@dataclass
class Outcome:
    trials: list[TrialRecord]
    skipped: list[Skipped]
    final: Optional[Final]
    best: Optional[TrialRecord]
    interrupted: bool = False


class Tuner:
    """One tuning session. ``on_change`` is called after every decided point (records, bar)."""

    def __init__(self, *, space: Space, program: Program, objective: Objective, strategy: Strategy,
                 launch: Launch, workdir: str, trials: int, repeats: int = 1, final_rounds: int = 3,
                 previous: Optional[list[TrialRecord]] = None, previous_skipped: Optional[list[Skipped]] = None,
                 on_change: Optional[Callable[["Tuner", str], None]] = None) -> None:
        self.space = space
        self.program = program
        self.objective = objective
        self.strategy = strategy
        self.launch = launch
        self.workdir = workdir
        self.budget = trials
        self.repeats = max(1, repeats)
        self.final_rounds = final_rounds
        self.records: list[TrialRecord] = list(previous or [])
        self.skipped: list[Skipped] = list(previous_skipped or [])
        self.final: Optional[Final] = None
        self.on_change = on_change or (lambda tuner, event: None)
        self.decided: dict[str, Optional[float]] = {}
        for record in self.records:
            self.decided[point_key(record.point)] = record.value
        for skip in self.skipped:
            self.decided[point_key(skip.point)] = None
        if self.records:
            self.strategy.learn([(r.point, r.value) for r in self.records])

    # ------------------------------------------------------------------ the search

    def run(self) -> Outcome:
        interrupted = False
        try:
            self.search()
            self.final = self.remeasure()
        except KeyboardInterrupt:
            interrupted = True
            self.strategy.abandon()
        finally:
            scratch = os.path.join(self.workdir, CANDIDATE_FILE)
            if os.path.isfile(scratch) and not os.path.islink(scratch):     # ours; not a FIFO planted there
                os.unlink(scratch)
        return Outcome(self.records, self.skipped, self.final, self.best(), interrupted)

    def search(self) -> None:
        asks = 0
        limit = 20 * self.budget + self.space.size
        while len(self.records) < self.budget and asks < limit:
            point = self.strategy.ask(self.decided)
            if point is None:
                break
            asks += 1
            key = point_key(point)
            if key in self.decided:              # TPE proposed a known point: answer from the records
                self.strategy.tell(point, self.decided[key])
                continue
            scratch = os.path.join(self.workdir, CANDIDATE_FILE)
            try:
                prepared = prepare(self.program, point, scratch)
            except (OSError, UserFileError) as error:    # a full disk, a FIFO planted there: this trial fails
                reason = str(error) if isinstance(error, UserFileError) else \
                    f"cannot write {scratch}: {error.strerror or error}"
                prepared = TrialRecord(self._next_number(), point, {}, (),
                                       [RunResult(False, 0.0, reason=reason, directory=self.workdir).to_json()])
            if isinstance(prepared, Skipped):
                self.skipped.append(prepared)
                self.decided[key] = None
                self.strategy.tell(point, None)
                self.on_change(self, "skipped")
                continue
            record = prepared if isinstance(prepared, TrialRecord) else self.measure(prepared, self._next_number())
            self.records.append(record)
            self.decided[key] = record.value
            self.strategy.tell(point, record.value)
            self.on_change(self, "trial")

    def _next_number(self) -> int:
        return max((r.number for r in self.records), default=0) + 1

    def measure(self, candidate: Candidate, number: int) -> TrialRecord:
        record = TrialRecord(number, candidate.point, candidate.table, candidate.instances,
                             warnings=candidate.warnings)
        self.on_change(self, f"start {number}")
        budget = MatchBudget(self.launch.metric_time_limit)     # reading the metric: per trial, not per run
        for repeat in range(1, self.repeats + 1):
            directory = os.path.join(self.workdir, "runs", f"{number:04d}-r{repeat}")
            result = run_once(self.launch, candidate, self.objective, directory, budget)
            record.runs.append(result.to_json())
            if not result.ok:
                break                            # failed once: failed; no need to insist
        return record

    # ------------------------------------------------------------------ the verdict

    def ranked(self) -> list[TrialRecord]:
        ok = [r for r in self.records if r.ok]
        return sorted(ok, key=lambda r: (self.objective.sort_key(r.value), r.number))  # type: ignore[arg-type]

    def remeasure(self) -> Optional[Final]:
        """Best vs runner-up, ``final_rounds`` rounds alternating who goes first."""
        ranked = self.ranked()
        if len(ranked) < 2 or self.final_rounds < 1:
            return None
        first, second = ranked[0], ranked[1]
        final = Final((first.number, second.number), {first.number: [], second.number: []},
                      {first.number: [], second.number: []}, None)
        self.final = final
        self.on_change(self, "final")
        budgets = {first.number: MatchBudget(self.launch.metric_time_limit),
                   second.number: MatchBudget(self.launch.metric_time_limit)}
        for round_number in range(1, self.final_rounds + 1):
            order = (first, second) if round_number % 2 else (second, first)
            for record in order:
                candidate = Candidate(record.point, record.table, record.instances)
                directory = os.path.join(self.workdir, "final", f"{record.number:04d}-round{round_number}")
                result: RunResult = run_once(self.launch, candidate, self.objective, directory,
                                             budgets[record.number])
                if result.ok and result.value is not None:
                    final.values[record.number].append(result.value)
                else:
                    final.failures[record.number].append(result.reason)
                self.on_change(self, "final")
        medians = {n: summarize(v).median for n, v in final.values.items() if v}
        if medians:              # a finalist that failed in a round loses to one that did not fail
            final.winner = min(medians, key=lambda n: (len(final.failures[n]), self.objective.sort_key(medians[n]),
                                                       n != first.number))
        return final

    def best(self) -> Optional[TrialRecord]:
        by_number = {r.number: r for r in self.records}
        if self.final is not None and self.final.winner is not None:
            return by_number[self.final.winner]
        ranked = self.ranked()
        return ranked[0] if ranked else None
