"""Short, noise-robust timing of model variants: is a rewrite really faster on this input?

The variants are run round robin (so a burst of load from another process hits all of them
alike), each sample is long enough to be timed (several calls when one is short), and variants
are compared by the median over rounds of their paired ratio (the samples of one round were
taken back to back, so a slow period of the machine cancels out), with a margin. The whole
measurement stays within a time budget.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

# A rewrite counts as slower only beyond this fraction (below it, the difference is noise).
MARGIN = 0.02
BUDGET_S = 2.0
MIN_ROUNDS, MAX_ROUNDS = 5, 9
CONSISTENT = 0.75   # share of rounds that must agree before a variant counts as slower
MIN_SAMPLE_S = 0.01   # a sample repeats a short call until it lasts this long
WARM_CALLS = 3


class Timings:
    """Seconds per call of each variant, one sample per round."""

    def __init__(self, samples: dict[str, list[float]]) -> None:
        self.samples = samples

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def medians(self) -> dict[str, float]:
        return {name: self.median(name) for name in self.samples}

    def ratio(self, name: str, baseline: str) -> float:
        """Median over rounds of (time of ``name`` / time of ``baseline``): below 1 is faster."""
        return statistics.median(a / b for a, b in zip(self.samples[name], self.samples[baseline]))

    def not_slower(self, name: str, baseline: str, margin: float = MARGIN) -> bool:
        """True unless ``name`` measured more than ``margin`` slower than ``baseline``, in the
        median and consistently (in at least ``CONSISTENT`` of the rounds): on a machine so
        loaded that the rounds disagree, the measurement says nothing and the rewrite stays."""
        ratios = [a / b for a, b in zip(self.samples[name], self.samples[baseline])]
        slower_rounds = sum(r > 1.0 + margin for r in ratios)
        return not (statistics.median(ratios) > 1.0 + margin and slower_rounds >= CONSISTENT * len(ratios))


def interleaved_medians(variants: dict[str, Callable[[], Any]], budget_s: float = BUDGET_S,
                        max_rounds: int = MAX_ROUNDS) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, timed round robin."""
    return interleaved(variants, budget_s, max_rounds).medians()


def interleaved(variants: dict[str, Callable[[], Any]], budget_s: float = BUDGET_S,
                max_rounds: int = MAX_ROUNDS, settle_s: float = 0.0, pause_s: float = 0.0) -> Timings:
    """Per-round seconds per call of each zero-argument callable, timed round robin.

    ``settle_s``: before each sample, untimed calls of that variant for about this long (none
    when one call takes longer): variants with thread pools of their own (engines) leave threads
    spinning for a moment after they return, which would otherwise slow the next variant's sample.
    ``pause_s``: a sleep before those calls, and at least one of them: a long call has no settle
    calls otherwise, and OpenMP's threads spin for up to 200 ms (``KMP_BLOCKTIME``) after torch
    returns, TBB's after OpenVINO: measured, ``auto`` timed OpenVINO bf16 at 96 ms on the encoder
    where a 50 ms pause and one untimed call timed it at 77 (the torch route at 89 and 85)."""
    single: dict[str, float] = {}
    for name, run in variants.items():   # warm calls (first calls build kernels), which size the samples
        times = []
        for _ in range(WARM_CALLS):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        single[name] = max(min(times), 1e-7)
    reps = {name: max(1, int(MIN_SAMPLE_S / t)) for name, t in single.items()}
    settle = {name: max(int(settle_s / t), 1 if pause_s > 0 else 0) for name, t in single.items()}
    round_s = sum(single[name] * (reps[name] + settle[name]) + pause_s for name in variants)
    rounds = max(MIN_ROUNDS, min(max_rounds, int(budget_s / max(round_s, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            run, count = variants[name], reps[name]
            if pause_s > 0:
                time.sleep(pause_s)
            for _ in range(settle[name]):
                run()
            start = time.perf_counter()
            for _ in range(count):
                run()
            samples[name].append((time.perf_counter() - start) / count)
    return Timings(samples)


def choose(timings: Timings, preference: list[str], margin: float = MARGIN) -> str:
    """The first variant in ``preference`` (most optimized first) that measured no more than
    ``margin`` slower than every other variant."""
    names = [name for name in preference if name in timings.samples]
    for name in names:
        if all(timings.not_slower(name, other, margin) for other in names if other != name):
            return name
    return min(names, key=timings.median)
