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
        url = f"sqlite:///{storage}" if storage else None
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, space.size // 3)))
        try:
            self.study = optuna.create_study(
                study_name=STUDY_NAME, storage=url, sampler=sampler,
                direction="maximize" if goal == "max" else "minimize", load_if_exists=resume,
            )
        except optuna.exceptions.DuplicatedStudyError:
            raise StrategyError(f"{storage} already holds a study (add --resume to continue it)") from None
        self._pending: dict[str, list[Any]] = {}
        self._repeats = 0
        if resume:
            self._fail_stale()

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
        for trial in pending:
            try:
                self.study.tell(trial, state=FAIL, skip_if_finished=True)
            except Exception as error:      # a full disk under study.db: said, and the results still written
                from xlaunch._errors import error_line

                sys.stderr.write(f"xlaunch-tune: warning: study.db keeps trial {trial.number} RUNNING "
                                 f"({error_line(error)}); --resume marks it failed\n")

    def learn(self, known: list[tuple[Point, Optional[float]]]) -> None:
        """Give a new study what earlier sessions measured (e.g. a grid resumed as tpe)."""
        if self.study.trials:
            return
        TrialState = self._optuna.trial.TrialState
        for point, value in known:
            if set(point) != set(self._distributions):
                continue
            self.study.add_trial(self._optuna.trial.create_trial(
                params=dict(point), distributions=self._distributions,
                value=value, state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
            ))

    def ask(self, done: Collection[str]) -> Optional[Point]:
        if self._repeats >= REPEATS_BEFORE_NUDGE:
            untried = self._untried(done)
            if untried is None:
                return None
            self.study.enqueue_trial(untried)
            self._repeats = 0
        trial = self.study.ask(self._distributions)
        point = {key: trial.params[key] for key in self._space.keys}
        key = point_key(point)
        self._repeats = self._repeats + 1 if key in done else 0
        self._pending.setdefault(key, []).append(trial)
        return point

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
        trials = self._pending.get(point_key(point))
        if not trials:
            return
        trial = trials.pop(0)
        if value is None:
            self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(trial, value)


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
