"""``optimize(model, sample_input=x, backend="auto")``: the fastest way to run this model here,
measured, kept, and built once per machine.

    model = xlaunch.optimize(model.eval(), sample_input=x, backend="auto")
    model(x); print(model.report)          # every route: time, error, build time, or why skipped
    xlaunch.optimize(model, sample_input=x, backend="onnxruntime")     # one route by name
    xlaunch.optimize(model, sample_input=x, backend=["onnxruntime", "openvino"])   # auto among these

Routes: ``eager`` (the model as given), ``torch`` (the default rewrite of :mod:`..pipeline`),
``onnxruntime``, ``openvino``, ``inductor``. ``auto`` builds every route that applies, checks each
against eager, times them round robin within ``time_budget`` seconds and keeps the fastest; an
engine must beat eager/torch by 3 % plus the noise of the rounds (:func:`.policy.choose`).
``dtype=torch.bfloat16`` (or float16) where the CPU computes it natively runs every route in that
precision, checked against fp32 eager with that precision's tolerance (:mod:`.lowp`). Inference
only: training mode, an optimizer, a sample that requires grad or a dtype this CPU does not compute
natively mean the torch route, with a one-line warning.

The chosen route is cached on disk (:mod:`.cache`), so the next process (or the other instances
``xlaunch --ninstances N --auto-optimize`` starts) loads it instead of building and timing again.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from xlaunch._errors import flag, real_number
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.build_mark import marked
from xlaunch.kernels.optimize.engines import auto, cache as disk, forward, lowp, policy, saved
from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.routes.inductor_route import InductorRoute
from xlaunch.kernels.optimize.engines.routes.onnxruntime_route import OnnxRuntimeRoute
from xlaunch.kernels.optimize.engines.routes.openvino_route import OpenVinoRoute
from xlaunch.kernels.optimize.engines.report import BASELINES, EngineReport, RouteResult
from xlaunch.kernels.optimize.engines.sample import Sample, Unsupported, max_relative_error
from xlaunch.kernels.optimize.engines.routes.torch_route import EagerRoute, TorchRoute
from xlaunch.kernels.optimize.notes import warn
from xlaunch.kernels.optimize.progress import Progress
from xlaunch.kernels.optimize.notes import excerpt

DEFAULT_TIME_BUDGET_S = 300.0
# The routes by name (tests put fakes here).
ROUTES_BY_NAME: dict[str, Route] = {route.name: route for route in (
    EagerRoute(), TorchRoute(), OnnxRuntimeRoute(), OpenVinoRoute(), InductorRoute())}
REPORT_ATTRIBUTE = "_xlaunch_engine_report"
CHOICE_ATTRIBUTE = "_xlaunch_engine_choice"   # the route measured for this model (see :func:`rebuild`)
# A choice made under noise (:attr:`.policy.Decision.clear` False) is measured again by the next
# runs that find it in the cache, at most this many times (then it stays, as the last figures say).
MAX_REMEASURES = 3


class Choice(NamedTuple):
    """The route ``auto`` (or a name) kept for a model, what the route needs to be built again
    without measuring (the torch route's own choice), and why it was kept."""

    route: str
    state: dict
    reason: str
    cache: str


def _isa() -> str:
    from xlaunch.kernels.native_dtypes import isa_flags

    # the flags oneDNN may use: under ONEDNN_MAX_CPU_ISA the engines run other kernels, cached apart
    return " ".join(sorted(isa_flags()))


def attach(model: nn.Module, report: EngineReport) -> None:
    """The report as ``model.report`` (unless the model has its own ``report``) and
    ``model._xlaunch_engine_report``."""
    setattr(model, REPORT_ATTRIBUTE, report)
    own = "report" in model.__dict__ or hasattr(type(model), "report") or "report" in model._modules
    if not own or isinstance(model.__dict__.get("report"), EngineReport):
        model.__dict__["report"] = report


def _notify(message: str) -> None:
    warn(message)


def _finish(built: Built, route: str, working: nn.Module, sample: Sample, report: EngineReport,
            reused: Optional["Choice"] = None) -> nn.Module:
    if built.module is not None:
        result = built.module
    else:
        follow = lowp.FollowEagerDtypes(built.runner, functools.partial(type(working).forward, working),
                                        lowp.dtypes_of(sample.outputs))
        follow.eager = forward.install(working, follow, sample, route, _notify).eager
        result = working
    attach(result, report)
    saved.keep(result, saved.Saveable(route, built.files, sample, report.dtype))   # result.save(path)
    result.__dict__[CHOICE_ATTRIBUTE] = reused or Choice(route, dict(built.state), report.reason, report.cache)
    return result


def _run(names: tuple[str, ...], routes: dict[str, Route], working: nn.Module, sample: Sample, context: Context,
         report: EngineReport, budget: float, show: Progress, single: Optional[str],
         incumbent: Optional[str] = None) -> tuple[policy.Decision, dict[str, Built]]:
    decision, built = auto.run(names, routes, working, sample, context, report, budget, show, single, incumbent)
    if single is not None and decision.route != single:   # the route asked for by name could not be used
        warn(f"backend={single}: {report.reason}")
    else:
        show.line(f"kept {decision.route}: {report.reason}")
    return decision, built


def _torch_route(torch_optimize: Callable[..., Any], model: nn.Module, optimizer: Any, dtype: Any, level: str,
                 inplace: bool, sample_input: Any, flags: dict[str, Any], label: str, reason: str,
                 progress: bool = True) -> Any:
    warn(f"backend={label}: the torch route is used: {reason}")
    result = torch_optimize(model, optimizer, dtype, level, inplace, sample_input=sample_input, progress=progress,
                            **flags)
    if isinstance(result, nn.Module):
        attach(result, EngineReport(backend="torch", requested=label, reason=reason))
    return result


def _load_cached(store: disk.Cache, key: str, routes: dict[str, Route], working: nn.Module, sample: Sample,
                 context: Context, label: str, progress: Progress) -> Optional[tuple[Built, str, EngineReport]]:
    """The cached route loaded and checked on the sample, or None (no entry, or a bad one: warned,
    removed, to be rebuilt)."""
    try:
        found = store.read(key)
        if found is None:
            return None
        entry, files = found
        name = entry.get("route")
        if name not in routes:
            raise disk.CorruptEntry(f"unknown route {name!r}")
        stored = entry.get("report")
        if not isinstance(stored, dict) or stored.get("backend") != name or stored.get("dtype") != lowp.name(context.dtype):
            raise disk.CorruptEntry(f"its report does not describe the {name} route in {lowp.name(context.dtype)} it holds")
        with progress.step(f"loading {name} from the cache") as step:
            begin = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = routes[name].load(working, sample, context, files, entry.get("state") or {})
                with torch.no_grad():
                    error = max_relative_error(sample.outputs, built.runner(*sample.args))
            if not error <= policy.max_rel_error(lowp.name(context.dtype)):
                raise disk.CorruptEntry(f"the cached {name} gives wrong results (max relative error {error:.2e})")
            loaded_s = time.perf_counter() - begin
            step.done(f"loaded in {loaded_s:.1f} s", timed=True)
        report = EngineReport.from_dict(entry["report"])
        report.requested, report.cache, report.cache_path = label, "hit", store.path(key)
        report.routes.setdefault(name, RouteResult()).build_s = loaded_s
        return built, name, report
    except Exception as exc:   # anything wrong with an entry: rebuild, never fail the call
        problem = str(exc) if isinstance(exc, disk.CorruptEntry) else f"{type(exc).__name__}: {exc}"
        warn(f"the cache entry {store.path(key)} is corrupt ({excerpt(problem, 300)}); rebuilding it")
        try:
            store.remove(key)
        except OSError:
            pass
        return None


def _engine_dtype(dtype: Any, flags: dict[str, Any], label: str) -> Any:
    """The low precision the routes compute in (None: fp32). A bf16/fp16 ``dtype`` this CPU does
    not compute natively (and no ``force_bf16``) is fp32 ``auto``, every route measured, with one
    warning: emulated, it runs slower than fp32."""
    if dtype in (None, torch.float32):
        return None
    from xlaunch.kernels.optimize.precision import resolve_dtype

    use, why = resolve_dtype(dtype, bool(flags.get("force_bf16")))
    if why:
        warn(f"backend={label}: {why.removesuffix(' (pass force_bf16=True to override)')}: every route runs "
             "in float32 (force_bf16=True overrides)")
    return use if use in lowp.LOW else None


@marked("optimize")
def optimize_with_engines(torch_optimize: Callable[..., Any], model: nn.Module, optimizer: Any = None,
                          dtype: Any = None, level: str = "O1", inplace: bool = False, *, sample_input: Any = None,
                          backend: Union[str, Sequence[str]] = "auto", time_budget: Optional[float] = None,
                          cache: bool = True, progress: bool = True, flags: Optional[dict[str, Any]] = None) -> Any:
    """See the module docstring; ``torch_optimize`` is :func:`..pipeline.optimize` (the torch route)."""
    flags = dict(flags or {})
    label, names = policy.requested_routes(backend)
    single = None if label == "auto" or label.startswith("auto:") else label
    if not isinstance(model, nn.Module) or isinstance(model, torch.jit.ScriptModule):
        return torch_optimize(model, optimizer, dtype, level, inplace, sample_input=sample_input, **flags)
    if time_budget is None or (isinstance(time_budget, float) and time_budget == math.inf):   # inf: no limit
        budget = DEFAULT_TIME_BUDGET_S if time_budget is None else math.inf
    else:
        budget = real_number(time_budget, "optimize: time_budget")
    if not budget > 0:
        raise ValueError(f"optimize: time_budget must be > 0 seconds, not {time_budget!r}")
    cache = flag(cache, "optimize: cache")
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    grad_inputs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if isinstance(optimizer, torch.dtype) and dtype is None:   # ipex's order: optimize(model, dtype)
        optimizer, dtype = None, optimizer
    reason = policy.inference_only_reason(model.training, optimizer is not None, sample_input is not None,
                                          grad_inputs)
    if reason:
        return _torch_route(torch_optimize, model, optimizer, dtype, level, inplace, sample_input, flags, label, reason,
                            progress)
    engine_dtype = _engine_dtype(dtype, flags, label)
    working = copy.deepcopy(model)
    try:
        sample = Sample(working, sample_input)
    except Unsupported as exc:
        return _torch_route(torch_optimize, model, optimizer, engine_dtype, level, inplace, sample_input, flags, label,
                            str(exc), progress)
    routes = dict(ROUTES_BY_NAME)
    context = Context(torch.get_num_threads(), torch_optimize, level, flags, dtype=engine_dtype)
    report = EngineReport(backend="", requested=label, sample=sample.describe(), threads=context.threads,
                          dtype=lowp.name(engine_dtype), max_rel_error=policy.max_rel_error(lowp.name(engine_dtype)))
    show = Progress(total=len(names) + 1, enabled=progress)
    try:
        if not cache:
            decision, built = _run(names, routes, working, sample, context, report, budget, show, single)
            return _finish(built[decision.route], decision.route, working, sample, report)
        return _cached(names, routes, working, sample, context, report, budget, show, single, label, flags)
    finally:
        show.close()


def _cached(names: tuple[str, ...], routes: dict[str, Route], working: nn.Module, sample: Sample, context: Context,
            report: EngineReport, budget: float, show: Progress, single: Optional[str], label: str,
            flags: dict[str, Any]) -> nn.Module:
    """The route from the cache, or built, timed, kept and written to the cache (under its lock)."""
    with contextlib.ExitStack() as stack:
        try:
            key_flags = flags if context.dtype is None else {**flags, "dtype": lowp.name(context.dtype)}
            key, choice_key = disk.model_keys(working, sample.spec, names, context.threads, _isa(), context.level,
                                              key_flags)
            store = disk.Cache(disk.cache_dir())
            stack.enter_context(store.lock(key, on_wait=lambda: show.line(
                "another process is building this model; waiting for it")))
        except Exception as exc:   # no folder, no lock, a bad size cap, a model the key cannot read: no cache
            warn(f"the engine cache is not used ({type(exc).__name__}: {exc}); building without it")
            decision, built = _run(names, routes, working, sample, context, report, budget, show, single)
            return _finish(built[decision.route], decision.route, working, sample, report)
        return _cached_locked(store, (key, choice_key), names, routes, working, sample, context, report, budget, show,
                              single, label)


def _noisy(decision: Any) -> Optional[dict[str, Any]]:
    """A stored decision worth measuring again: not clear (:attr:`.policy.Decision.clear`) and
    measured again fewer than :data:`MAX_REMEASURES` times."""
    if not isinstance(decision, dict) or decision.get("clear", True) is not False:
        return None
    count = decision.get("remeasured", 0)
    return decision if isinstance(count, int) and 0 <= count < MAX_REMEASURES else None


def _cached_locked(store: disk.Cache, keys: tuple[str, str], names: tuple[str, ...], routes: dict[str, Route],
                   working: nn.Module, sample: Sample, context: Context, report: EngineReport, budget: float,
                   show: Progress, single: Optional[str], label: str) -> nn.Module:
    key, choice_key = keys
    noisy = _noisy(store.stored_decision(key)) if single is None else None
    if noisy is None:
        hit = _load_cached(store, key, routes, working, sample, context, label, show)
        if hit is not None:
            built_hit, name, cached_report = hit
            show.line(f"cache hit: {name} ({store.path(key)})")
            return _finish(built_hit, name, working, sample, cached_report)
        stored = store.decision(choice_key) if single is None else None   # the incumbent: kept unless beaten
        incumbent = stored.get("route") if stored and stored.get("clear", True) is not False else None
        remeasured = 0
    else:
        incumbent, remeasured = noisy.get("route"), noisy.get("remeasured", 0) + 1
        show.line(f"the stored choice {incumbent} was made under noise ({noisy.get('noise', 0):.1%}); "
                  f"measuring again ({remeasured} of {MAX_REMEASURES})")
    decision, built = _run(names, routes, working, sample, context, report, budget, show, single, incumbent)
    choice = decision.route
    report.cache, report.cache_path = "miss" if noisy is None else f"measured again ({remeasured} of " \
        f"{MAX_REMEASURES}: the stored choice was noisy)", store.path(key)
    files = built[choice].files if routes[choice].cached_files else {}
    stored_decision = {"route": choice, "reason": report.reason, "incumbent": incumbent,
                       "contender": decision.contender, "noise": decision.noise, "clear": decision.clear,
                       "remeasured": remeasured,
                       "ms": {name: r.ms for name, r in report.routes.items() if r.ms is not None}}
    meta = {"model": type(working).__qualname__, "choice_key": choice_key, "decision": stored_decision}
    try:
        if noisy is not None:
            store.remove(key)   # under the lock: the new figures replace the noisy ones
        store.write(key, choice, built[choice].state, report.to_dict(), files, meta)
    except OSError as exc:   # a full or read-only disk: the model still runs, just not cached
        report.cache = f"not written ({exc.strerror or exc})"
        warn(f"the engine cache entry was not written ({exc})")
    for name in list(built):   # drop the routes not kept (sessions, compiled graphs) now
        if name != choice:
            del built[name]
    return _finish(built[choice], choice, working, sample, report)


def rebuild(torch_optimize: Callable[..., Any], earlier: nn.Module, model: nn.Module, sample_input: Any,
            dtype: Any = None, level: str = "O1", progress: bool = True,
            flags: Optional[dict[str, Any]] = None) -> Optional[nn.Module]:
    """``model``, whose weights changed since ``earlier`` (what ``optimize(..., backend=...)`` returned
    for it) was built, on ``earlier``'s route again, built for its weights now: the choice measured
    then is reused, nothing is timed and no cache entry is written (weights in passing, as in
    training). The report says so. None when ``earlier`` holds no such choice, or the route does not
    build or check with these weights (measure again: :func:`optimize_with_engines`)."""
    choice = earlier.__dict__.get(CHOICE_ATTRIBUTE)
    before = earlier.__dict__.get(REPORT_ATTRIBUTE)
    if not isinstance(choice, Choice) or not isinstance(before, EngineReport) or choice.route not in ROUTES_BY_NAME:
        return None
    flags = dict(flags or {})
    engine_dtype = _engine_dtype(dtype, flags, before.requested)
    working = copy.deepcopy(model)
    try:
        sample = Sample(working, sample_input)
    except Unsupported:
        return None
    name, tolerance = choice.route, policy.max_rel_error(lowp.name(engine_dtype))
    report = EngineReport(backend=name, requested=before.requested, sample=sample.describe(),
                          threads=torch.get_num_threads(), dtype=lowp.name(engine_dtype), max_rel_error=tolerance,
                          cache="rebuilt (weights changed; not written)",
                          reason=f"{name}, the route chosen before the weights changed, built again for them "
                                 f"(not measured again; chosen then: {choice.reason}; cache {choice.cache})")
    context = Context(report.threads, torch_optimize, level, flags, dtype=engine_dtype)
    route = ROUTES_BY_NAME[name]
    show = Progress(total=1, enabled=progress)
    try:
        built = _build_again(route, working, sample, context, report, choice.state, show)
    finally:
        show.close()
    return None if built is None else _finish(built, name, working, sample, report, choice)


def _build_again(route: Route, working: nn.Module, sample: Sample, context: Context, report: EngineReport,
                 state: dict, show: Progress) -> Optional[Built]:
    """:func:`rebuild`'s build and check of ``route``; None (said on the progress line) when it fails."""
    name = route.name
    result, begin = report.routes.setdefault(name, RouteResult()), time.perf_counter()
    with show.step(f"building {name} again for the new weights") as step:
        try:
            if name == "torch":   # with what its own measurement kept (graph or not), untimed
                built = route.load(working, sample, context, {}, state)
            else:
                built = auto.build_route(route, working, sample, context, report)
            result.build_s = time.perf_counter() - begin
            error, unfit = (0.0, None) if name == "eager" else \
                auto.Checker(working, sample, report.max_rel_error).error(built, name not in BASELINES)
        except Exception as exc:
            step.done(f"failed ({type(exc).__name__}: {excerpt(exc)}); measuring every route again")
            return None
        if unfit:
            step.done(f"{unfit}; measuring every route again")
            return None
        result.rel_error = error
        step.done(f"built in {result.build_s:.1f} s (max relative error {error:.1e})", timed=True)
    return built
