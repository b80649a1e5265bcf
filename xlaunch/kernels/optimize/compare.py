"""Do two model outputs agree? (used to check every rewrite against the model before it)"""
from __future__ import annotations

from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

FP32_RTOL = 1e-3
BF16_RTOL = 6e-2


def flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    return []


def outputs_close(reference: Any, candidate: Any, rtol: float) -> Optional[str]:
    """None when every output tensor matches within ``rtol`` of the reference's largest magnitude."""
    refs, cands = flat_tensors(reference), flat_tensors(candidate)
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


def dtypes_differ(reference: Any, candidate: Any) -> Optional[str]:
    """None when every output tensor has the reference's dtype (a frozen graph must give what eager gives)."""
    for ref, cand in zip(flat_tensors(reference), flat_tensors(candidate)):
        if ref.dtype != cand.dtype:
            return f"output dtype {cand.dtype} instead of {ref.dtype}"
    return None
