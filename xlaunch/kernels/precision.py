"""Precision: is bf16 worth it on this CPU, bf16 weights, and the autocast forward.

bf16 is used only where the CPU computes it natively (AVX512_BF16 or AMX_BF16); elsewhere oneDNN
emulates it and bf16 runs slower than fp32 (measured on an AVX2-only EPYC: a small CNN 60x slower
under autocast), so the request falls back to fp32 with a warning unless ``force_bf16=True``.

Decision for inference (see docs/kernels.md): convolution/linear weights are stored in bf16 once,
and the model's ``forward`` runs under ``torch.autocast("cpu", torch.bfloat16)``, so callers
change nothing; floating outputs come back as float32 like the original model's.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
WEIGHT_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)


@functools.lru_cache(maxsize=1)
def isa_flags() -> frozenset[str]:
    """CPU flags from the machine model (``current_machine().isa``), else from /proc/cpuinfo."""
    try:
        from xlaunch.launcher.machine import current_machine  # type: ignore[attr-defined]

        flags = current_machine().isa.flags
        if flags:
            return frozenset(flags)
    except Exception:
        pass
    return flags_from_cpuinfo(Path("/proc/cpuinfo"))


def flags_from_cpuinfo(path: Path) -> frozenset[str]:
    """The ``flags`` line of the first processor in a cpuinfo file (empty when unreadable)."""
    try:
        with path.open() as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def bf16_unsupported_reason(flags: frozenset[str]) -> Optional[str]:
    """None when bf16 runs natively, else why it should not be used."""
    if any(flag in flags for flag in BF16_FLAGS):
        return None
    if not flags:
        return "the CPU flags could not be read, so native bf16 support is unknown"
    return ("this CPU has neither AVX512_BF16 nor AMX_BF16, so bf16 matmuls/convolutions are emulated "
            "and slower than fp32")


def resolve_dtype(dtype: Optional[torch.dtype], force_bf16: bool,
                  flags: Optional[frozenset[str]] = None) -> tuple[torch.dtype, Optional[str]]:
    """(the dtype to use, a warning or None). Only float32 and bfloat16 are accepted."""
    if dtype is None or dtype == torch.float32:
        return torch.float32, None
    if dtype != torch.bfloat16:
        raise ValueError(f"optimize: dtype must be torch.float32 or torch.bfloat16, not {dtype}")
    reason = bf16_unsupported_reason(isa_flags() if flags is None else flags)
    if reason is None or force_bf16:
        return torch.bfloat16, None
    return torch.float32, f"bf16 not used: {reason}; kept float32 (pass force_bf16=True to override)"


def cast_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Store conv/linear weights and biases in ``dtype`` (``.data``, parameters keep identity).

    Linear layers inside ``nn.MultiheadAttention`` stay as they are: its fused paths read
    ``out_proj.weight`` beside the fp32 ``in_proj_weight`` and require one dtype."""
    count = 0
    seen: set[int] = set()
    for attention in model.modules():  # MHA reads its projections' tensors directly, not via autocast
        if isinstance(attention, nn.MultiheadAttention):
            seen.update(id(m) for m in attention.modules())
    for module in model.modules():
        if not isinstance(module, WEIGHT_TYPES) or id(module) in seen:
            continue
        seen.add(id(module))
        for param in (module.weight, module.bias):
            if param is not None and param.is_floating_point():
                param.data = param.data.to(dtype)
        count += 1
    return count


def _outputs_to(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.bfloat16 else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_outputs_to(v, dtype) for v in value)
    if isinstance(value, list):
        return [_outputs_to(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _outputs_to(v, dtype) for k, v in value.items()}
    return value


class AutocastForward:
    """A ``forward`` replacement: the original under CPU autocast, bf16 outputs back to float32."""

    def __init__(self, forward: Callable[..., Any], dtype: torch.dtype = torch.bfloat16,
                 output_dtype: Optional[torch.dtype] = torch.float32) -> None:
        self.forward = forward
        self.dtype = dtype
        self.output_dtype = output_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.forward(*args, **kwargs)
        return out if self.output_dtype is None else _outputs_to(out, self.output_dtype)


def wrap_autocast(model: nn.Module, dtype: torch.dtype, output_dtype: Optional[torch.dtype]) -> None:
    """Make ``model(...)`` run under autocast, keeping the model's class and state_dict."""
    if isinstance(model.__dict__.get("forward"), AutocastForward):
        return
    model.forward = AutocastForward(model.forward, dtype, output_dtype)  # type: ignore[method-assign]
