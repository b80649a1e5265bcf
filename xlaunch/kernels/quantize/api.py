"""``quantize``: INT8 inference on stock torch, routed by what this CPU measures fastest.

    qmodel = quantize(model, (x,), calibration=[(b,) for b in batches])   # mode="auto"
    qmodel(x); print(qmodel.mode, qmodel.report)
    qmodel.save("model.pt2")
    qmodel = load_quantized("model.pt2")    # another process: no model class, no calibration data

Modes:
  * ``static``: PT2E (torchao ``prepare_pt2e``/``convert_pt2e`` with ``X86InductorQuantizer``),
    observers calibrated on ``calibration``, then ``torch.compile`` with freezing (oneDNN int8).
  * ``dynamic``: the same flow with activation scales computed per call (Linear layers only).
  * ``weight_only``: int8 Linear weights, fp32 activations (torchao ``Int8WeightOnlyConfig``).
  * ``openvino_static``, ``onnxruntime_static``: the other engines' static INT8 (OpenVINO with
    NNCF, ONNX Runtime QDQ per channel), calibrated on the same batches (:mod:`.engine_routes`).
  * ``auto``: builds the routes that apply (by model, calibration and what is installed), measures
    them interleaved with fp32 eager, fp32 ``optimize()`` and, where the CPU computes bf16 natively,
    bf16 ``optimize()`` on ``example_inputs``, and returns the fastest INT8 route whose relative
    error stays within ``max_error``, when it beats the best float variant; else that float variant
    (``mode == "fp32"`` or ``"bf16"``). Without VNNI/AMX the int8 routes use 7-bit operands, each
    its own way: PT2E 7-bit activations (``reduce_range``), ONNX Runtime 7-bit weights
    (``reduce_range``), OpenVINO 7-bit weights (NNCF's overflow fix); the report says which.

The accuracy reported is ``max |int8 - fp32| / max |fp32|`` over the calibration inputs and the
example inputs (inputs the static routes were not calibrated on, unless the example is one of the
batches), with the argmax agreement along the last dimension.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Iterable, Optional

from xlaunch._errors import flag, stacklevel_outside
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.build_mark import marked
from xlaunch.kernels.quantize import policy
from xlaunch.kernels.optimize.progress import Progress
from xlaunch.kernels.optimize.notes import excerpt
from xlaunch.kernels.quantize import engine_routes, inputs, routes, saved
from xlaunch.kernels.quantize.measure import SETTLE_S, accuracy, measure  # noqa: F401 (bench/ imports them here)
from xlaunch.kernels.quantize.result import QuantizedModule, QuantizeReport, RouteResult, load_quantized
from xlaunch.kernels.quantize.routes import QuantizeWarning

__all__ = ["QuantizeReport", "QuantizeWarning", "QuantizedModule", "load_quantized", "quantize"]

META_FILE, FORMAT_VERSION = saved.META_FILE, saved.FORMAT_VERSION


# --- the API ---------------------------------------------------------------------------------

def _layers(model: nn.Module) -> tuple[bool, bool]:
    has_linear = any(isinstance(m, nn.Linear) for m in model.modules())
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    return has_linear, has_conv


def _machine_traits() -> policy.IsaTraits:
    from xlaunch.kernels.native_dtypes import isa_flags
    from xlaunch.machine import current_machine

    # the flags oneDNN may use (ONEDNN_MAX_CPU_ISA caps them), as for the bf16 choice
    return policy.isa_traits(isa_flags(), current_machine().isa.amx_permitted)


def _build(route: str, model: nn.Module, example: tuple, calibration: Optional[list[tuple]],
           reduce_range: bool, program: routes.FloatProgram) -> routes.Built:
    if route == "static":
        assert calibration is not None
        return routes.build_pt2e(model, example, calibration, dynamic=False, reduce_range=reduce_range,
                                 program=program)
    if route == "dynamic":
        return routes.build_pt2e(model, example, [example], dynamic=True, reduce_range=reduce_range,
                                 program=program)
    if route in policy.ENGINE_INT8_ROUTES:
        assert calibration is not None
        return engine_routes.build(route, model, example, calibration, seven_bit=reduce_range)
    return routes.build_weight_only(model)


def _build_and_check(route: str, fp32: nn.Module, example: tuple, batches: Optional[list[tuple]],
                     checks: list[tuple], traits: policy.IsaTraits, mode: str, report: QuantizeReport,
                     model: nn.Module, program: routes.FloatProgram) -> Optional[tuple[routes.Built, list[Any]]]:
    """The route built and its outputs on ``checks``; None (recorded as skipped) when it fails or
    quantizes nothing under ``auto``, one ValueError for an explicit mode."""
    try:
        build = _build(route, fp32, example, batches, traits.reduce_range, program)
        outputs = [build.runner(*batch) for batch in checks]
    except Exception as exc:
        if mode != "auto":
            raise ValueError(f"quantize: {route} INT8 failed on {type(model).__name__}: {_failure(exc)}") from exc
        report.routes[route] = RouteResult(skipped=f"failed: {_failure(exc)}")
        return None
    if not build.quantized:
        if mode != "auto":
            raise ValueError(f"quantize: mode={mode!r} quantized no layer of {type(model).__name__} "
                             f"({'; '.join(f'{k}: {v}' for k, v in build.kept_fp32.items()) or 'nothing eligible'})")
        report.routes[route] = RouteResult(skipped="quantized no layer")
        return None
    return build, outputs


def _failure(exc: BaseException) -> str:
    """``Type: first line`` of what made a route fail. torch.compile's wrappers (BackendCompilerFailed,
    InductorError) carry it as ``inner_exception``; the wrapper's own first line says only
    ``backend='inductor' raised:``."""
    seen: set[int] = set()
    while isinstance(getattr(exc, "inner_exception", None), BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.inner_exception   # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {excerpt(exc)}"


def _warn(report: QuantizeReport, message: str) -> None:
    report.warnings.append(message)
    warnings.warn(f"xlaunch.quantize: {message}", QuantizeWarning, stacklevel=stacklevel_outside("xlaunch"))


@marked("quantize")
def quantize(model: nn.Module, example_inputs: Any, *, calibration: Optional[Iterable[Any]] = None,
             mode: str = "auto", max_error: float = policy.DEFAULT_MAX_ERROR,
             rounds: int = 7, consider: Optional[Iterable[str]] = None, progress: bool = True) -> QuantizedModule:
    """Quantize a copy of ``model`` (put in eval mode) to INT8; see the module docstring.

    ``example_inputs``: a tensor or tuple of inputs (timing, export); ``calibration``: an iterable
    of input tuples, of which the first 64 batches are read (:data:`.inputs.MAX_BATCHES`; static needs
    it; it is also where accuracy is measured). ``max_error`` is the
    largest relative error ``auto`` accepts; ``rounds`` the interleaved timing rounds of ``auto``;
    ``consider`` what ``auto`` may build: INT8 routes and ``"bf16"`` (the bf16 float variant), by
    default all of them (:data:`.policy.AUTO_ROUTES`). An explicit mode whose relative error
    exceeds ``max_error`` is returned with one :class:`QuantizeWarning` saying so.
    ``progress``: each step that takes seconds is a line on stderr (``xlaunch.quantize: ...``;
    a bar on a terminal), the first one before any work.
    """
    mode = policy.check_mode(mode)
    progress = flag(progress, "quantize: progress")   # progress="no" showed the bar
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize: model must be a torch.nn.Module, not {type(model).__name__}")
    example = inputs.check_rows(inputs.as_args(example_inputs, "example_inputs"), "example_inputs")
    batches, notes = inputs.calibration_batches(calibration, example)
    if mode == "static" and batches is None:
        raise ValueError("quantize: mode='static' needs calibration=[(inputs...), ...] to set the "
                         "activation scales (or use mode='dynamic' or 'weight_only')")
    policy.check_limits(max_error, rounds)
    if consider is not None and mode != "auto":
        raise ValueError(f"quantize: consider= limits what mode='auto' builds; mode={mode!r} builds that route "
                         "alone (drop consider=, or use mode='auto')")
    steps = 3 if mode != "auto" else 2 + len(policy.INT8_ROUTES)   # a terminal bar's length (about)
    show = Progress(total=steps, enabled=progress, title=PROGRESS_TITLE)
    try:
        # Under the caller's torch.inference_mode, every tensor the routes make (quantized weights,
        # the exported program) would be an inference tensor, which torch.export refuses: save failed.
        with torch.inference_mode(False):
            example = inputs.plain(example)
            batches = None if batches is None else [inputs.plain(batch) for batch in batches]
            return _quantize(model, example, batches, mode, max_error, rounds, policy.check_routes(consider),
                             show, notes)
    finally:
        show.close()


PROGRESS_TITLE = "xlaunch.quantize"


def _quantize(model: nn.Module, example: tuple, batches: Optional[list[tuple]], mode: str, max_error: float,
              rounds: int, allowed: tuple[str, ...], show: Progress, notes: Optional[list[str]] = None) -> QuantizedModule:
    # The example too: an error measured only on the batches that set the static routes' activation
    # ranges says nothing about other inputs (one calibration sample: 0.03 there, 0.23 on another).
    checks = [*batches, example] if batches and not any(_same(example, b) for b in batches) else batches or [example]
    with show.step(f"{type(model).__name__}, mode {mode}: fp32 reference outputs") as step:
        traits = _machine_traits()
        report = QuantizeReport(mode=mode, requested=mode, isa_int8_dot=traits.int8_dot,
                                reduce_range=traits.reduce_range, warnings=list(notes or []))
        fp32 = copy.deepcopy(model).eval()
        has_linear, has_conv = _layers(fp32)
        reference = [_reference(fp32, batch, index, batch is example, model) for index, batch in enumerate(checks)]
        step.done(f"int8 dot products: {traits.int8_dot or 'none'}"
                  + ("; 7-bit operands" if traits.reduce_range else ""))
    for note in notes or []:
        show.line(note)

    if mode == "auto":
        wanted = {route: why if route in allowed else policy.CONSIDER_SKIP for route, why in
                  policy.candidate_routes(has_linear, has_conv, batches is not None).items()}
    else:
        reason = policy.candidate_routes(has_linear, has_conv, True)[mode]
        if reason is not None:
            raise ValueError(f"quantize: mode={mode!r} cannot quantize {type(model).__name__}: {reason}")
        wanted = {mode: None}

    built: dict[str, routes.Built] = {}
    program = routes.FloatProgram(fp32, example)     # exported at the first PT2E route, once
    for route, skip in wanted.items():
        if skip is None and route in policy.ENGINE_INT8_ROUTES:
            skip = engine_routes.missing(route)
            if skip is not None and mode != "auto":
                raise ValueError(f"quantize: mode={mode!r}: {skip}")
        if skip is not None:
            report.routes[route] = RouteResult(skipped=skip)
            if skip != policy.CONSIDER_SKIP:
                show.line(f"{route}: skipped ({skip})")
            continue
        with show.step(f"building {route} INT8") as step:
            done = _build_and_check(route, fp32, example, batches, checks, traits, mode, report, model, program)
            if done is None:
                step.done(f"skipped: {report.routes[route].skipped}")
                continue
            build, outputs = done
            error, agreement = accuracy(reference, outputs)
            report.routes[route] = RouteResult(rel_error=error, argmax_agreement=agreement,
                                               int8_range=build.int8_range or None)
            built[route] = build
            step.done(f"relative error {error:.4f}" + (" (over max_error)" if error > max_error else ""))

    unsupported = routes.unsupported_modules(fp32)
    if mode != "auto":
        with show.step(f"timing {mode} against fp32 eager (3 rounds)") as step:
            times = measure({policy.FP32_EAGER: fp32, mode: built[mode].runner}, example, rounds=3)
            step.done(f"{times[mode]:.3f} ms against {times[policy.FP32_EAGER]:.3f} ms")
        for name, ms in times.items():
            report.routes.setdefault(name, RouteResult()).ms = ms
        error = report.routes[mode].rel_error
        if error is not None and error > max_error:
            _warn(report, f"{mode} INT8 has relative error {error:.4f} against fp32, over max_error={max_error:g}; "
                          "mode='auto' keeps only routes within it")
        ratio = times[policy.FP32_EAGER] / times[mode]
        if ratio < 1:
            _warn(report, f"{mode} INT8 measured {ratio:.2f}x fp32 eager (slower) on example_inputs here; "
                          "mode='auto' returns the fastest variant")
        return _finish(report, mode, built[mode], fp32, example, unsupported, f"as asked ({ratio:.2f}x fp32 eager)")

    if not built:   # nothing to compare: the model comes back as it was, said once, loudly
        report.mode = "fp32"
        report.reason = policy.nothing_built({route: r.skipped for route, r in report.routes.items() if r.skipped})
        report.kept_fp32 = {"(whole model)": report.reason, **unsupported}
        show.line(f"kept fp32: {report.reason}")
        _warn(report, f"auto returns fp32 for {type(model).__name__}: {report.reason}")
        return QuantizedModule(_no_grad(fp32), lambda: routes.export(fp32, example), "fp32", report, keep=fp32)
    variants: dict[str, Callable[..., Any]] = {policy.FP32_EAGER: fp32}
    # The fastest float route is what INT8 must beat (building engines takes seconds: only with
    # an INT8 route to compare).
    optimized = _optimized(fp32, example, report, show=show)
    if optimized is not None:
        variants[policy.FP32_OPTIMIZE] = optimized
    bf16 = (_optimized(fp32, example, report, torch.bfloat16, show=show)
            if policy.BF16 in allowed and _native_bf16() else None)
    if bf16 is not None:
        variants[policy.BF16_OPTIMIZE] = bf16
    variants.update({route: b.runner for route, b in built.items()})
    with show.step(f"timing {len(variants)} variants ({rounds} interleaved rounds)") as step:
        times = measure(variants, example, rounds=rounds)
        step.done(", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items()))
    for name, ms in times.items():
        report.routes.setdefault(name, RouteResult()).ms = ms
    errors = {route: report.routes[route].rel_error for route in built}
    choice, why = policy.choose(times, errors, max_error)
    show.line(f"kept {choice}: {why}")
    if choice in built:
        return _finish(report, choice, built[choice], fp32, example, unsupported, why)
    float_mode = "bf16" if choice == policy.BF16_OPTIMIZE else "fp32"
    report.mode, report.reason = float_mode, why
    report.kept_fp32 = {"(whole model)": why}
    runner = variants[choice]
    source = routes.Bf16Program(fp32) if float_mode == "bf16" else fp32
    return QuantizedModule(_no_grad(runner), lambda: routes.export(source, example), float_mode, report,
                           keep=runner if isinstance(runner, nn.Module) else None)


def _reference(fp32: nn.Module, batch: tuple, index: int, is_example: bool, model: nn.Module) -> Any:
    """The fp32 model's outputs on ``batch``; a model that fails on it is one ValueError naming the
    inputs (the model's own error chained), before anything is built."""
    try:
        with torch.no_grad():
            return fp32(*batch)
    except Exception as exc:
        what = "example_inputs" if is_example else f"calibration batch {index}"
        raise ValueError(f"quantize: {type(model).__name__} fails on {what} "
                         f"({', '.join(map(inputs.signature, batch))}): {_failure(exc)}") from exc


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
        else x is y for x, y in zip(a, b))


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with torch.no_grad():
            return fn(*args)
    return run


# The fp32 candidate is the fastest fp32 route, engines included; fp32 inductor is left out (the
# INT8 routes are inductor graphs already, and it compiles for tens of seconds).
FP32_BACKENDS = ["onnxruntime", "openvino"]
BF16_BACKENDS = ["openvino"]
FP32_TIME_BUDGET_S = 120.0


def _native_bf16() -> bool:
    from xlaunch.kernels.native_dtypes import bf16_unsupported_reason, isa_flags

    return bf16_unsupported_reason(isa_flags()) is None


def _optimized(fp32: nn.Module, example: tuple, report: QuantizeReport,
               dtype: Any = None, show: Optional[Progress] = None) -> Optional[Callable[..., Any]]:
    """The fastest fp32 (or ``dtype``) route (``optimize(..., backend=[engines])``), or None when it
    fails. bf16: OpenVINO only (ONNX Runtime has no bf16 kernels here; the torch route is built as
    optimize's baseline). optimize()'s own steps follow as ``xlaunch.optimize:`` lines."""
    from xlaunch.kernels.optimize.pipeline import optimize

    name = policy.BF16_OPTIMIZE if dtype is not None else policy.FP32_OPTIMIZE
    backends = FP32_BACKENDS if dtype is None else BF16_BACKENDS
    if show is not None:
        show.line(f"{name}: the float variant INT8 must beat, optimize(backend={backends}) ...")

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimized = optimize(copy.deepcopy(fp32), dtype=dtype, sample_input=example, backend=backends,
                                 time_budget=FP32_TIME_BUDGET_S, progress=show is not None and show.enabled)
        report.warnings.extend(f"optimize(): {w.message}" for w in caught
                               if type(w.message).__name__ == "OptimizeWarning")
        engines = getattr(optimized, "_xlaunch_engine_report", None)
        if engines is not None:
            report.warnings.append(f"optimize(): the {'bf16' if dtype is not None else 'fp32'} route is "
                                   f"{engines.backend} ({engines.reason})")
        return optimized
    except Exception as exc:
        report.routes[name] = RouteResult(skipped=f"failed: {_failure(exc)}")
        return None


def _finish(report: QuantizeReport, route: str, build: routes.Built, fp32: nn.Module, example: tuple,
            unsupported: dict[str, str], why: str) -> QuantizedModule:
    report.mode, report.reason = route, why
    report.quantized = list(build.quantized)
    report.kept_fp32 = {**build.kept_fp32, **{k: v for k, v in unsupported.items()   # a route may convert them
                                              if k not in build.kept_fp32 and k not in build.quantized}}
    result = report.routes[route]
    report.rel_error, report.argmax_agreement = result.rel_error, result.argmax_agreement
    if report.kept_fp32:
        _warn(report, f"{route}: {len(report.kept_fp32)} layer(s) stay fp32: "
                      + "; ".join(f"{k}: {v}" for k, v in list(report.kept_fp32.items())[:4])
                      + (" ..." if len(report.kept_fp32) > 4 else ""))
    source = build.program_source
    return QuantizedModule(build.runner, lambda: routes.export(source, example), route, report, keep=source)
