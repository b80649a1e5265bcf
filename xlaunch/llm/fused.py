"""The small fused operators of a decoder layer: RMSNorm (with the residual add), RoPE, SiLU-and-multiply,
the KV-cache writes, attention over a preallocated KV cache.

Each operator calls the compiled kernel of ``xlaunch/llm/csrc/fused_*.cpp`` (``torch.ops.xlaunch_llm``,
see :mod:`xlaunch.llm.native`) when it is built and wanted, else its pure-torch path here; both have
the semantics documented on the function. The kernels compute in fp32 and round once per stored
value, so in bf16 they differ from the torch paths by about one bf16 rounding.

Shapes: ``B`` batch, ``S`` new tokens, ``H`` query heads, ``G`` KV heads (``H % G == 0``), ``D`` head
size, ``L`` cache capacity. Head tensors (``q``, ``k``, ``v``) are [B, S, heads, D] with a contiguous
last dim (views of a fused QKV projection's output are fine).
"""
from __future__ import annotations

from typing import Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.nn.functional as F

from xlaunch.llm.native import ops  # noqa: E402

_kernels: dict[tuple[int, str], object] = {}


def _kernel(name: str) -> Optional[object]:
    """The compiled operator ``name`` of the level in use (its OpOverload, looked up once per level), or
    None for the torch path."""
    library = ops()
    if library is None:
        return None
    key = (id(library), name)       # a process may run several levels (prefer_native, XLAUNCH_CPU_ISA)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = getattr(library, name).default
    return kernel


def rms_norm(x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim, computed in fp32.

    As Hugging Face's Llama: the normalized value is cast to x's dtype before the weight multiply;
    the result has the promoted dtype of x and weight.
    """
    native = _kernel("rms_norm")
    if native is not None:
        return native(x, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


def add_rms_norm(x: "torch.Tensor", residual: "torch.Tensor", weight: "torch.Tensor",
                 eps: float) -> "torch.Tensor":
    """``residual += x`` (in place, rounded to residual's dtype), then :func:`rms_norm` of the new residual."""
    native = _kernel("add_rms_norm")
    if native is not None:
        return native(x, residual, weight, eps)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_mul(gate_up: "torch.Tensor") -> "torch.Tensor":
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` on the last dim (silu rounded to the dtype first, as HF)."""
    native = _kernel("silu_mul")
    if native is not None:
        return native(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _signed_sin(sin: "torch.Tensor") -> "torch.Tensor":
    """``[-sin[:h] | sin[h:]]`` [B, S, 1, D]: the rotation is then ``x * cos + [x[h:] | x[:h]] * signed``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None, :]


def _rotated(x: "torch.Tensor", cos: "torch.Tensor", signed_sin: "torch.Tensor") -> "torch.Tensor":
    """``x`` rotated by ``cos`` [B, S, D] and :func:`_signed_sin`: a new tensor in the promoted dtype."""
    half = x.shape[-1] // 2
    return x * cos[:, :, None, :] + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def rope_(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Rotate ``x`` [B, S, heads, D] in place by the position tables ``cos``/``sin`` [B, S, D]; returns ``x``.

    Half-split rotation: ``x[:h] * cos[:h] - x[h:] * sin[:h]`` and ``x[h:] * cos[h:] + x[:h] * sin[h:]``
    (``h = D / 2``); the tables may be fp32 or x's dtype, and a batch of 1 is broadcast.
    """
    native = _kernel("rope_")
    if native is not None:
        native(x, cos, sin)
        return x
    x.copy_(_rotated(x, cos, _signed_sin(sin)))
    return x


def write_cache_(k_cache: "torch.Tensor", v_cache: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                 start: int) -> None:
    """``k_cache[:, :, start:start+S] = k`` and the same for v (k, v [B, S, G, D]; caches [B, G, L, D])."""
    native = _kernel("write_cache_")
    if native is not None:
        native(k_cache, v_cache, k, v, start)
        return
    s = k.shape[1]
    k_cache[:, :, start:start + s].copy_(k.transpose(1, 2))
    v_cache[:, :, start:start + s].copy_(v.transpose(1, 2))


def rope_write_cache_(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", cos: "torch.Tensor",
                      sin: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", start: int) -> None:
    """One call for a layer's positions: :func:`rope_` of ``q`` in place, the rotated ``k`` and ``v`` written
    to the caches at ``start`` (as :func:`write_cache_`). ``k`` itself is left as it was."""
    native = _kernel("rope_write_cache_")
    if native is not None:
        native(q, k, v, cos, sin, k_cache, v_cache, start)
        return
    signed_sin = _signed_sin(sin)
    q.copy_(_rotated(q, cos, signed_sin))
    s = k.shape[1]
    k_cache[:, :, start:start + s].copy_(_rotated(k, cos, signed_sin).transpose(1, 2))
    v_cache[:, :, start:start + s].copy_(v.transpose(1, 2))


# From this many query rows (a prefill), ATen's scaled_dot_product_attention beats the cache kernel, which
# is made for a few new tokens over a long cache: AVX2 VM, 32 heads over 8 KV heads of 64, fp32, one
# thread: 16 rows 0.41 against 0.28 ms, 32 rows 1.46 against 0.57, 1024 rows 1211 against 215 ms (two
# threads: 0.25 against 0.34 ms at 16 rows, 5.6x faster at 1024).
SDPA_ROWS = 32


def cache_attention(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", start: int,
                    key_padding: Optional["torch.Tensor"], scale: float,
                    window: Optional[int] = None) -> "torch.Tensor":
    """Causal attention of ``q`` [B, S, H, D] (positions ``start .. start+S-1``) over the cache.

    ``k_cache``/``v_cache`` are [B, G, L, D] with the first ``start + S`` slots filled (query head
    ``h`` reads KV head ``h // (H / G)``). ``key_padding`` [B, >= start + S] is True where a slot holds
    padding (never attended), or None. ``window``: a sliding window (slot j visible to slot i when
    i - window < j <= i), or None. Returns [B, S, H * D] in q's dtype (softmax in fp32); a query
    row whose every key is masked gives zeros. From :data:`SDPA_ROWS` query rows ATen's SDPA runs it.
    """
    if window is not None and start + q.shape[1] > window:
        if q.shape[1] == 1:        # one token: its window is the last `window` slots, read in place
            first = start + 1 - window
            return cache_attention(q, k_cache[:, :, first:], v_cache[:, :, first:], start - first,
                                   None if key_padding is None else key_padding[:, first:], scale)
        return _torch_cache_attention(q, k_cache, v_cache, start, key_padding, scale, window)
    return attention_by_rows(_kernel("cache_attention"), q, k_cache, v_cache, start, key_padding, scale)


def attention_by_rows(native: Optional[object], q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor",
                      start: int, key_padding: Optional["torch.Tensor"], scale: float) -> "torch.Tensor":
    """:func:`cache_attention` without a window: the cache kernel ``native`` for fewer than :data:`SDPA_ROWS`
    query rows, ATen's SDPA from there (and without a kernel). The decoder binds its level's kernel here."""
    if native is not None and q.shape[1] < SDPA_ROWS:
        return native(q, k_cache, v_cache, start, key_padding, scale)
    return _torch_cache_attention(q, k_cache, v_cache, start, key_padding, scale)


def _causal_attention(q: "torch.Tensor", keys: "torch.Tensor", values: "torch.Tensor", scale: float) -> "torch.Tensor":
    """A whole prompt's attention, q [B, S, H, D] over keys/values [B, G, S, D]: SDPA's causal path, the KV
    heads shared (no mask made, the masked half skipped). Returns [B, S, H * D]."""
    b, s, h, d = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True, scale=scale,
                                         enable_gqa=h != keys.shape[1])
    return out.transpose(1, 2).reshape(b, s, h * d)


def _left_padding(key_padding: "torch.Tensor") -> Optional[list[int]]:
    """Each row's count of padding slots when every row's padding is a prefix of it (``generate``'s left
    padding), else None."""
    lead = key_padding.sum(dim=1)
    prefix = torch.arange(key_padding.shape[1], device=key_padding.device)[None, :] < lead[:, None]
    return [int(count) for count in lead] if torch.equal(prefix, key_padding.bool()) else None


def _torch_cache_attention(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", start: int,
                           key_padding: Optional["torch.Tensor"], scale: float,
                           window: Optional[int] = None) -> "torch.Tensor":
    """:func:`cache_attention` in torch ops. The H/G query heads of a KV head are folded into its query
    rows, so the cache is read as it is (no repeat of K/V). One new token: two matmuls in the cache's
    dtype around an fp32 softmax, as Hugging Face's eager attention (torch's CPU SDPA costs 2-8x more
    there); more tokens: ``scaled_dot_product_attention`` with the causal (and window) and padding mask. A
    whole prompt (no cached slot before it, no padding, no window) takes SDPA's own causal path with the KV
    heads shared (``is_causal``, ``enable_gqa``), which skips the masked half: on the Zen 5 VM (2 threads,
    32 heads on 8, d 64) 1024 tokens 55 -> 37 ms a layer, 2048 226 -> 125, 4096 871 -> 424, equal to 512.
    Left-padded prompts (a batch of unequal lengths) take it row by row, after each row's padding."""
    b, s, h, d = q.shape
    g = k_cache.shape[1]
    n, total = h // g, start + s
    keys, values = k_cache[:, :, :total], v_cache[:, :, :total]
    keep = None if key_padding is None else ~key_padding[:, None, None, :total].bool()
    if s == 1:
        scores = torch.matmul(q.reshape(b, g, n, d), keys.transpose(-1, -2)).float() * scale
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if keep is not None:
            probs = probs.nan_to_num(0.0)
        return torch.matmul(probs.to(values.dtype), values).reshape(b, 1, h * d)
    if start == 0 and window is None:
        if keep is None:
            return _causal_attention(q, keys, values, scale)
        lead = _left_padding(key_padding[:, :total])
        if lead is not None:      # each row's prompt after its padding, causal; a padding row attends nothing
            out = q.new_zeros(b, s, h * d)
            for row, pad in enumerate(lead):
                if pad < s:
                    out[row, pad:] = _causal_attention(q[row:row + 1, pad:], keys[row:row + 1, :, pad:],
                                                       values[row:row + 1, :, pad:], scale)[0]
            return out
    rows = q.reshape(b, s, g, n, d).permute(0, 2, 3, 1, 4).reshape(b, g, n * s, d)   # rows: (head, token)
    key_slots, query_slots = torch.arange(total, device=q.device), (start + torch.arange(s, device=q.device))[:, None]
    causal = key_slots <= query_slots
    if window is not None:
        causal &= key_slots > query_slots - window
    mask = causal.repeat(n, 1)[None, None]                                             # [1, 1, n*S, T]
    if keep is not None:
        mask = mask & keep
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    if keep is not None:
        out = out.nan_to_num(0.0)
    return out.reshape(b, g, n, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d)
