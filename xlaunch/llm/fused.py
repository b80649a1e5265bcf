"""The small fused operators of a decoder layer: RMSNorm (with the residual add), RoPE, SiLU-and-multiply,
attention over a preallocated KV cache. Reference semantics in plain torch; the kernels match them.

Shapes: ``B`` batch, ``S`` new tokens, ``H`` query heads, ``G`` KV heads (``H % G == 0``), ``D`` head
size, ``L`` cache capacity.
"""
from __future__ import annotations

from typing import Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch


def rms_norm(x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim, computed in fp32, returned in x's dtype.

    As Hugging Face's Llama: the normalized value is cast to x's dtype before the weight multiply.
    """
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


def add_rms_norm(x: "torch.Tensor", residual: "torch.Tensor", weight: "torch.Tensor",
                 eps: float) -> "torch.Tensor":
    """``residual += x`` (in place), then :func:`rms_norm` of the new residual."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_mul(gate_up: "torch.Tensor") -> "torch.Tensor":
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Rotate ``x`` [B, S, heads, D] in place by the position tables ``cos``/``sin`` [B, S, D] (half-split rotation)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half].clone(), x[..., half:].clone()
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x[..., :half] = (first * c[..., :half] - second * s[..., :half]).to(x.dtype)
    x[..., half:] = (second * c[..., half:] + first * s[..., half:]).to(x.dtype)
    return x


def cache_attention(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", start: int,
                    key_padding: Optional["torch.Tensor"], scale: float) -> "torch.Tensor":
    """Causal attention of ``q`` [B, S, H, D] (positions ``start .. start+S-1``) over the cache.

    ``k_cache``/``v_cache`` are [B, G, L, D] with the first ``start + S`` slots filled.
    ``key_padding`` [B, start + S] is True where a slot holds padding (never attended), or None.
    Returns [B, S, H * D] in q's dtype (softmax in fp32).
    """
    b, s, h, d = q.shape
    g = k_cache.shape[1]
    total = start + s
    keys = k_cache[:, :, :total].float().repeat_interleave(h // g, dim=1)       # [B, H, T, D]
    values = v_cache[:, :, :total].float().repeat_interleave(h // g, dim=1)
    scores = torch.einsum("bshd,bhtd->bhst", q.float(), keys) * scale
    causal = torch.arange(total)[None, :] > (start + torch.arange(s))[:, None]      # [S, T]
    mask = causal[None, None]
    if key_padding is not None:
        mask = mask | key_padding[:, None, None, :total]
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhst,bhtd->bshd", probs, values)
    return out.reshape(b, s, h * d).to(q.dtype)
