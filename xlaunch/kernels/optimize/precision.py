"""Precision: is bf16/fp16 worth it on this CPU, and low-precision weights.

bf16 is used only where the CPU computes it natively (AVX512_BF16 or AMX_BF16), fp16 only with
AVX512_FP16 or AMX_FP16 (:mod:`xlaunch.kernels.native_dtypes`, shared with the fused optimizers);
elsewhere oneDNN emulates them and they run slower than fp32, so the request falls back to fp32
with a warning unless ``force_bf16=True`` (which forces either low-precision dtype).

Decision for inference (see docs/kernels.md): convolution/linear weights are stored in the low
dtype once, and the model's ``forward`` runs under ``torch.autocast("cpu", dtype)`` (installed by
:mod:`xlaunch.kernels.optimize.dispatch`), so callers change nothing, and ``state_dict()`` gives the
cast weights back in their original dtype (as ipex does), so a checkpoint taken from the optimized
model loads anywhere.

Output dtype (:func:`output_dtype`): what eager gives under the same context.
  * Called under the caller's own CPU autocast: the outputs autocast gives, untouched (bf16 after a
    conv or linear), as the original model under that autocast, and as ipex (whose bf16 models are
    meant to be called under ``torch.autocast``).
  * Otherwise floating outputs come back in the dtype of the floating inputs: fp32 in, fp32 out, as
    the original model (ipex's bf16 model needs the caller's autocast there; here it runs its own);
    bf16 in, bf16 out, as the model cast to bf16 (``model.bfloat16()``) would; no floating input:
    fp32, the original model's.
``level="O0"`` with a low dtype casts the weights and runs under autocast too (ipex's O0 casts the
parameters when given a dtype); it does nothing else (in bf16 training: split-bf16 parameters,
:mod:`xlaunch.kernels.optimize.pipeline`).
"""
from __future__ import annotations

from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optim import dtypewatch
from xlaunch.kernels.native_dtypes import (  # noqa: F401 - names this module has always had
    BF16_FLAGS,
    FP16_FLAGS,
    bf16_unsupported_reason,
    flags_from_cpuinfo,
    fp16_unsupported_reason,
    isa_flags,
)

LOW_DTYPES = (torch.bfloat16, torch.float16)
CASTABLE = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)


def resolve_dtype(dtype: Optional[torch.dtype], force_bf16: bool,
                  flags: Optional[frozenset[str]] = None) -> tuple[torch.dtype, Optional[str]]:
    """(the dtype to use, a warning or None). float32, bfloat16 and float16 are accepted."""
    if dtype is None or dtype == torch.float32:
        return torch.float32, None
    if dtype not in LOW_DTYPES:
        raise ValueError(f"optimize: dtype must be torch.float32, torch.bfloat16 or torch.float16, not {dtype}")
    flags = isa_flags() if flags is None else flags
    reason = bf16_unsupported_reason(flags) if dtype == torch.bfloat16 else fp16_unsupported_reason(flags)
    if reason is None or force_bf16:
        return dtype, None
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return torch.float32, f"{name} not used: {reason}; kept float32 (pass force_bf16=True to override)"


def cast_weights(model: nn.Module, dtype: torch.dtype) -> tuple[int, dict[str, torch.dtype], list[str]]:
    """Store conv/linear weights and biases in ``dtype`` (``.data``, parameters keep identity).

    Returns (modules cast, {parameter name: original dtype}, warnings). Only float32/bf16/fp16
    parameters are cast; others (float64, ...) are left and named in a warning (as ipex does).
    Linear layers inside ``nn.MultiheadAttention`` stay as they are: its fused paths read
    ``out_proj.weight`` beside the fp32 ``in_proj_weight`` and require one dtype."""
    count = 0
    original: dict[str, torch.dtype] = {}
    problems: list[str] = []
    aliases: dict[int, list[str]] = {}   # a tied parameter has several names: each is a state_dict key
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    names = {key: found[0] for key, found in aliases.items()}
    seen: set[int] = set()
    for attention in model.modules():  # MHA reads its projections' tensors directly, not via autocast
        if isinstance(attention, nn.MultiheadAttention):
            seen.update(id(m) for m in attention.modules())
    for module in model.modules():
        if not isinstance(module, WEIGHT_TYPES) or id(module) in seen:
            continue
        seen.add(id(module))
        params = [p for p in (module.weight, module.bias) if p is not None]
        bad = sorted({str(p.dtype) for p in params if p.dtype not in CASTABLE})
        if bad:
            problems.append(f"can't convert the parameters of {type(module).__name__} "
                            f"{names.get(id(module.weight), '?').rpartition('.')[0] or '(root)'} from {', '.join(bad)} to {dtype}; "
                            "left as they are")
            continue
        for param in params:
            if param.dtype != dtype:
                for name in aliases.get(id(param), [""]):
                    original.setdefault(name, param.dtype)
                param.data = param.data.to(dtype)
        count += 1
    dtypewatch.bump()   # ``.data`` cast: a forward following the weights' dtype looks again
    return count, original, problems


class StateDictInOriginalDtype:
    """``state_dict`` hook: parameters cast by :func:`cast_weights` are saved in their original dtype."""

    def __init__(self, original: dict[str, torch.dtype]) -> None:
        self.original = dict(original)

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name, dtype in self.original.items():
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                state_dict[key] = value.detach().to(dtype)


def output_dtype(args: tuple, kwargs: Optional[dict] = None) -> Optional[torch.dtype]:
    """The dtype a low-precision model's floating outputs come back in, for this call (see the
    module docstring): None (untouched) under the caller's CPU autocast, else the first floating
    input's dtype when it is fp32/bf16/fp16, else float32."""
    if torch.is_autocast_enabled("cpu"):
        return None
    values = list(args) + list((kwargs or {}).values())
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype if value.dtype in CASTABLE else torch.float32
    return torch.float32


def outputs_as(value: Any, dtype: torch.dtype) -> Any:
    """Floating fp32/bf16/fp16 tensors in ``value`` (tuples, lists, dicts) converted to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype in CASTABLE and value.dtype != dtype else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(outputs_as(v, dtype) for v in value)
    if isinstance(value, list):
        return [outputs_as(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: outputs_as(v, dtype) for k, v in value.items()}
    return value
