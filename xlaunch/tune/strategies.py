"""Search strategies: which point to measure next.

Each strategy answers :meth:`Strategy.ask` with a point (or None when it has nothing left) and
hears each result through :meth:`Strategy.tell` (None for a failed or skipped point). ``done``
holds the keys of points already decided (measured, failed or skipped, also by an earlier
session when resuming); grid and random never propose those again. TPE may propose a point
twice; the session answers it from its records without re-running, and after a few repeats in
a row TPE is handed an untried point so the search keeps moving.
"""
from __future__ import annotations

import random
import sys
from typing import Any, Collection, Iterator, Optional

from xlaunch.tune.space import Point, Space, point_key

STRATEGIES = ("grid", "random", "tpe")
STUDY_NAME = "xlaunch-tune"
REPEATS_BEFORE_NUDGE = 3


class StrategyError(RuntimeError):
    """A strategy that cannot start (Optuna missing, a study that does not match)."""


class Strategy:
    name = "base"

    def ask(self, done: Collection[str]) -> Optional[Point]:
        raise NotImplementedError

    def tell(self, point: Point, value: Optional[float]) -> None:
        """Grid and random learn nothing."""

    def learn(self, known: list[tuple[Point, Optional[float]]]) -> None:
        """Results of earlier sessions (``--resume``); grid and random only skip those points."""

    def abandon(self) -> None:
        """The session was interrupted: a point asked for and not told is never measured."""


class GridStrategy(Strategy):
    """Every point, in grid order."""

    name = "grid"

    def __init__(self, space: Space) -> None:
        self._points: Iterator[Point] = space.points()

    def ask(self, done: Collection[str]) -> Optional[Point]:
        for point in self._points:
            if point_key(point) not in done:
                return point
        return None


class RandomStrategy(Strategy):
    """Points in a random order without repetition (seeded)."""

    name = "random"

    def __init__(self, space: Space, seed: Optional[int] = None) -> None:
        self._space = space
        self._order = _shuffled(space.size, random.Random(seed))

    def ask(self, done: Collection[str]) -> Optional[Point]:
        for index in self._order:
            point = self._space.point_at(index)
            if point_key(point) not in done:
                return point
        return None


def _shuffled(size: int, rng: random.Random) -> Iterator[int]:
    """0..size-1 in random order; lazily (sampling with a seen set) when the space is huge."""
    if size <= 1_000_000:
        order = list(range(size))
        rng.shuffle(order)
        yield from order
        return
    seen: set[int] = set()
    while len(seen) < size:
        index = rng.randrange(size)
        if index not in seen:
            seen.add(index)
            yield index


class TpeStrategy(Strategy):
    """Optuna's TPE sampler over categorical dimensions; the study lives in ``storage``
    (an SQLite file) when given, so a later session can resume it."""

    name = "tpe"

    def __init__(self, space: Space, *, goal: str, seed: Optional[int] = None,
                 storage: Optional[str] = None, resume: bool = False) -> None:
        optuna = import_optuna()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._space = space
        self._rng = random.Random(seed)
        self._distributions = {
            d.key: optuna.distributions.CategoricalDistribution(list(d.values)) for d in space.dimensions
        }
        self._storage = storage
        self._startup = min(10, max(2, space.size // 3))
        self._seeded = seed is not None
        self._sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=self._startup)
        self._direction = "maximize" if goal == "max" else "minimize"
        self._storage_errors = _storage_errors(optuna)
        self._told: dict[str, tuple[Point, Optional[float]]] = {}     # every result, for a study moved to memory
        self._pending: dict[str, list[Any]] = {}
        self._repeats = 0
        try:
            self.study = optuna.create_study(
                study_name=STUDY_NAME, storage=f"sqlite:///{storage}" if storage else None, sampler=self._sampler,
                direction=self._direction, load_if_exists=resume,
            )
            if resume:
                self._fail_stale()
        except optuna.exceptions.DuplicatedStudyError:
            raise StrategyError(f"{storage} already holds a study (add --resume to continue it)") from None
        except self._storage_errors as error:        # a full disk, a damaged study.db: the search goes on
            self._to_memory(error)

    def _to_memory(self, error: BaseException) -> None:
        """study.db cannot be written (a full disk) or read: the study goes on in memory, given
        every result so far; said once. trials.json keeps every trial, and ``--resume`` gives a
        study what it lacks (:meth:`learn`)."""
        from xlaunch._errors import error_line

        sys.stderr.write(f"xlaunch-tune: warning: cannot use {self._storage} ({error_line(error, 200)}): TPE goes on "
                         "with its study in memory; trials.json keeps every trial\n")
        self._storage = None
        self._pending.clear()                       # trials of the study left behind
        seed = self._rng.randrange(2**32) if self._seeded else None        # a sampler serves one study
        self._sampler = self._optuna.samplers.TPESampler(seed=seed, n_startup_trials=self._startup)
        self.study = self._optuna.create_study(study_name=STUDY_NAME, sampler=self._sampler, direction=self._direction)
        self._add(list(self._told.values()))

    def _fail_stale(self) -> None:
        """Trials an earlier session left RUNNING (killed before it could :meth:`abandon` them) are
        FAIL: the session holds ``DIR/.xlaunch-tune.lock``, so none of them is running."""
        RUNNING, FAIL = self._optuna.trial.TrialState.RUNNING, self._optuna.trial.TrialState.FAIL
        for trial in self.study.get_trials(deepcopy=False, states=(RUNNING,)):
            self.study.tell(trial.number, state=FAIL, skip_if_finished=True)

    def abandon(self) -> None:
        """Trials asked for and never told (the one Ctrl-C stopped) are FAIL in the study, as
        Optuna's own ``optimize`` marks an interrupted trial: not RUNNING for ever in ``study.db``."""
        FAIL = self._optuna.trial.TrialState.FAIL
        pending = [trial for trials in self._pending.values() for trial in trials]
        self._pending.clear()
        try:
            for trial in pending:
                self.study.tell(trial, state=FAIL, skip_if_finished=True)
            self._fail_stale()      # a Ctrl-C inside study.ask: a trial created, never handed out
        except Exception as error:      # a full disk under study.db: said, and the results still written
            from xlaunch._errors import error_line

            sys.stderr.write(f"xlaunch-tune: warning: study.db keeps trials RUNNING ({error_line(error)}); "
                             "--resume marks them failed\n")

    def learn(self, known: list[tuple[Point, Optional[float]]]) -> None:
        """Give the study what earlier sessions measured and it lacks (a grid resumed as tpe; a
        study.db left behind by a full disk or a kill between a trial's record and its tell)."""
        for point, value in known:
            self._told[point_key(point)] = (point, value)
        TrialState = self._optuna.trial.TrialState
        try:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
            complete = {point_key(t.params) for t in trials if t.state == TrialState.COMPLETE}
            held = {point_key(t.params) for t in trials} | complete
            self._add([(p, v) for p, v in known if point_key(p) not in (held if v is None else complete)])
        except self._storage_errors as error:
            self._to_memory(error)

    def _add(self, known: list[tuple[Point, Optional[float]]]) -> None:
        TrialState = self._optuna.trial.TrialState
        for point, value in known:
            if set(point) != set(self._distributions):
                continue
            self.study.add_trial(self._optuna.trial.create_trial(
                params=dict(point), distributions=self._distributions,
                value=value, state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
            ))

    def ask(self, done: Collection[str]) -> Optional[Point]:
        nudge = None
        if self._repeats >= REPEATS_BEFORE_NUDGE:
            nudge = self._untried(done)
            if nudge is None:
                return None
            self._repeats = 0
        try:
            trial = self._ask(nudge)
        except self._storage_errors as error:
            self._to_memory(error)
            trial = self._ask(nudge)
        point = {key: trial.params[key] for key in self._space.keys}
        key = point_key(point)
        self._repeats = self._repeats + 1 if key in done else 0
        self._pending.setdefault(key, []).append(trial)
        return point

    def _ask(self, nudge: Optional[Point]) -> Any:
        if nudge is not None:
            self.study.enqueue_trial(nudge)
        return self.study.ask(self._distributions)

    def _untried(self, done: Collection[str]) -> Optional[Point]:
        """A random point not in ``done``. Drawn by index first: listing every point of a space of
        millions (two dimensions of 3,000 values) to pick one took minutes and its memory."""
        size = self._space.size
        for _ in range(64 if size > 4 * len(done) else 0):
            point = self._space.point_at(self._rng.randrange(size))
            if point_key(point) not in done:
                return point
        untried = [p for p in self._space.points() if point_key(p) not in done]
        return self._rng.choice(untried) if untried else None

    def tell(self, point: Point, value: Optional[float]) -> None:
        self._told.setdefault(point_key(point), (point, value))
        trials = self._pending.get(point_key(point))
        if not trials:
            return
        trial = trials.pop(0)
        try:
            if value is None:
                self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
            else:
                self.study.tell(trial, value)
        except self._storage_errors as error:    # the study in memory is given this result with the others
            self._to_memory(error)


def _storage_errors(optuna: Any) -> tuple[type[BaseException], ...]:
    """What a study in an SQLite file raises when the file cannot be written or read."""
    import sqlite3

    errors: list[type[BaseException]] = [optuna.exceptions.StorageInternalError, sqlite3.Error, OSError]
    try:
        from sqlalchemy.exc import SQLAlchemyError

        errors.append(SQLAlchemyError)
    except ImportError:         # optuna's journal storages need no SQLAlchemy
        pass
    return tuple(errors)


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise StrategyError(
            "--strategy tpe needs Optuna, which is not installed (pip install 'xlaunch[tune]')"
        ) from None
    return optuna


def make_strategy(name: str, space: Space, *, goal: str, seed: Optional[int] = None,
                  storage: Optional[str] = None, resume: bool = False) -> Strategy:
    if name == "grid":
        return GridStrategy(space)
    if name == "random":
        return RandomStrategy(space, seed)
    if name == "tpe":
        return TpeStrategy(space, goal=goal, seed=seed, storage=storage, resume=resume)
    raise StrategyError(f"--strategy: {name!r} is not one of {', '.join(STRATEGIES)}")
