"""Pure decisions of ``backend="auto"``: which routes to try, and which measured route to keep.
No torch here: facts come in as plain values (per-round timings, errors, reasons)."""
from __future__ import annotations

import statistics
from typing import Mapping, Optional, Sequence, Union

from xlaunch.kernels.optimize.engines.report import BASELINES, ENGINE_ROUTES, ROUTES

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
    names = list(backend)
    unknown = [name for name in names if name not in ROUTES]
    if unknown or not names:
        raise ValueError(f"optimize: backend routes must be among {', '.join(ROUTES)}, not {names!r}")
    chosen = tuple(name for name in ROUTES if name in names or name in BASELINES)
    return "auto:" + ",".join(name for name in ROUTES if name in names), chosen


def max_rel_error(dtype_name: str = "float32") -> float:
    """The accuracy gate for routes computing in ``dtype_name`` ("float32", "bfloat16", "float16")."""
    return MAX_REL_ERROR_BY_DTYPE.get(dtype_name, MAX_REL_ERROR)


def inference_only_reason(training: bool, has_optimizer: bool, has_sample: bool, grad_inputs: bool,
                          low_precision: Optional[str]) -> Optional[str]:
    """Why engines do not apply to this call (the torch route is used), or None. ``low_precision``:
    a dtype the CPU does not compute natively (its name), which the torch route turns into fp32
    with a warning; a native bf16/fp16 goes to the engines."""
    if has_optimizer:
        return "an optimizer was given (training): engines serve inference only"
    if training:
        return "the model is in training mode: engines serve inference only (call model.eval())"
    if not has_sample:
        return "no sample_input: engines are exported, checked and timed on one"
    if grad_inputs:
        return "the sample input requires grad: engines serve inference only"
    if low_precision:
        return f"dtype {low_precision} is not computed natively on this CPU: the torch route decides (fp32)"
    return None


def _paired_median(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def choose(samples: Mapping[str, Sequence[float]], margin: float = WIN_MARGIN) -> tuple[str, str]:
    """The route to keep and why, from per-round seconds per call (round robin, so the rounds of
    two routes pair up). The baseline is eager, or torch when torch beats eager by ``margin`` (a
    rewrite measured within noise of eager is not kept: bench/engines.py saw such a pick run at
    0.97x eager); an engine replaces the baseline only when its median paired ratio to it is at
    most ``1 - margin``."""
    baselines = [name for name in BASELINES if name in samples]
    engines = [name for name in ENGINE_ROUTES if name in samples]
    if not baselines:
        raise ValueError("choose: no baseline (eager or torch) was measured")
    baseline = baselines[0]
    for other in baselines[1:]:   # torch only when it wins by the margin
        if _paired_median(samples[other], samples[baseline]) <= 1.0 - margin:
            baseline = other
    if not engines:
        return baseline, f"no engine route was built; kept {baseline} of {', '.join(baselines)}"
    fastest = min(engines, key=lambda name: _paired_median(samples[name], samples[baseline]))
    ratio = _paired_median(samples[fastest], samples[baseline])
    if ratio <= 1.0 - margin:
        return fastest, f"{fastest} measured {1 / ratio:.2f}x {baseline}"
    return baseline, (f"no engine beat {baseline} by {margin:.0%} (best: {fastest} at {1 / ratio:.2f}x)")
