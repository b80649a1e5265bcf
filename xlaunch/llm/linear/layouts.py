"""The native layouts of :class:`~xlaunch.llm.linear.PackedLinear`'s weights (xlaunch/llm/csrc/linear.h) and
back: blocks of 64 output channels; bf16 pairs of K, INT8 fours of K in one 32-bit word, INT4 nibbles and
INT6's two high bits a step of four K; per-channel (or per-group) fp32 scales; the rows of a tied
embedding looked up in a packed lm_head."""
from __future__ import annotations

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.llm.footprint import BLOCK  # noqa: E402  (output channels per native block, csrc/linear.h: kBlock)

INT4_ZERO = 8        # int4 values are stored unsigned, q + 8
INT6_ZERO = 32       # int6 values, q + 32


def _pad_rows(t: "torch.Tensor", multiple: int, value: float = 0) -> "torch.Tensor":
    extra = -t.shape[0] % multiple
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)]) if extra else t


def bf16_valued(weight: "torch.Tensor") -> bool:
    """Whether every value of ``weight`` is a bf16 value (a bf16 checkpoint's, widened to fp32 or not)."""
    return weight.dtype == torch.bfloat16 or bool((weight.to(torch.bfloat16).to(weight.dtype) == weight).all())


def pack_bf16(weight: "torch.Tensor") -> "torch.Tensor":
    """bf16 [N, K] -> [N/64, K/2, 128]: per block, the (k, k+1) pairs of its 64 channels together."""
    w = _pad_rows(weight.to(torch.bfloat16), BLOCK)
    if w.shape[1] % 2:
        w = torch.nn.functional.pad(w, (0, 1))
    blocks, k2 = w.shape[0] // BLOCK, w.shape[1] // 2
    return w.reshape(blocks, BLOCK, k2, 2).permute(0, 2, 1, 3).reshape(blocks, k2, 2 * BLOCK).contiguous()


def unpack_bf16(packed: "torch.Tensor", n: int, k: int) -> "torch.Tensor":
    blocks, k2, _ = packed.shape
    return packed.reshape(blocks, k2, BLOCK, 2).permute(0, 2, 1, 3).reshape(blocks * BLOCK, 2 * k2)[:n, :k]


def pack_int8(q: "torch.Tensor") -> "torch.Tensor":
    """int8 [N, K] -> [N/64, K4, 256], K4 = ceil(K / 4): byte 4c + t of step j holds q[c, 4j + t] of the
    block's channel c (zero past K), so each channel's four values of K lie in one 32-bit word."""
    w = _pad_rows(q, BLOCK)
    w = torch.nn.functional.pad(w, (0, -w.shape[1] % 4))
    blocks, k4 = w.shape[0] // BLOCK, w.shape[1] // 4
    return w.reshape(blocks, BLOCK, k4, 4).permute(0, 2, 1, 3).reshape(blocks, k4, 4 * BLOCK).contiguous()


def unpack_int8(packed: "torch.Tensor", n: int, k: int) -> "torch.Tensor":
    blocks, k4, _ = packed.shape
    return packed.reshape(blocks, k4, BLOCK, 4).permute(0, 2, 1, 3).reshape(blocks * BLOCK, 4 * k4)[:n, :k]


def _nibble_bytes(u: "torch.Tensor", shift: int) -> "torch.Tensor":
    """Unsigned values [N/64 * 64, K] -> uint8 [N/64, K/4, 128]: byte 2c + t of step k holds u[c, k+t] and,
    ``shift`` bits up, u[c, k+2+t] of the block's channel c."""
    blocks, k = u.shape[0] // BLOCK, u.shape[1]
    u = u.reshape(blocks, BLOCK, k // 4, 2, 2)
    packed = (u[:, :, :, 0, :] | (u[:, :, :, 1, :] << shift)).to(torch.uint8)
    return packed.permute(0, 2, 1, 3).reshape(blocks, k // 4, 2 * BLOCK)


def _nibble_values(packed: "torch.Tensor", n: int, shift: int) -> "torch.Tensor":
    """:func:`_nibble_bytes` undone: int16 [n, K]."""
    blocks, quads, _ = packed.shape
    b = packed.reshape(blocks, quads, BLOCK, 2).permute(0, 2, 1, 3).to(torch.int16)
    u = torch.stack([b & ((1 << shift) - 1), b >> shift], dim=3)   # [blocks, 64, quads, 2 (nibble), 2 (t)]
    return u.reshape(blocks * BLOCK, quads * 4)[:n]


def pack_int4(q: "torch.Tensor") -> "torch.Tensor":
    """int4 values [N, K] -> uint8 [N/64, K/4, 128]: byte 2c + t of step k holds q[c, k+t] + 8 (low nibble)
    and q[c, k+2+t] + 8 (high nibble) of the block's channel c."""
    return _nibble_bytes(_pad_rows(q.to(torch.int16) + INT4_ZERO, BLOCK, INT4_ZERO), 4).contiguous()


def unpack_int4(packed: "torch.Tensor", n: int) -> "torch.Tensor":
    return (_nibble_values(packed, n, 4) - INT4_ZERO).to(torch.int8)


def pack_int6(q: "torch.Tensor") -> "torch.Tensor":
    """int6 values [N, K] -> uint8 [N/64, K/4, 192]: per step, :func:`pack_int4`'s 128 bytes of u & 15
    (u = q + 32), then 64 bytes of u >> 4: byte p holds nibble byte p's two (bits 0-1 and 2-3) in its low
    nibble and nibble byte p + 64's in its high one (csrc/linear.h)."""
    u = _pad_rows(q.to(torch.int16) + INT6_ZERO, BLOCK, INT6_ZERO)
    high = _nibble_bytes(u >> 4, 2)
    plane = high[..., :BLOCK] | (high[..., BLOCK:] << 4)
    return torch.cat([_nibble_bytes(u & 15, 4), plane], dim=-1).contiguous()


def unpack_int6(packed: "torch.Tensor", n: int) -> "torch.Tensor":
    plane = packed[..., 2 * BLOCK:]
    high = _nibble_values(torch.cat([plane & 15, plane >> 4], dim=-1), n, 2)
    return ((_nibble_values(packed[..., :2 * BLOCK], n, 4) | (high << 4)) - INT6_ZERO).to(torch.int8)


NATIVE_PACKERS = {"int8": pack_int8, "int4": pack_int4, "int6": pack_int6}   # values -> csrc/linear.h's layout


def _int6_rows(packed: "torch.Tensor", channels: "torch.Tensor", k: int) -> "torch.Tensor":
    """The int6 values of rows ``channels`` of a native int6 weight, int16 ``[len(channels), k]``."""
    blocks, steps = packed.shape[:2]
    block, c = channels // BLOCK, channels % BLOCK
    nibbles = packed[..., :2 * BLOCK].reshape(blocks, steps, BLOCK, 2)[block, :, c].to(torch.int16)
    high = packed[..., 2 * BLOCK:].reshape(blocks, steps, BLOCK // 2, 2)[block, :, c % (BLOCK // 2)].to(torch.int16)
    high = (high >> (4 * (c >= BLOCK // 2)).to(torch.int16).reshape(-1, 1, 1)) & 15   # [m, steps, 2 (t)]
    values = torch.stack([(nibbles & 15) | ((high & 3) << 4), (nibbles >> 4) | ((high >> 2) << 4)], dim=2)
    return (values.reshape(channels.numel(), -1) - INT6_ZERO)[:, :k]


def pack_channels(scale: "torch.Tensor") -> "torch.Tensor":
    """fp32 scales [N] or [N, G] -> [N/64, 64] or [N/64, G, 64] (zeros past N)."""
    s = _pad_rows(scale.float().reshape(scale.shape[0], -1), BLOCK)
    packed = s.reshape(-1, BLOCK, s.shape[1]).permute(0, 2, 1).contiguous()
    return packed.reshape(-1, BLOCK) if scale.dim() == 1 else packed


def unpack_channels(packed: "torch.Tensor", n: int) -> "torch.Tensor":
    return packed.reshape(-1)[:n] if packed.dim() == 2 else packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]


def _native_rows(packed: "torch.Tensor", channels: "torch.Tensor", per_word: int, k: int) -> "torch.Tensor":
    """The rows ``channels`` of a native ``[N/64, steps, 64 x per_word]`` weight (bf16: pairs of K, int8:
    fours), ``[len(channels), k]``, in its dtype."""
    words = packed.view(*packed.shape[:2], BLOCK, per_word)[channels // BLOCK, :, channels % BLOCK]
    return words.reshape(channels.numel(), -1)[:, :k]
