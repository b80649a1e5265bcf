"""``optimize``: IPEX-style model rewrites on stock PyTorch.

    model = optimize(model)                                   # eval model, O1
    model = optimize(model, dtype=torch.bfloat16, sample_input=x)
    model, optimizer = optimize(model, optimizer)             # training: fused optimizer

Levels set defaults, explicit flags beat the level: ``O0`` does nothing, ``O1`` does every rewrite
that keeps results (within float tolerance). The steps, in order:

  1. eval only: ``conv_bn_folding``, ``linear_bn_folding`` (needs ``sample_input``), ``remove_dropout``
  2. ``channels_last`` for models holding 2-D/3-D convolutions
  3. ``dtype=torch.bfloat16`` (only where the CPU has AVX512_BF16/AMX_BF16, else fp32 and a
     warning; ``force_bf16=True`` overrides): ``bf16_weights`` and ``autocast`` forward (eval);
     for training the optimizer conversion owns the parameters' dtype
  4. eval only: ``weights_prepack`` = graph freezing with ``freeze_backend`` ("jit", the default, or
     "inductor");
     on by default in O1 when ``sample_input`` is given (compiled now), explicit
     ``weights_prepack=True`` without a sample compiles on the first call (inductor)
  5. with an optimizer: ``fused_optimizer`` -> ``xlaunch.kernels.optim.to_fused``; with bf16 the
     trained parameters become split-bf16 unless ``split_master_weights=False`` (then they stay
     fp32 and the forward runs under autocast)

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
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from xlaunch.kernels import fold, freeze, layout, precision

LEVELS = ("O0", "O1")
# Measured with bench/optimize.py (2 threads, jemalloc, torch 2.13): on the examples CNN, jit
# freezing 1.58x plain fp32 vs inductor's 1.38x, and it compiles in under a second vs 10-30 s.
DEFAULT_FREEZE_BACKEND = "jit"


class OptimizeWarning(UserWarning):
    """Something asked for was not done (or was undone); the message says why."""


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


FLAG_NAMES = tuple(f.name for f in dataclasses.fields(Options))
# ipex.optimize's spellings, so ported calls keep working.
IPEX_ALIASES = {
    "replace_dropout_with_identity": "remove_dropout",
    "fuse_update_step": "fused_optimizer",
    "split_master_weight_for_bf16": "split_master_weights",
}
# ipex.optimize knobs with no counterpart on stock torch: accepted, and said to do nothing.
IPEX_NO_EFFECT = ("optimize_lstm", "auto_kernel_selection", "graph_mode", "concat_linear", "deployment_mode")


def resolve_options(level: str, flags: dict[str, Any], has_sample_input: bool) -> Options:
    """Level defaults, then every flag the caller gave explicitly (a None flag means "level")."""
    if level not in LEVELS:
        raise ValueError(f"optimize: level must be one of {', '.join(LEVELS)}, not {level!r}")
    flags = {IPEX_ALIASES.get(name, name): value for name, value in flags.items()
             if name not in IPEX_NO_EFFECT}
    unknown = sorted(set(flags) - set(FLAG_NAMES))
    if unknown:
        raise TypeError(f"optimize: unknown flag(s) {', '.join(unknown)}; known: {', '.join(FLAG_NAMES)}")
    if level == "O0":
        base = Options()
    else:
        base = Options(
            conv_bn_folding=True, linear_bn_folding=True, remove_dropout=True, channels_last=True,
            bf16_weights=True, autocast=True, weights_prepack=has_sample_input, fused_optimizer=True,
        )
    explicit = {name: value for name, value in flags.items() if value is not None}
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
    optimizer: Optional[str] = None
    warnings: list[str] = dataclasses.field(default_factory=list)


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside xlaunch.kernels (so warnings point at the user)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("xlaunch.kernels"):
        frame, level = frame.f_back, level + 1
    return level


def _warn(report: Report, message: str) -> None:
    report.warnings.append(message)
    warnings.warn(f"xlaunch.optimize: {message}", OptimizeWarning, stacklevel=_caller_stacklevel())


def _run(model: nn.Module, sample_input: Any) -> Any:
    with torch.no_grad():
        return model(*freeze.as_args(sample_input))


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def outputs_close(reference: Any, candidate: Any, rtol: float) -> Optional[str]:
    """None when every output tensor matches within ``rtol`` of the reference's largest magnitude."""
    refs, cands = _flat_tensors(reference), _flat_tensors(candidate)
    if len(refs) != len(cands):
        return f"{len(cands)} output tensors instead of {len(refs)}"
    for ref, cand in zip(refs, cands):
        if ref.shape != cand.shape:
            return f"output shape {tuple(cand.shape)} instead of {tuple(ref.shape)}"
        if not ref.is_floating_point():
            if not torch.equal(ref, cand):
                return "integer outputs differ"
            continue
        ref32, cand32 = ref.detach().float(), cand.detach().float()
        scale = ref32.abs().max().item() if ref32.numel() else 0.0
        error = (ref32 - cand32).abs().max().item() if ref32.numel() else 0.0
        if not error <= rtol * max(scale, 1e-6):  # also catches NaN
            return f"max abs error {error:.3g} exceeds {rtol:g} x max |output| {scale:.3g}"
    return None


FP32_RTOL = 1e-3
BF16_RTOL = 6e-2


def _copy_with_optimizer(model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
    """Deep copies whose optimizer refers to the copied model's parameters."""
    new_model = copy.deepcopy(model)
    if optimizer is None:
        return new_model, None
    memo = {id(old): new for old, new in zip(model.parameters(), new_model.parameters())}
    return new_model, copy.deepcopy(optimizer, memo)


def _eval_rewrites(model: nn.Module, opts: Options, sample_input: Any, reference: Any,
                   report: Report) -> None:
    kinds = {kind for kind, on in (("conv", opts.conv_bn_folding), ("linear", opts.linear_bn_folding)) if on}
    log = fold.FoldLog()
    if kinds and any(isinstance(m, fold.BN_TYPES) for m in model.modules()):
        pairs, notes = fold.find_pairs(model, sample_input)
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


def _convert_optimizer(optimizer: Any, model: nn.Module, dtype: torch.dtype, report: Report) -> Any:
    try:
        from xlaunch.kernels.optim import to_fused
    except ImportError as exc:
        _warn(report, f"optimizer kept as given: the fused optimizers are unavailable ({exc})")
        return optimizer
    try:
        fused = to_fused(optimizer, model, dtype=dtype)
    except Exception as exc:
        _warn(report, f"optimizer kept as given: {type(exc).__name__}: {exc}")
        return optimizer
    report.optimizer = type(fused).__name__
    return fused


def optimize(model: nn.Module, optimizer: Any = None, dtype: Optional[torch.dtype] = None,
             level: str = "O1", inplace: bool = False, *, sample_input: Any = None,
             **flags: Any) -> Any:
    """Rewrite ``model`` for fast CPU execution; see the module docstring for every flag.

    Returns the model, or ``(model, optimizer)`` when an optimizer is given. The model's
    ``_xlaunch_optimize_report`` (a :class:`Report`) lists what was done and why anything was not.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be a torch.nn.Module, not {type(model).__name__}")
    opts = resolve_options(level, flags, sample_input is not None)
    report = Report(options=opts)
    for name in sorted(set(flags) & set(IPEX_NO_EFFECT)):
        if flags[name]:
            _warn(report, f"{name} is an ipex.optimize knob with no stock-torch counterpart; it has no effect")
    use_dtype, dtype_warning = precision.resolve_dtype(dtype, opts.force_bf16)
    report.dtype = use_dtype
    if dtype_warning:
        _warn(report, dtype_warning)
    if not inplace:
        model, optimizer = _copy_with_optimizer(model, optimizer)
    training = model.training
    verify = opts.verify and sample_input is not None
    reference = _run(model, sample_input) if verify and not training else None

    if not training:
        _eval_rewrites(model, opts, sample_input, reference, report)
        if verify:  # later steps are checked against the folded eager model
            reference = _run(model, sample_input)
    elif opts.conv_bn_folding or opts.linear_bn_folding or opts.remove_dropout:
        report.warnings.append("model in training mode: folding and dropout removal skipped")

    if opts.channels_last and layout.has_conv(model):
        report.channels_last_convs = layout.to_channels_last(model)
        if verify and reference is not None:
            problem = outputs_close(reference, _run(model, sample_input), FP32_RTOL)
            if problem:  # a layout never changes values; report loudly if it somehow does
                _warn(report, f"channels_last changed results ({problem})")

    if use_dtype == torch.bfloat16 and not training:
        if opts.bf16_weights:
            report.bf16_modules = precision.cast_weights(model, torch.bfloat16)
        if opts.autocast:
            precision.wrap_autocast(model, torch.bfloat16, torch.float32)
            report.autocast = True
        elif opts.bf16_weights:
            _warn(report, "bf16 weights without autocast: run the model under "
                          "torch.autocast('cpu', dtype=torch.bfloat16)")
        if verify and reference is not None:
            problem = outputs_close(reference, _run(model, sample_input), BF16_RTOL)
            if problem:
                _warn(report, f"bf16 results differ more than expected from fp32: {problem}")
    elif use_dtype == torch.bfloat16 and training and opts.autocast:
        # parameters become split-bf16 in the optimizer conversion; the forward needs autocast
        precision.wrap_autocast(model, torch.bfloat16, torch.float32)
        report.autocast = True
        if optimizer is None:
            report.warnings.append("training without an optimizer: weights stay fp32, forward under autocast")

    if opts.weights_prepack and not training:
        model = _freeze(model, opts, sample_input, report)
    elif opts.weights_prepack:
        report.warnings.append("model in training mode: weights_prepack (freezing) skipped")

    if optimizer is not None and opts.fused_optimizer:
        split = use_dtype if opts.split_master_weights else torch.float32
        optimizer = _convert_optimizer(optimizer, model, split, report)
    try:
        model._xlaunch_optimize_report = report
    except Exception:  # ScriptModules refuse new attributes
        pass
    return model if optimizer is None else (model, optimizer)


def _freeze(model: nn.Module, opts: Options, sample_input: Any, report: Report) -> nn.Module:
    backend = opts.freeze_backend
    if backend == "jit" and sample_input is None:
        _warn(report, "weights_prepack with freeze_backend='jit' needs a sample_input; not frozen")
        return model
    try:
        frozen = freeze.freeze(model, backend, sample_input)
    except ValueError:
        raise
    except Exception as exc:
        _warn(report, f"not frozen: {backend} failed: {type(exc).__name__}: {str(exc)[:300]}")
        return model
    if sample_input is not None and opts.verify:
        rtol = BF16_RTOL if report.autocast else FP32_RTOL
        problem = outputs_close(_run(model, sample_input), _run(frozen, sample_input), rtol)
        if problem:
            _warn(report, f"not frozen: the {backend} graph changed results ({problem})")
            return model
    report.frozen_with = backend
    return frozen


class _CallableModule(type(copy)):
    """``import xlaunch.kernels.optimize`` binds this module as the package attribute
    ``optimize``, shadowing the function in the lazy table; calling the module calls it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return optimize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
