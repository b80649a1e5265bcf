"""Building, checking and timing the routes, and keeping the fastest (``backend="auto"``).

Routes are built in :data:`~.report.ROUTES` order. An engine route is only started while the time
budget lasts (a build cannot be interrupted; the baselines always build), is skipped when its
library is missing (the report names the pip line) or its build raises (an export that fails skips
the route, never the call), and is rejected when its outputs differ from eager beyond
:data:`~.policy.MAX_REL_ERROR` on the sample or on the sample at another batch size (which also
proves that one build serves every batch size). The survivors are timed round robin within what is
left of the budget (:func:`xlaunch.kernels.optimize.measure.interleaved`), and
:func:`~.policy.choose` keeps one.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Mapping, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize import measure
from xlaunch.kernels.optimize.engines import lowp, policy
from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.report import BASELINES, EngineReport, RouteResult
from xlaunch.kernels.optimize.engines.sample import Sample, max_relative_error
from xlaunch.kernels.optimize.freeze import fresh
from xlaunch.kernels.optimize.progress import Progress
from xlaunch.kernels.optimize.notes import excerpt

MIN_TIMING_S, MAX_TIMING_S = 2.0, 30.0
SETTLE_S = 0.01   # untimed calls before each sample: the previous route's threads go idle
PAUSE_S = 0.05    # and a sleep before them (see measure.interleaved: OpenMP/TBB/ORT threads spin)


def build_route(route: Route, model: nn.Module, sample: Sample, context: Context,
                report: EngineReport) -> Built:
    """``route.build`` with its warnings kept out of the user's way (the torch route's own
    OptimizeWarnings go to the report)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = route.build(model, sample, context)
    report.warnings.extend(f"{route.name}: {str(w.message).removeprefix('xlaunch.optimize: ')}"
                           for w in caught if type(w.message).__name__ == "OptimizeWarning")
    return built


class Checker:
    """Compares a route's outputs with eager on the sample and on the sample at another batch size."""

    def __init__(self, model: nn.Module, sample: Sample, tolerance: float = policy.MAX_REL_ERROR) -> None:
        self.sample = sample
        self.tolerance = tolerance
        self.other = sample.other_batch()
        self.other_reference: Any = None
        if self.other is not None:
            with torch.no_grad():
                self.other_reference = model(*fresh(self.other))

    def error(self, built: Built, any_batch: bool = True) -> tuple[float, Optional[str]]:
        """(max relative error, why the route is unfit or None)."""
        with torch.no_grad():
            error = max_relative_error(self.sample.outputs, built.runner(*self.sample.args))
            if any_batch and self.other is not None:
                try:
                    other = built.runner(*fresh(self.other))
                except Exception as exc:
                    return error, (f"does not serve batch size {int(self.other[self.sample.batched.index(True)].shape[0])} "
                                   f"({type(exc).__name__}: {excerpt(exc)})")
                error = max(error, max_relative_error(self.other_reference, other))
        if not error <= self.tolerance:
            return error, f"wrong results: max relative error {error:.2e} > {self.tolerance:g}"
        return error, None


def build_all(names: tuple[str, ...], routes: Mapping[str, Route], model: nn.Module, sample: Sample,
              context: Context, report: EngineReport, budget_s: float, progress: Progress,
              started: float) -> dict[str, Built]:
    """Every route that builds here and gives eager's results; the report says why the others not."""
    checker = Checker(model, sample, policy.max_rel_error(lowp.name(context.dtype)))
    built: dict[str, Built] = {}
    for name in names:
        route = routes[name]
        result = report.routes.setdefault(name, RouteResult())
        spent = time.perf_counter() - started
        if name not in BASELINES and spent > budget_s:
            result.skipped = f"time budget spent ({spent:.0f} s of {budget_s:.0f} s) before it started"
            continue
        missing = route.missing() or lowp.unsupported(name, context.dtype)   # no kernels in that precision
        if missing:
            result.skipped = missing
            progress.line(f"{name}: skipped: {missing}")
            continue
        with progress.step(f"building {name}") as step:
            begin = time.perf_counter()
            try:
                candidate = build_route(route, model, sample, context, report)
                result.build_s = time.perf_counter() - begin
                error, unfit = (0.0, None) if name == "eager" else checker.error(candidate, name not in BASELINES)
            except Exception as exc:
                result.build_s = time.perf_counter() - begin
                text = excerpt(exc)
                result.skipped = f"failed: {type(exc).__name__}: {text}"
                step.done(result.skipped)
                continue
            result.rel_error = error
            if unfit:
                result.skipped = unfit
                step.done(unfit)
                continue
            checked = time.perf_counter() - begin - result.build_s
            step.done(f"built in {result.build_s:.1f} s, checked in {checked:.1f} s (max relative error {error:.1e})",
                      timed=True)     # the build time the report gives
            built[name] = candidate
    return built


def time_routes(built: Mapping[str, Built], sample: Sample, report: EngineReport, budget_s: float,
                progress: Progress) -> dict[str, list[float]]:
    """Per-round seconds per call of every built route, round robin; medians into the report."""
    args = sample.args
    variants = {name: (lambda runner=b.runner: runner(*args)) for name, b in built.items()}
    budget = min(MAX_TIMING_S, max(MIN_TIMING_S, budget_s))
    with progress.step(f"timing {', '.join(variants)}") as step, torch.no_grad():
        timings = measure.interleaved(variants, budget_s=budget, settle_s=SETTLE_S, pause_s=PAUSE_S)
        step.done(f"{len(next(iter(timings.samples.values())))} rounds")
    for name, seconds in timings.medians().items():
        report.routes[name].ms = seconds * 1e3
    return timings.samples


def run(names: tuple[str, ...], routes: Mapping[str, Route], model: nn.Module, sample: Sample,
        context: Context, report: EngineReport, budget_s: float, progress: Progress,
        single: Optional[str] = None, incumbent: Optional[str] = None) -> tuple[policy.Decision, dict[str, Built]]:
    """Build, check and time ``names``; the decision (the route kept, why, how clear) and the
    built routes. With ``single`` (one route asked for by name) that route is kept when it
    builds, else the torch route. ``incumbent``: the route the cache chose before for this model
    (see :func:`.policy.decide`)."""
    started = time.perf_counter()
    built = build_all(names, routes, model, sample, context, report, budget_s, progress, started)
    decision = None
    if single is not None:
        if single in built:
            decision = policy.Decision(single, "as asked")
        else:
            why = f"{single} could not be used ({report.routes[single].skipped}); the torch route instead"
            built.update(build_all(("torch",), routes, model, sample, context, report, budget_s, progress, started))
            decision = policy.Decision("torch" if "torch" in built else "eager", why)
    left = budget_s - (time.perf_counter() - started)
    samples = time_routes(built, sample, report, left, progress) if len(built) > 1 else {}
    if decision is None:
        decision = policy.decide(samples, incumbent=incumbent) if samples else \
            policy.Decision(next(iter(built)), "the only route built")
    report.backend, report.reason = decision.route, decision.reason
    return decision, built
