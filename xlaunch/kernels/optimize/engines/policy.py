"""Pure decisions of ``backend="auto"``: which routes to try, and which measured route to keep.
No torch here: facts come in as plain values (per-round timings, errors, reasons)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from xlaunch.kernels.optimize.engines.report import BASELINES, ENGINE_ROUTES, ROUTES, versus

# An engine must beat the best baseline (eager or the torch rewrite) by this fraction to be kept:
# timing noise on a shared machine is a few percent, and a tie is not worth a second runtime.
WIN_MARGIN = 0.03
# Largest max-relative-error (max |route - eager| / max |eager|) a route may show on the sample.
MAX_REL_ERROR = 1e-3
# The same gate per precision the routes compute in (fp32 eager is the reference). bf16 keeps 8
# mantissa bits (a rounding step of 2**-8 = 3.9e-3 relative); measured max relative errors of bf16
# routes here: 5e-3 (ResNet-50), 8e-3 (a 4-layer encoder): 3e-2 leaves room for deeper models and
# still rejects a route that is wrong (a dropped layer, a wrong scale gives 1e-1 and more).
# fp16 keeps 11 bits: 1e-2.
# A choice that did not win decisively is "noisy" when the rounds' noise (half the interquartile
# range of the paired ratios) exceeds this: the cache measures it again on a later run. The issue's
# case kept the torch route at 6.7 ms over ONNX Runtime at 3.7 ms with noise 72.8%.
NOISY = 0.10
MAX_REL_ERROR_BY_DTYPE = {"float32": MAX_REL_ERROR, "bfloat16": 3e-2, "float16": 1e-2}
BACKENDS = ("auto", *ROUTES)


def requested_routes(backend: Union[str, Sequence[str]]) -> tuple[str, tuple[str, ...]]:
    """``(label, routes to build)`` for ``backend``: "auto" (every route), one route, or a list of
    routes to choose among (the baselines are always measured with them)."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ValueError(f"optimize: backend must be one of {', '.join(BACKENDS)} or a list of routes, "
                             f"not {backend!r}")
        if backend == "auto":
            return "auto", ROUTES
        return backend, tuple(dict.fromkeys(("eager", backend)))
    if not isinstance(backend, (list, tuple)):
        raise TypeError(f"optimize: backend must be a route name or a list of route names, not "
                        f"{type(backend).__name__}")
    names = list(backend)
    unknown = [name for name in names if name not in ROUTES]
    if unknown or not names:
        raise ValueError(f"optimize: backend routes must be among {', '.join(ROUTES)}, not {names!r}")
    chosen = tuple(name for name in ROUTES if name in names or name in BASELINES)
    return "auto:" + ",".join(name for name in ROUTES if name in names), chosen


def max_rel_error(dtype_name: str = "float32") -> float:
    """The accuracy gate for routes computing in ``dtype_name`` ("float32", "bfloat16", "float16")."""
    return MAX_REL_ERROR_BY_DTYPE.get(dtype_name, MAX_REL_ERROR)


def inference_only_reason(training: bool, has_optimizer: bool, has_sample: bool, grad_inputs: bool) -> Optional[str]:
    """Why engines do not apply to this call (the torch route is used), or None. (A dtype this
    CPU does not compute natively is not one: every route then runs fp32, :mod:`.api`.)"""
    if has_optimizer:
        return "an optimizer was given (training): engines serve inference only"
    if training:
        return "the model is in training mode: engines serve inference only (call model.eval())"
    if not has_sample:
        return "no sample_input: engines are exported, checked and timed on one"
    if grad_inputs:
        return "the sample input requires grad: engines serve inference only"
    return None


def _ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def noise(ratios: Sequence[float]) -> float:
    """The noise of paired ratios: half their interquartile range (0 with fewer than 4 rounds,
    where quartiles say nothing)."""
    if len(ratios) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return (q3 - q1) / 2


def beats(samples: Mapping[str, Sequence[float]], challenger: str, incumbent: str,
          margin: float = WIN_MARGIN) -> tuple[bool, float, float]:
    """``(wins, median ratio, noise)``: ``challenger`` wins when its median paired ratio to
    ``incumbent`` (the rounds pair up: round robin) is below ``1 - margin - noise``: it must be
    faster by the margin *and* by more than the spread the rounds measured."""
    ratios = _ratios(samples[challenger], samples[incumbent])
    ratio, spread = statistics.median(ratios), noise(ratios)
    return ratio <= 1.0 - margin - spread, ratio, spread


def _spread_text(spread: float) -> str:
    return f", noise {spread:.1%}" if spread >= 0.0005 else ""


@dataclass
class Decision:
    """What :func:`decide` kept, against which route, and how sure the rounds make it.
    ``clear`` is False when the choice did not win decisively and the rounds' noise exceeds
    :data:`NOISY`: the cache measures such a choice again on a later run (:mod:`.api`)."""

    route: str
    reason: str
    contender: Optional[str] = None   # the route the choice was compared with last
    ratio: Optional[float] = None     # median paired time ratio: contender / route (above 1: route faster)
    noise: float = 0.0
    clear: bool = True


def choose(samples: Mapping[str, Sequence[float]], margin: float = WIN_MARGIN,
           incumbent: Optional[str] = None) -> tuple[str, str]:
    """``(route, reason)`` of :func:`decide`."""
    decision = decide(samples, margin, incumbent)
    return decision.route, decision.reason


def decide(samples: Mapping[str, Sequence[float]], margin: float = WIN_MARGIN,
           incumbent: Optional[str] = None) -> Decision:
    """The route to keep and why, from per-round seconds per call (round robin, so the rounds of
    two routes pair up).

    The incumbent is ``incumbent`` when given and measured (the choice stored in the cache for
    this model's code, inputs and machine); else the baseline: eager, or torch when torch beats
    eager (a rewrite measured within noise of eager is not kept: bench/engines.py saw such a pick
    run at 0.97x eager). The fastest other route replaces the incumbent only when it
    :func:`beats` it: by ``margin`` plus the noise of the rounds. A noisy tie keeps the incumbent,
    so a model's route does not flip from run to run. The reason compares the route kept with
    the runner-up directly (the route it beat, or the fastest that did not beat it)."""
    baselines = [name for name in BASELINES if name in samples]
    engines = [name for name in ENGINE_ROUTES if name in samples]
    if not baselines:
        raise ValueError("choose: no baseline (eager or torch) was measured")
    baseline = baselines[0]
    for other in baselines[1:]:   # torch only when it wins by the margin and the noise
        if beats(samples, other, baseline, margin)[0]:
            baseline = other
    if incumbent is not None and incumbent in samples:
        challengers = [name for name in (baseline, *engines) if name != incumbent]
        if not challengers:
            return Decision(incumbent, f"kept the stored choice {incumbent} (nothing else measured)")
        fastest = _fastest(samples, challengers, incumbent)
        wins, ratio, spread = beats(samples, fastest, incumbent, margin)
        if wins:
            return Decision(fastest, f"{fastest} measured {versus(1 / ratio, f'the stored choice {incumbent}')}"
                                     f"{_spread_text(spread)}", incumbent, 1 / ratio, spread)
        short = "" if ratio >= 1.0 else f", not by the margin ({margin:.0%}){' plus the noise' if spread >= 0.0005 else ''}"
        return _undecided(incumbent, fastest, ratio, spread,
                          f"kept the stored choice {incumbent}: the best challenger, {fastest}, measured "
                          f"{versus(1 / ratio, incumbent)}{short}")
    if not engines:
        others = [name for name in baselines if name != baseline]
        if not others:
            return Decision(baseline, f"no engine route was built; kept {baseline}")
        _, ratio, spread = beats(samples, others[0], baseline, margin)
        return _undecided(baseline, others[0], ratio, spread,
                          f"no engine route was built; kept {baseline}: {others[0]} measured "
                          f"{versus(1 / ratio, baseline)}")
    fastest = _fastest(samples, engines, baseline)
    wins, ratio, spread = beats(samples, fastest, baseline, margin)
    if wins:
        runner_up = _fastest(samples, [name for name in samples if name != fastest], fastest)
        _, against, spread_up = beats(samples, fastest, runner_up, margin)
        return Decision(fastest, f"{fastest} measured {versus(1 / against, runner_up)}, the runner-up"
                                 f"{_spread_text(spread_up)}", runner_up, 1 / against, spread_up)
    return _undecided(baseline, fastest, ratio, spread,
                      f"no engine beat {baseline} by {margin:.0%}{' plus the noise' if spread >= 0.0005 else ''}: "
                      f"the fastest, {fastest}, measured {versus(1 / ratio, baseline)}")


def _fastest(samples: Mapping[str, Sequence[float]], names: Sequence[str], against: str) -> str:
    return min(names, key=lambda name: statistics.median(_ratios(samples[name], samples[against])))


def _undecided(kept: str, contender: str, ratio: float, spread: float, reason: str) -> Decision:
    """``kept`` stays because ``contender`` (median paired ratio ``ratio`` to it) did not beat it:
    clear unless the rounds were noisier than :data:`NOISY` and ``contender`` was not slower by the
    margin plus that noise (a route several times slower loses whatever the noise)."""
    clear = spread <= NOISY or ratio >= 1.0 + WIN_MARGIN + spread
    tail = "" if clear else f" (too noisy to tell: noise above {NOISY:.0%})"
    return Decision(kept, f"{reason}{_spread_text(spread)}{tail}", contender, 1 / ratio, spread, clear)
