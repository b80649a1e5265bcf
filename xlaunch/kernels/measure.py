"""Short, noise-robust timing of model variants: is a rewrite really faster on this input?

The variants are run round robin (so a burst of load from another process hits all of them
alike), each sample is long enough to be timed (several calls when one is short), and the
medians are compared with a margin. The whole measurement stays within a time budget.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

# A rewrite counts as slower only beyond this fraction (below it, the difference is noise).
MARGIN = 0.02
BUDGET_S = 1.5
MIN_ROUNDS, MAX_ROUNDS = 3, 9
MIN_SAMPLE_S = 0.01   # a sample repeats a short call until it lasts this long
WARM_CALLS = 3


def interleaved_medians(variants: dict[str, Callable[[], Any]], budget_s: float = BUDGET_S,
                        max_rounds: int = MAX_ROUNDS) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, timed round robin."""
    single: dict[str, float] = {}
    for name, run in variants.items():   # warm calls (first calls build kernels), which size the samples
        times = []
        for _ in range(WARM_CALLS):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        single[name] = max(min(times), 1e-7)
    reps = {name: max(1, int(MIN_SAMPLE_S / t)) for name, t in single.items()}
    round_s = sum(single[name] * reps[name] for name in variants)
    rounds = max(MIN_ROUNDS, min(max_rounds, int(budget_s / max(round_s, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            run, count = variants[name], reps[name]
            start = time.perf_counter()
            for _ in range(count):
                run()
            samples[name].append((time.perf_counter() - start) / count)
    return {name: statistics.median(values) for name, values in samples.items()}


def not_slower(candidate_s: float, baseline_s: float, margin: float = MARGIN) -> bool:
    """True when the candidate is at most ``margin`` slower than the baseline."""
    return candidate_s <= baseline_s * (1.0 + margin)
