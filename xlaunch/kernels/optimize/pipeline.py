"""``optimize``: IPEX-style model rewrites on stock PyTorch, returning the user's own module.

    model = optimize(model)                                   # eval model, O1
    model = optimize(model, dtype=torch.bfloat16, sample_input=x)
    model, optimizer = optimize(model, optimizer)             # training: fused optimizer
    model, optimizer = optimize(model, torch.bfloat16, optimizer)   # ipex's positional order

The result is the given module rewritten (``inplace=True``) or a rewritten deep copy (default):
same class, attributes, ``training`` flag; ``state_dict``/``load_state_dict`` keep working (a
checkpoint of the un-optimized model loads into a folded one, see :mod:`fold`). Levels set
defaults, explicit flags beat the level: ``O0`` does nothing (but cast the weights to a
bf16/fp16 ``dtype`` and run under autocast, when given one, as ipex's O0 casts; training in bf16
with an optimizer: split-bf16 parameters, which takes the fused optimizer, as ipex's O0 makes the
parameters bf16 with fp32 masters), ``O1`` does every rewrite that
keeps results (within float tolerance). The steps, in order:

  1. eval only: ``conv_bn_folding``, ``linear_bn_folding`` (where a ``sample_input`` or the graph
     shows the BN sees ``(N, C)``, :mod:`ranks`), ``remove_dropout``
  2. ``channels_last`` for models holding 2-D/3-D convolutions
  3. ``dtype=torch.bfloat16``/``torch.float16`` (only where the CPU has native support, else fp32
     and a warning; ``force_bf16=True`` overrides): ``bf16_weights`` and ``autocast`` forward (eval);
     for training the optimizer conversion owns the parameters' dtype
  4. eval only: ``weights_prepack`` = graph freezing (conv weights, fp32 and bf16, and bf16 linear
     weights laid out once for oneDNN: :func:`freeze.prepacked_copy`) with ``freeze_backend`` ("jit", the default, or
     "inductor"), held *behind* the module (:mod:`dispatch`): no-grad calls go to a graph frozen
     for their exact input signature. On by default in O1 when ``sample_input`` is given (frozen
     now for that input; other inputs on their first call); ``weights_prepack=True`` without a
     sample freezes on the first no-grad call of each signature.
  5. with an optimizer: ``fused_optimizer`` -> ``xlaunch.kernels.optim.fused.to_fused``; with bf16 the
     trained parameters become split-bf16 unless ``split_master_weights=False`` (then they stay
     fp32 and the forward runs under autocast)

Never slower (``measure``, on by default): with a ``sample_input`` (fp32, eval), the model as
given, the eager rewrite and the frozen graph are timed interleaved on it; the fastest is kept,
preferring the more optimized one within a 2% noise margin, and the report says what was kept.

ipex.optimize's spellings are accepted (``replace_dropout_with_identity``, ``fuse_update_step``,
``split_master_weight_for_bf16``); its knobs without a stock-torch counterpart (``optimize_lstm``,
``auto_kernel_selection``, ``graph_mode``, ``concat_linear``, ``deployment_mode``) are accepted and
warn that they do nothing.

With ``verify`` (default) and a ``sample_input``, each step's output is compared with the model
before it; a step that changes results beyond tolerance is undone with a warning.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from xlaunch._errors import flag
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.build_mark import marked
from xlaunch.kernels.optimize import dispatch, fold, freeze, keep, layout, precision

from xlaunch.kernels.native_dtypes import EmulatedPrecisionWarning
from xlaunch.kernels.optimize.compare import BF16_RTOL, FP32_RTOL, outputs_close
from xlaunch.kernels.optimize.notes import OptimizeWarning, SampleInputError, info, logger, warn
from xlaunch.kernels.optimize.notes import record_warning as _warn
from xlaunch.kernels.optimize.progress import Progress

__all__ = ["optimize", "Options", "Report", "OptimizeWarning", "outputs_close"]

LEVELS = ("O0", "O1")
# Measured with bench/optimize.py (2 threads, jemalloc, torch 2.13): on the examples CNN, jit
# freezing 1.58x plain fp32 vs inductor's 1.38x, and it compiles in under a second vs 10-30 s.
DEFAULT_FREEZE_BACKEND = "jit"
# The steps say what they do (``xlaunch.optimize: freezing ...`` on stderr) once a call has run this
# long: a small model's call stays silent, a large one's first line comes within a second.
QUIET_S = 0.5


@dataclass(frozen=True)
class Options:
    """The resolved knobs (level defaults overridden by explicit flags)."""

    conv_bn_folding: bool = False
    linear_bn_folding: bool = False
    remove_dropout: bool = False
    channels_last: bool = False
    bf16_weights: bool = False
    autocast: bool = False
    weights_prepack: bool = False
    freeze_backend: str = DEFAULT_FREEZE_BACKEND
    fused_optimizer: bool = False
    split_master_weights: bool = True
    force_bf16: bool = False
    verify: bool = True
    measure: bool = True


FLAG_NAMES = tuple(f.name for f in dataclasses.fields(Options))
# ipex.optimize's spellings, so ported calls keep working.
IPEX_ALIASES = {
    "replace_dropout_with_identity": "remove_dropout",
    "fuse_update_step": "fused_optimizer",
    "split_master_weight_for_bf16": "split_master_weights",
}
# ipex.optimize knobs with no counterpart on stock torch: accepted, and said to do nothing.
IPEX_NO_EFFECT = ("optimize_lstm", "auto_kernel_selection", "graph_mode", "concat_linear", "deployment_mode")


def resolve_options(level: str, flags: dict[str, Any], has_sample_input: bool,
                    low_dtype: bool = False, bf16_training: bool = False) -> Options:
    """Level defaults, then every flag the caller gave explicitly (a None flag means "level").
    ``O0`` with a low dtype (``low_dtype``) still casts the weights and runs under autocast, as
    ipex's O0 casts the parameters when given a dtype; training in bf16 with an optimizer
    (``bf16_training``) makes the trained parameters bf16 with fp32 masters, as ipex's O0 does
    (split-bf16, which takes the fused optimizer)."""
    if level not in LEVELS:
        raise ValueError(f"optimize: level must be one of {', '.join(LEVELS)}, not {level!r}")
    flags = {IPEX_ALIASES.get(name, name): value for name, value in flags.items()
             if name not in IPEX_NO_EFFECT}
    unknown = sorted(set(flags) - set(FLAG_NAMES))
    if unknown:
        raise TypeError(f"optimize: unknown flag(s) {', '.join(unknown)}; known: {', '.join(FLAG_NAMES)}")
    if level == "O0":
        base = Options(measure=False, bf16_weights=low_dtype, autocast=low_dtype, fused_optimizer=bf16_training)
    else:
        base = Options(
            conv_bn_folding=True, linear_bn_folding=True, remove_dropout=True, channels_last=True,
            bf16_weights=True, autocast=True, weights_prepack=has_sample_input, fused_optimizer=True,
        )
    explicit = {name: value if name == "freeze_backend" else flag(value, f"optimize: {name}")
                for name, value in flags.items() if value is not None}
    return dataclasses.replace(base, **explicit)


@dataclass
class Report:
    """What ``optimize`` did; attached to the returned model as ``_xlaunch_optimize_report``."""

    options: Options
    dtype: torch.dtype = torch.float32
    folded: list[str] = dataclasses.field(default_factory=list)
    dropouts_removed: list[str] = dataclasses.field(default_factory=list)
    channels_last_convs: int = 0
    bf16_modules: int = 0
    autocast: bool = False
    frozen_with: Optional[str] = None
    kept: Optional[str] = None          # "frozen" | "eager" | "given": what the measurement kept
    timings_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    optimizer: Optional[str] = None
    warnings: list[str] = dataclasses.field(default_factory=list)


def _run(model: nn.Module, sample_input: Any, call: Optional[Any] = None) -> Any:
    """``model`` (or ``call``) on a copy of the sample, its buffers restored (:class:`freeze.BufferState`)."""
    state = freeze.BufferState(model)
    try:
        with torch.no_grad():
            return (call or model)(*freeze.fresh(freeze.as_args(sample_input)))
    finally:
        state.restore(model)


def _copy_with_optimizer(model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
    """Deep copies whose optimizer refers to the copied model's parameters (one copy of the two:
    the split-bf16 low halves the model's checkpoint hooks keep are the copied optimizer's)."""
    if optimizer is None:
        return copy.deepcopy(model), None
    if any("initial_lr" in group for group in getattr(optimizer, "param_groups", ())):
        warn("the optimizer already has an LR scheduler (its param groups hold 'initial_lr'): optimize returns "
             "a copy of it, which that scheduler does not drive (the learning rate would stay constant); make the "
             "scheduler on the optimizer optimize returns, or pass inplace=True")
    return copy.deepcopy((model, optimizer))


def _ipex_argument_order(optimizer: Any, dtype: Any) -> tuple[Any, Any]:
    """ipex's order is ``optimize(model, dtype, optimizer)``; ours ``optimize(model, optimizer,
    dtype)``. A dtype in the optimizer position (and an optimizer in the dtype one) is moved."""
    if isinstance(optimizer, torch.dtype) or isinstance(dtype, torch.optim.Optimizer):
        if isinstance(dtype, torch.dtype):
            raise TypeError("optimize: two dtypes given (optimizer and dtype)")
        optimizer, dtype = dtype, optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimize: optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"optimize: dtype must be a torch.dtype, not {type(dtype).__name__}")
    return optimizer, dtype


def _eval_rewrites(model: nn.Module, opts: Options, sample_input: Any, reference: Any,
                   report: Report) -> fold.FoldLog:
    kinds = {kind for kind, on in (("conv", opts.conv_bn_folding), ("linear", opts.linear_bn_folding)) if on}
    log = fold.FoldLog()
    if kinds and any(fold.is_norm(m) for m in model.modules()):
        state = freeze.BufferState(model)   # the shapes are read by running the sample
        pairs, notes = fold.find_pairs(model, freeze.fresh_input(sample_input))
        state.restore(model)
        for note in notes:
            _warn(report, note)
        fold.fold_pairs(model, pairs, log, kinds)
    if opts.remove_dropout:
        fold.remove_dropout(model, log)
    for what, why in log.skipped:
        _warn(report, f"{what} not folded: {why}")
    if reference is not None and opts.verify and (log.folded or log.dropouts_removed):
        problem = outputs_close(reference, _run(model, sample_input), FP32_RTOL)
        if problem:
            fold.undo(model, log)
            _warn(report, f"folding undone, results changed: {problem}")
    report.folded = [f"{p.producer}+{p.norm}" for p in log.folded]
    report.dropouts_removed = list(log.dropouts_removed)
    return log


def _convert_optimizer(optimizer: Any, model: nn.Module, dtype: torch.dtype, report: Report) -> Any:
    try:
        from xlaunch.kernels.optim.fused import to_fused
    except ImportError as exc:
        _warn(report, f"optimizer kept as given: the fused optimizers are unavailable ({exc})")
        return optimizer
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused = to_fused(optimizer, model, dtype=dtype)
    except Exception as exc:
        _warn(report, f"optimizer kept as given: {type(exc).__name__}: {exc}")
        return optimizer
    for caught_warning in caught:   # in the report too; not: force_bf16 asked for bf16 knowing it is emulated
        if not issubclass(caught_warning.category, EmulatedPrecisionWarning):
            _warn(report, str(caught_warning.message).removeprefix("xlaunch.kernels: "))
    report.optimizer = type(fused).__name__
    return fused


@marked("optimize")
def optimize(model: nn.Module, optimizer: Any = None, dtype: Any = None,
             level: str = "O1", inplace: bool = False, *, sample_input: Any = None,
             backend: Any = "torch", time_budget: Optional[float] = None, cache: bool = True,
             progress: bool = True, **flags: Any) -> Any:
    """Rewrite ``model`` for fast CPU execution; see the module docstring for every flag.

    Returns the model, or ``(model, optimizer)`` when an optimizer is given. The model's
    ``_xlaunch_optimize_report`` (a :class:`Report`) lists what was done and why anything was not.
    ``backend`` other than "torch" ("auto", "onnxruntime", "openvino", "inductor", "eager" or a
    list) measures engines and keeps the fastest: :mod:`xlaunch.kernels.optimize.engines.api`
    (``time_budget`` and ``cache`` belong to it). ``progress``: the steps of a call that runs
    longer than :data:`QUIET_S` say what they do on stderr (:class:`.progress.Progress`).
    """
    inplace = flag(inplace, "optimize: inplace")   # a string ("False") would rewrite the given model
    if not (isinstance(backend, str) and backend == "torch"):
        from xlaunch.kernels.optimize.engines.api import optimize_with_engines

        return optimize_with_engines(optimize, model, optimizer, dtype, level, inplace, sample_input=sample_input,
                                     backend=backend, time_budget=time_budget, cache=cache, progress=progress,
                                     flags=flags)
    optimizer, dtype = _ipex_argument_order(optimizer, dtype)
    if isinstance(model, torch.jit.ScriptModule):
        warn("the model is already a TorchScript module; returned as given")
        return model if optimizer is None else (model, optimizer)
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not model.training:
        raise ValueError("optimize: an optimizer was given but the model is in eval mode; call "
                         "model.train() to optimize for training, or pass no optimizer for inference")
    force = flags.get("force_bf16")
    use_dtype, dtype_warning = precision.resolve_dtype(dtype, bool(force))
    opts = resolve_options(level, flags, sample_input is not None, use_dtype in precision.LOW_DTYPES,
                           use_dtype == torch.bfloat16 and optimizer is not None and model.training)
    report = Report(options=opts)
    for name in sorted(set(flags) & set(IPEX_NO_EFFECT)):
        if flags[name]:
            _warn(report, f"{name} is an ipex.optimize knob with no stock-torch counterpart; it has no effect")
    report.dtype = use_dtype
    if dtype_warning:
        _warn(report, dtype_warning)
    training = model.training
    verify = opts.verify and sample_input is not None
    measure_now = (opts.measure and not training and sample_input is not None
                   and use_dtype == torch.float32 and (opts.weights_prepack or level != "O0"))
    given = model
    state = freeze.BufferState(model) if sample_input is not None else None
    show = Progress(total=0, enabled=progress, quiet_s=QUIET_S)
    try:
        if not inplace or measure_now:
            with show.step("copying the model") as step:
                if not inplace:
                    model, optimizer = _copy_with_optimizer(model, optimizer)
                else:
                    given = copy.deepcopy(model)   # the model as it was, to time against
                step.done("done")
        result = _rewrite(model, optimizer, given, opts, report, use_dtype, level, sample_input, verify,
                          measure_now, show)
    finally:
        show.close()
        for module in (model, given) if state is not None else ():   # the sample's runs leave no trace in
            dispatch.restore(module, state)                             # buffers a forward updates (counters)
    return result


def _rewrite(model: nn.Module, optimizer: Any, given: nn.Module, opts: Options, report: Report, use_dtype: Any,
             level: str, sample_input: Any, verify: bool, measure_now: bool, show: Progress) -> Any:
    """The steps of :func:`optimize` (the module docstring's list) on the copy it made."""
    training = model.training
    reference = None
    if sample_input is not None and not training:
        with show.step("running the sample input (the reference)") as step:
            try:
                reference = _run(model, sample_input)
            except Exception as exc:   # the caller's sample, not a step of ours
                raise SampleInputError(exc) from exc
            step.done("done")

    log = fold.FoldLog()
    if not training:
        with show.step("folding batch norms, removing dropout") as step:
            log = _eval_rewrites(model, opts, sample_input, reference, report)
            if verify:  # later steps are checked against the folded eager model
                reference = _run(model, sample_input)
            step.done(f"{len(report.folded)} folded, {len(report.dropouts_removed)} dropout(s) removed")
    elif opts.conv_bn_folding or opts.linear_bn_folding or opts.remove_dropout:
        report.warnings.append("model in training mode: folding and dropout removal skipped")

    if opts.channels_last and layout.has_conv(model):
        with show.step("converting convolutions to channels-last") as step:
            report.channels_last_convs = layout.to_channels_last(model)
            if optimizer is not None:
                layout.match_optimizer_state(optimizer)
            if verify and reference is not None:
                problem = outputs_close(reference, _run(model, sample_input), FP32_RTOL)
                if problem:  # a layout never changes values; report loudly if it somehow does
                    _warn(report, f"channels_last changed results ({problem})")
            step.done(f"{report.channels_last_convs} converted")

    low = use_dtype if use_dtype in precision.LOW_DTYPES else None
    autocast_dtype = None
    if low is not None and not training:
        if opts.bf16_weights:
            count, original, problems = precision.cast_weights(model, low)
            report.bf16_modules = count
            for problem in problems:
                _warn(report, problem)
            if original:
                model._register_state_dict_hook(precision.StateDictInOriginalDtype(original))
        if opts.autocast:
            autocast_dtype = low
        elif opts.bf16_weights:
            _warn(report, f"{low} weights without autocast: run the model under "
                          f"torch.autocast('cpu', dtype={low})")
    elif low is not None and training and opts.autocast:
        # parameters become split-bf16 in the optimizer conversion; the forward needs autocast
        autocast_dtype = low
        if optimizer is None:
            report.warnings.append("training without an optimizer: weights stay fp32, forward under autocast")

    freezing = opts.weights_prepack and not training
    if opts.weights_prepack and training:
        report.warnings.append("model in training mode: weights_prepack (freezing) skipped")
    if freezing and opts.freeze_backend not in freeze.BACKENDS:
        raise ValueError(f"optimize: freeze_backend must be one of {', '.join(freeze.BACKENDS)}, "
                         f"not {opts.freeze_backend!r}")
    earlier = dispatch.of(model)
    if autocast_dtype is None and earlier is not None and earlier.low_weights is not None and earlier.runs_autocast():
        autocast_dtype = earlier.autocast_dtype   # the new forward replaces it: its weights still need that autocast
        report.warnings.append(f"the weights are {autocast_dtype} (optimized before with that dtype): the forward "
                               f"stays under {autocast_dtype} autocast (model.float() first for an fp32 model)")
    forward = None
    if autocast_dtype is not None or freezing:
        report.autocast = autocast_dtype is not None
        forward = dispatch.install(model, autocast_dtype=autocast_dtype,
                                   freeze_backend=opts.freeze_backend if freezing else None,
                                   verify=opts.verify, measure=opts.measure and not measure_now,
                                   notify=_notifier(report))
        if verify and report.autocast and reference is not None:
            with show.step(f"checking the {low} forward against fp32") as step, torch.no_grad():
                problem = outputs_close(reference, _run(model, sample_input, forward.eager), BF16_RTOL)
                step.done("differs" if problem else "close")
            if problem:
                _warn(report, f"{low} results differ more than expected from fp32: {problem}")

    if forward is not None and freezing and sample_input is not None:
        with show.step(f"freezing a graph for the sample input ({opts.freeze_backend})") as step:
            keep.freeze_for_sample(model, forward, sample_input, report)
            step.done(f"frozen with {report.frozen_with}" if report.frozen_with else "not frozen")
    if measure_now:
        with show.step("timing the model as given, the eager rewrite and the frozen graph") as step:
            keep.keep_the_fastest(given, model, forward, log, sample_input, report)
            step.done(f"{report.kept} chosen")

    if log.records:
        model.register_load_state_dict_pre_hook(fold.FoldedCheckpointLoader(log.records))
    fold.warn_on_train(model, len(report.folded), len(report.dropouts_removed))
    if optimizer is not None and opts.fused_optimizer:
        split = use_dtype if (opts.split_master_weights and use_dtype == torch.bfloat16) else torch.float32
        with show.step("converting the optimizer") as step:
            optimizer = _convert_optimizer(optimizer, model, split, report)   # split-bf16: its checkpoint hooks too
            step.done(report.optimizer or "kept as given")
    if forward is not None and forward.autocast_dtype in {p.dtype for p in model.parameters()}:
        forward.follow_weights()   # its weights made bf16/fp16: model.float() is an fp32 model again
    model._xlaunch_optimize_report = report
    logger.debug("xlaunch.optimize: %s", report)
    return model if optimizer is None else (model, optimizer)


def _notifier(report: Report) -> dispatch.Notify:
    def notify(message: str, is_warning: bool) -> None:
        if message.startswith("frozen with "):
            report.frozen_with = message.split()[2]
        if is_warning:
            _warn(report, message)
        else:
            info(message)
    return notify
