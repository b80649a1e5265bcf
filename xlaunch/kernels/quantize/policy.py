"""Pure decisions for ``quantize``: which INT8 routes to try on this CPU and model, and which
measured variant to return. No torch here; facts come in as plain values.

Why the ISA matters (facts from oneDNN/PyTorch, measured again in docs/quantization.md):
  * u8 x s8 dot products without VNNI/AMX go through ``vpmaddubsw``, whose 16-bit intermediate sums
    saturate: activations must then use 7 bits (``reduce_range``) or results go wrong.
  * static INT8 needs VNNI/AMX to beat fp32 reliably; on AVX2-only parts it can be slower
    (pytorch #144434), so there it is only taken when the measurement says it wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from xlaunch.kernels.optimize.engines.report import versus

# The torch INT8 routes (PT2E, torchao), then the other engines' static INT8 (.engine_routes:
# OpenVINO with NNCF, ONNX Runtime QDQ), calibrated on the same batches.
TORCH_INT8_ROUTES = ("static", "dynamic", "weight_only")
ENGINE_INT8_ROUTES = ("openvino_static", "onnxruntime_static")
INT8_ROUTES = TORCH_INT8_ROUTES + ENGINE_INT8_ROUTES
MODES = ("auto", *INT8_ROUTES)
FP32_EAGER = "fp32_eager"
FP32_OPTIMIZE = "fp32_optimize"
# The fastest bf16 route (optimize(dtype=bf16, backend=...)) where the CPU computes bf16 natively:
# INT8 must beat the best float variant, and auto returns it (mode "bf16") when nothing beats it.
BF16_OPTIMIZE = "bf16_optimize"
FLOAT_VARIANTS = (FP32_EAGER, FP32_OPTIMIZE, BF16_OPTIMIZE)
BF16 = "bf16"
AUTO_ROUTES = (*INT8_ROUTES, BF16)   # what quantize(mode="auto", consider=...) may build

# An INT8 route must beat the best fp32 variant by this factor to be picked (timing noise on a
# shared machine is a few percent; a tie is not worth the accuracy cost).
DEFAULT_SPEEDUP_MARGIN = 1.05
# Largest relative error (max |int8 - fp32| / max |fp32| over the calibration and example inputs) auto accepts.
DEFAULT_MAX_ERROR = 0.1


@dataclass(frozen=True)
class IsaTraits:
    """What the INT8 routes care about in the ISA flags."""

    int8_dot: Optional[str]   # "amx_int8" | "avx512_vnni" | "avx_vnni" | None (multiply-add sequences)
    avx2: bool

    @property
    def reduce_range(self) -> bool:
        """7-bit operands, needed where u8 x s8 products use saturating 16-bit sums. Each route
        sets it its own way: PT2E ``reduce_range`` (activations), ONNX Runtime ``reduce_range``
        (weights), NNCF ``OverflowFix.ENABLE`` (weights) for OpenVINO."""
        return self.int8_dot is None


def isa_traits(flags: Iterable[str], amx_permitted: Optional[bool] = None) -> IsaTraits:
    flags = frozenset(flags)
    if "amx_int8" in flags and amx_permitted is not False:
        dot: Optional[str] = "amx_int8"
    elif "avx512_vnni" in flags:
        dot = "avx512_vnni"
    elif "avx_vnni" in flags:
        dot = "avx_vnni"
    else:
        dot = None
    return IsaTraits(int8_dot=dot, avx2="avx2" in flags)


def check_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"quantize: mode must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def check_limits(max_error: object, rounds: object) -> None:
    """``quantize(max_error=..., rounds=...)`` checked before any work: a positive number, a positive int."""
    if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or not max_error > 0:
        raise ValueError(f"quantize: max_error must be a number > 0, not {max_error!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"quantize: rounds must be an int >= 1, not {rounds!r}")


def check_routes(routes: Optional[Iterable[str]]) -> tuple[str, ...]:
    """``quantize(consider=...)`` checked: the routes auto may build (None: all)."""
    if routes is None:
        return AUTO_ROUTES
    chosen = (routes,) if isinstance(routes, str) else tuple(routes)
    unknown = [r for r in chosen if r not in AUTO_ROUTES]
    if unknown or not chosen:
        raise ValueError(f"quantize: consider must be among {', '.join(AUTO_ROUTES)}, not {list(chosen)!r}")
    return chosen


def candidate_routes(has_linear: bool, has_conv: bool, has_calibration: bool) -> dict[str, Optional[str]]:
    """For ``auto``: each INT8 route -> None when it is worth measuring, else why it is skipped."""
    routes: dict[str, Optional[str]] = {}
    routes["static"] = None if (has_linear or has_conv) and has_calibration else (
        "no calibration data given" if has_linear or has_conv else "no Linear or Conv2d layer")
    routes["dynamic"] = None if has_linear or has_conv else "no Linear or Conv2d layer"
    routes["weight_only"] = None if has_linear else "no nn.Linear layer (weight-only INT8 covers Linear only)"
    for route in ENGINE_INT8_ROUTES:   # static quantization: needs calibration, like "static"
        routes[route] = routes["static"]
    return routes


CONSIDER_SKIP = "not among consider="


def nothing_built(skipped: Mapping[str, str]) -> str:
    """Why ``auto`` built no INT8 route, from each route's skip reason: the routes that were tried
    and failed (with why) apart from those that do not apply here and those ``consider=`` left out."""
    tried = {r: why.removeprefix("failed: ") for r, why in skipped.items()
             if why.startswith("failed: ") or why == "quantized no layer"}
    left_out = [r for r, why in skipped.items() if why == CONSIDER_SKIP]
    moot = {r: why for r, why in skipped.items() if r not in tried and r not in left_out}
    parts = []
    if tried:
        parts.append(f"{len(tried)} failed ({'; '.join(f'{r}: {why}' for r, why in tried.items())})")
    if moot:
        parts.append(f"{len(moot)} {'does' if len(moot) == 1 else 'do'} not apply "
                     f"({'; '.join(f'{r}: {why}' for r, why in moot.items())})")
    if left_out:
        parts.append(f"{len(left_out)} left out by consider= ({', '.join(left_out)})")
    return "no INT8 route was built: " + "; ".join(parts)


def choose(times_ms: Mapping[str, float], errors: Mapping[str, float], max_error: float,
           margin: float = DEFAULT_SPEEDUP_MARGIN) -> tuple[str, str]:
    """The variant to return and why. ``times_ms`` holds FP32_EAGER, maybe FP32_OPTIMIZE and
    BF16_OPTIMIZE (float variants: the best one is what INT8 must beat, and what is returned when
    no INT8 route does), and the INT8 routes that built; ``errors`` the INT8 routes' relative errors."""
    fp32 = min((name for name in FLOAT_VARIANTS if name in times_ms), key=times_ms.__getitem__)
    best_fp32 = times_ms[fp32]
    accurate = [r for r in INT8_ROUTES if r in times_ms and errors.get(r, float("inf")) <= max_error]
    if not accurate:
        return fp32, "no INT8 route kept the relative error within max_error"
    fastest = min(accurate, key=times_ms.__getitem__)
    if times_ms[fastest] * margin <= best_fp32:
        return fastest, (f"{fastest} INT8 measured {versus(best_fp32 / times_ms[fastest], fp32)}, "
                         "the best float variant")
    return fp32, (f"no INT8 route was {margin:.2f}x faster than {fp32} here (the fastest, {fastest}, measured "
                  f"{versus(best_fp32 / times_ms[fastest], fp32)})")
