"""Split-bf16 master weights: an fp32 value stored as two 16-bit halves.

The bf16 parameter the model computes with *is* the high half of the fp32 master (sign, exponent,
7 mantissa bits); the low 16 mantissa bits live beside it in an int16 "trail" tensor. Joining the
halves gives back the fp32 master bit for bit, so an optimizer can update in fp32 and split again:
4 bytes per parameter (2 + 2) instead of 6 (a bf16 copy plus an fp32 master).

Choice: the bf16 half is the *truncated* master (round toward zero), not the round-to-nearest
value. Truncation keeps the split a pure bit move (no arithmetic, NaN payloads and infinities pass
through unchanged, and the fp32 reconstruction is exact for every bit pattern). The price: the bf16
weights seen by the forward pass are biased toward zero by less than one bf16 ulp, the same choice
IPEX's split-SGD makes.

Only the bit layout is used (little-endian hosts), never float arithmetic, so
``join(*split(x))`` reproduces ``x`` exactly for every fp32 bit pattern, including ±0,
subnormals, ±inf and NaN payloads.
"""
from __future__ import annotations

import sys

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

if sys.byteorder != "little":  # pragma: no cover - every torch CPU build we target is little-endian
    raise ImportError("split-bf16 storage assumes a little-endian host")

TRAIL_DTYPE = torch.int16
_LOW, _HIGH = 0, 1  # index of each 16-bit half inside a little-endian fp32


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``tensor``'s elements in memory order (contiguous or channels-last alike)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    if not _dense(tensor):
        raise ValueError("split-bf16 needs a dense, non-overlapping tensor")
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def _dense(tensor: torch.Tensor) -> bool:
    """True when the elements tile one contiguous block of memory (any dimension order)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _halves(master: torch.Tensor) -> torch.Tensor:
    """``master``'s memory as an (n, 2) int16 view: column 0 the low half, column 1 the high."""
    return _flat(master).view(torch.int16).view(-1, 2)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an fp32 tensor into ``(top, trail)``: the bf16 high half and the int16 low half.

    Both results have ``master``'s shape and memory layout.
    """
    if master.dtype != torch.float32:
        raise TypeError(f"split-bf16 needs a float32 master, got {master.dtype}")
    top = torch.empty_like(master, dtype=torch.bfloat16)
    trail = torch.empty_like(master, dtype=TRAIL_DTYPE)
    split_into(master, top, trail)
    return top, trail


def _laid_as(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its memory layout is ``like``'s, else a copy in ``like``'s layout (the
    halves are moved in memory order: a parameter made channels-last after its split, say)."""
    if tensor.stride() == like.stride():
        return tensor
    return torch.empty_like(like, dtype=tensor.dtype).copy_(tensor)


def split_into(master: torch.Tensor, top: torch.Tensor, trail: torch.Tensor) -> None:
    """Write ``master``'s high half into ``top`` (bf16) and its low half into ``trail`` (int16)."""
    halves = _halves(master)
    for out, column in ((top, _HIGH), (trail, _LOW)):
        laid = out if out.stride() == master.stride() else torch.empty_like(master, dtype=out.dtype)
        _flat(laid).view(torch.int16).copy_(halves[:, column])
        if laid is not out:
            out.copy_(laid)


def join(top: torch.Tensor, trail: torch.Tensor) -> torch.Tensor:
    """Rebuild the fp32 master from its bf16 high half and int16 low half (bit-exact)."""
    if top.dtype != torch.bfloat16 or trail.dtype != TRAIL_DTYPE:
        raise TypeError(f"join needs (bfloat16, int16), got ({top.dtype}, {trail.dtype})")
    master = torch.empty_like(top, dtype=torch.float32)
    join_into(top, trail, master)
    return master


def join_into(top: torch.Tensor, trail: torch.Tensor, master: torch.Tensor) -> None:
    """Write the fp32 value whose halves are ``top`` and ``trail`` into ``master``."""
    # bf16 -> fp32 widening is an exact 16-bit shift (NaN payloads kept); OR-ing in the
    # zero-extended low half is ~2x faster here than two strided int16 copies.
    master.copy_(top)
    low = _flat(_laid_as(trail, master)).view(torch.uint16).to(torch.int32)
    _flat(master).view(torch.int32).bitwise_or_(low)


def bytes_per_element(top: torch.Tensor, trail: torch.Tensor) -> int:
    """Persistent bytes one parameter element costs in split storage (2 + 2)."""
    return top.element_size() + trail.element_size()
