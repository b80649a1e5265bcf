"""The optimized forward of a supported decoder: prefill and decode over :class:`~xlaunch.llm.cache.KVBuffers`.

Per layer: one packed q/k/v linear, RoPE on q and k in place, the new keys and values written into
their cache slots, attention over the cache, the output linear, the residual add fused with the
next RMSNorm, one packed gate/up linear, SiLU-and-multiply, the down linear, and again the fused
residual add and norm. About a dozen calls per layer and no allocation that grows with the cache.
Needs torch only: the Hugging Face model's ``forward`` around it is :func:`xlaunch.llm.api._forward`.

:meth:`DecoderRuntime.generate_tokens` is one-beam ``generate``'s loop; its logits processing (the
repetition penalty, then the temperature, top-k, top-p and min-p warpers, each a callable
``(ids so far [B, T], scores [B, vocab]) -> scores``) is at the end: :func:`warpers` and
:func:`repetition_penalty` give the values Hugging Face's processors give (the tests compare tokens
with its ``generate``), for the optimized model's loop and :mod:`xlaunch.llm.standalone`'s alike.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.llm import fused, native  # noqa: E402
from xlaunch.llm.shapes import DecoderSpec  # noqa: E402
from xlaunch.llm.cache import KVBuffers  # noqa: E402
from xlaunch.llm.linear import PackedLinear  # noqa: E402

DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}     # the activations' dtypes, by their names
# A long prompt's MLP runs this many rows at a time: its gate/up output, the SiLU product and the down
# projection's quantized input are the largest activations of a layer (1B shape, 2048 tokens: 64 + 32 + 16
# MiB whole), and every row is computed on its own, so the chunks give the same values.
MLP_ROWS = 512


@dataclass
class LayerWeights:
    """What one decoder layer computes with."""

    input_norm: "torch.Tensor"
    post_attention_norm: "torch.Tensor"
    qkv: PackedLinear
    out: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    window: Optional[int]


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def exact_in_bf16(table: "torch.Tensor", rows: int = 4096) -> bool:
    """Whether every value of an fp32 ``table`` is a bf16 value (its low 16 bits zero); in slices of rows."""
    bits = table.detach().contiguous().view(torch.int32)
    return all(not bool((bits[start:start + rows] & 0xFFFF).any()) for start in range(0, bits.shape[0], rows))


def embedding_table(table: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """The token embedding as the runtime keeps it: in ``dtype``, except under fp32 activations, where a
    table that is exactly 16-bit (bf16/fp16 in the checkpoint, or fp32 holding only bf16 values) stays
    16-bit: half the memory, and the rows a step looks up widen to the same fp32 values."""
    if dtype == torch.float32 and table.dtype in SIXTEEN_BIT:
        return table.detach()
    if dtype == torch.float32 and table.dtype == torch.float32 and exact_in_bf16(table):
        return table.detach().to(torch.bfloat16)
    return table.detach().to(dtype)


class TokenIdError(IndexError, ValueError):
    """A token id outside the vocabulary (an IndexError, as torch's embedding raises, and a ValueError)."""


def embed_rows(table: Optional["torch.Tensor"], lm_head: PackedLinear, ids: "torch.Tensor",
               dtype: "torch.dtype") -> "torch.Tensor":
    """The embeddings of ``ids`` in ``dtype``: rows of ``table``, or of the packed ``lm_head`` when the
    embedding is tied to it (``table`` None: one copy of the matrix, not two). An id outside the vocabulary is
    a :class:`TokenIdError` (the packed rows would read another token's row for a negative one)."""
    vocab = lm_head.out_features if table is None else table.shape[0]
    if ids.numel():
        low, high = (int(value) for value in torch.aminmax(ids))
        if low < 0 or high >= vocab:
            raise TokenIdError(f"xlaunch.llm: input_ids holds token id {low if low < 0 else high}, outside the "
                               f"vocabulary (0 to {vocab - 1})")
    rows = lm_head.rows(ids) if table is None else torch.nn.functional.embedding(ids, table)
    return rows.to(dtype)


class TokenEmbedding(torch.nn.Module):
    """``model.model.embed_tokens`` of an optimized model: rows of the runtime's table (a buffer, not a
    parameter, so ``model.dtype`` stays the activations' dtype), or of the packed lm_head a tied
    embedding reads (``weight`` is None then), returned in the activations' dtype.

    It holds the model's first parameter, ``activations``: empty, in the activations' dtype. Hugging
    Face's ``model.device`` and ``model.dtype`` are the first parameter's, and ``generate`` asks for
    ``device`` twice a token; without a parameter here the search walks every module up to the first
    layer's norm each time (0.2-0.4 ms a token on the AVX2 VM, for 16 layers)."""

    def __init__(self, table: Optional["torch.Tensor"], dtype: "torch.dtype", lm_head: PackedLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features
        self.out_dtype = dtype
        self.activations = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.register_buffer("weight", table)
        object.__setattr__(self, "lm_head", lm_head)      # the model's own lm_head: not a second submodule

    def forward(self, input_ids: "torch.Tensor") -> "torch.Tensor":
        return embed_rows(self.weight, self.lm_head, input_ids, self.out_dtype)

    def extra_repr(self) -> str:
        stored = "the lm_head's rows" if self.weight is None else f"stored {self.weight.dtype}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {stored}, returns {self.out_dtype}"


class RopeTable:
    """cos/sin of every position up to a length (grown by doubling), from the RoPE's fp32 inverse frequencies
    and attention scaling, computed as Hugging Face's rotary modules compute them (the same values)."""

    def __init__(self, inv_freq: "torch.Tensor", attention_scaling: float, head_dim: int, dtype: "torch.dtype") -> None:
        if tuple(inv_freq.shape) != (head_dim // 2,):
            raise ValueError(f"RoPE inverse frequencies of shape {tuple(inv_freq.shape)}, not ({head_dim // 2},)")
        self.inv_freq, self.attention_scaling = inv_freq.float(), float(attention_scaling)
        self.head_dim, self.dtype = head_dim, dtype
        self.tables = (torch.empty(0, head_dim), torch.empty(0, head_dim))   # (cos, sin), replaced as one

    @classmethod
    def of(cls, rotary: Any, head_dim: int, dtype: "torch.dtype") -> "RopeTable":
        """The table of a Hugging Face rotary module (its original frequencies: no length-dependent RoPE here)."""
        inv_freq = getattr(rotary, "original_inv_freq", None)
        inv_freq = rotary.inv_freq if inv_freq is None else inv_freq
        return cls(inv_freq.detach().float().clone(), getattr(rotary, "attention_scaling", 1.0), head_dim, dtype)

    def _table(self, length: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        positions = torch.arange(length)[None, None, :].float()
        freqs = (self.inv_freq[None, :, None] @ positions).transpose(1, 2)     # as the rotary modules: one product each
        angles = torch.cat((freqs, freqs), dim=-1)[0]
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def lookup(self, positions: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """(cos, sin) [B, S, D] for ``positions`` [B, S], in the model's dtype (as Hugging Face casts them). A negative
        position is rotated backwards, as there (cos of -p is cos of p, sin its negation), not read from the table's end."""
        low, high = (int(value) for value in torch.aminmax(positions)) if positions.numel() else (0, 0)
        needed = max(high, -low) + 1
        cos, sin = self.tables          # one read: another thread may grow them meanwhile
        if needed > cos.shape[0]:
            cos, sin = self._table(max(needed, 2 * cos.shape[0], 256))
            cos, sin = self.tables = cos.to(self.dtype), sin.to(self.dtype)
        if low >= 0:
            return cos[positions], sin[positions]
        distance = positions.abs()
        return cos[distance], torch.where((positions < 0)[..., None], -sin[distance], sin[distance])


INT_IDS = (torch.long, torch.int32)       # the index dtypes of token ids and positions (as torch's embedding takes)


def _shape(value: Any) -> str:
    return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" if isinstance(value, torch.Tensor) \
        else type(value).__name__


def check_inputs(hidden: int, input_ids: Any, attention_mask: Any, position_ids: Any, inputs_embeds: Any) -> None:
    """One ValueError line for inputs the forward cannot take (they failed inside a reshape or a kernel, or a mask of
    another batch was read as every row's)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("xlaunch.llm: pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None and (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
                                  or input_ids.dtype not in INT_IDS or 0 in input_ids.shape):
        raise ValueError(f"xlaunch.llm: input_ids must be a non-empty [batch, length] tensor of token ids (torch.long), "
                         f"not {_shape(input_ids)}")
    if inputs_embeds is not None and (not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3
                                      or not inputs_embeds.is_floating_point() or 0 in inputs_embeds.shape[:2]
                                      or inputs_embeds.shape[2] != hidden):
        raise ValueError(f"xlaunch.llm: inputs_embeds must be a non-empty [batch, length, {hidden}] floating-point "
                         f"tensor, not {_shape(inputs_embeds)}")
    batch, length = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"xlaunch.llm: attention_mask must be 2-D [batch, length] (0: padding), not {shape}; the "
                         "optimized model takes no 4-D or per-layer masks")
    if attention_mask is not None and (attention_mask.shape[0] != batch or attention_mask.shape[1] < length):
        raise ValueError(f"xlaunch.llm: attention_mask is {tuple(attention_mask.shape)}, the input {batch} rows of "
                         f"{length} tokens (a mask covers the cache and the input)")
    if position_ids is not None and (not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in INT_IDS
                                     or position_ids.numel() not in (length, batch * length)
                                     or position_ids.shape[-1] != length):
        raise ValueError(f"xlaunch.llm: position_ids must be integers of shape [{batch}, {length}] or [1, {length}], "
                         f"not {_shape(position_ids)}")


class Kernels:
    """The calls of one forward: the compiled operators with the weights bound (when built), else the
    pure-torch paths. Bound once per availability, so a decode step makes no dispatch decisions."""

    def __init__(self, ops: Optional[object], layers: list[LayerWeights], lm_head: PackedLinear) -> None:
        self.ops = ops
        self.linears = [tuple(linear.bound(ops) for linear in (l.qkv, l.out, l.gate_up, l.down)) for l in layers]
        self.lm_head = lm_head.bound(ops)
        source = ops if ops is not None else fused
        self.rms_norm, self.add_rms_norm = source.rms_norm, source.add_rms_norm
        self.silu_mul, self.rope_write_cache_ = source.silu_mul, source.rope_write_cache_
        # the level's cache kernel for a few query rows, ATen's SDPA for a prefill (fused.SDPA_ROWS)
        self.cache_attention = functools.partial(fused.attention_by_rows, None if ops is None else ops.cache_attention)


class DecoderRuntime:
    """The packed weights, RoPE table and the forward of one optimized model (``embed`` None: the
    embedding is tied, its rows are the packed lm_head's)."""

    def __init__(self, spec: DecoderSpec, dtype: "torch.dtype", embed: Optional["torch.Tensor"],
                 layers: list[LayerWeights], final_norm: "torch.Tensor", lm_head: PackedLinear, rope: RopeTable) -> None:
        self.spec, self.dtype, self.embed, self.layers = spec, dtype, embed, layers
        self.final_norm, self.lm_head, self.rope = final_norm, lm_head, rope
        self.scale = spec.head_dim ** -0.5
        self._kernels: Optional[Kernels] = None
        self.cache_type: type = KVBuffers     # a Hugging Face model's runtime makes KVCache (Cache as well)

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _kernels=None)      # bound to these weights: a copy binds its own

    def kernels(self) -> Kernels:
        ops = native.ops()
        if self._kernels is None or self._kernels.ops is not ops:
            self._kernels = Kernels(ops, self.layers, self.lm_head)
        return self._kernels

    def new_cache(self, capacity: int = 0) -> KVBuffers:
        spec = self.spec
        return self.cache_type(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype, capacity=capacity)

    def _cache_for(self, past: Any) -> KVBuffers:
        if isinstance(past, KVBuffers):
            held, spec = (past.num_layers, past.kv_heads, past.head_dim, past.dtype), self.spec
            if held != (spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype):     # another model's
                raise ValueError(f"xlaunch.llm: past_key_values is another model's KV cache ({past.num_layers} layers, "
                                 f"{past.kv_heads} KV heads of {past.head_dim}, {past.dtype}), not this one's "
                                 f"({spec.num_layers}, {spec.num_kv_heads} of {spec.head_dim}, {self.dtype})")
            return past
        length = getattr(past, "get_seq_length", None)      # another Cache: empty, generate made it before the hook
        if past is None or (callable(length) and length() == 0):
            return self.new_cache()     # generate's own calls bring a KVCache sized by the hook in api.py
        raise ValueError(f"xlaunch.llm: past_key_values is a {type(past).__name__} holding tokens; an optimized "
                         "model continues only its own KVCache (pass the past_key_values it returned, or None)")

    def _attention(self, kernels: Kernels, q: "torch.Tensor", index: int, cache: KVBuffers, start: int,
                   padding: Optional["torch.Tensor"], window: Optional[int]) -> "torch.Tensor":
        keys, values = cache.keys[index], cache.values[index]
        if window is None:
            return kernels.cache_attention(q, keys, values, start, padding, self.scale)
        return fused.cache_attention(q, keys, values, start, padding, self.scale, window=window)

    @torch.no_grad()
    def forward(self, input_ids: Optional["torch.Tensor"], attention_mask: Optional["torch.Tensor"],
                position_ids: Optional["torch.Tensor"], past_key_values: Any, inputs_embeds: Optional["torch.Tensor"],
                use_cache: bool, logits_to_keep: Any) -> tuple["torch.Tensor", Optional[KVBuffers]]:
        """(logits, cache) for the new tokens; the cache advanced by them (None when ``use_cache`` is False and no
        cache was given: a given one is continued and returned whatever ``use_cache`` says, as Hugging Face's forward
        does)."""
        spec = self.spec
        check_inputs(spec.hidden_size, input_ids, attention_mask, position_ids, inputs_embeds)
        hidden = (embed_rows(self.embed, self.lm_head, input_ids, self.dtype) if inputs_embeds is None
                  else inputs_embeds.to(self.dtype).contiguous())
        batch, length = hidden.shape[:2]
        cache = self._cache_for(past_key_values)
        start = cache.length
        total = start + length
        cache.reserve(batch, total)
        padding = cache.note_padding(attention_mask, total)
        if position_ids is None:
            position_ids = torch.arange(start, total)[None, :].expand(batch, length)
        cos, sin = self.rope.lookup(position_ids.reshape(-1, length).expand(batch, length))
        heads, groups, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        head_split = (heads, groups, groups)
        kernels = self.kernels()
        rms_norm, add_rms_norm, silu_mul = kernels.rms_norm, kernels.add_rms_norm, kernels.silu_mul
        rope_write_cache_, eps = kernels.rope_write_cache_, spec.eps
        residual = hidden
        x = rms_norm(residual, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            qkv_proj, out_proj, gate_up_proj, down_proj = kernels.linears[index]
            q, k, v = qkv_proj(x).view(batch, length, heads + 2 * groups, dim).split_with_sizes(head_split, dim=2)
            rope_write_cache_(q, k, v, cos, sin, cache.keys[index], cache.values[index], start)
            attended = self._attention(kernels, q, index, cache, start, padding, layer.window)
            x = add_rms_norm(out_proj(attended), residual, layer.post_attention_norm, eps)
            down = _mlp(x, gate_up_proj, silu_mul, down_proj)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            x = add_rms_norm(down, residual, following, eps)
        cache.length = total
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep > 0 else x
        else:
            x = x[:, logits_to_keep]
        logits = kernels.lm_head(x)
        return logits, (cache if use_cache or past_key_values is not None else None)

    @torch.no_grad()
    def generate_tokens(self, ids: "torch.Tensor", attention_mask: Optional["torch.Tensor"], new_tokens: int,
                        min_new_tokens: int, eos: Optional["torch.Tensor"], pad: Optional[int], streamer: Any,
                        warpers: Optional[list] = None, penalties: Sequence[Any] = ()) -> "torch.Tensor":
        """``ids`` [B, S] and ``new_tokens`` more, as Hugging Face's ``generate`` chooses them with one beam (its
        loop's work without its per-step bookkeeping): logits in fp32; ``penalties`` (Hugging Face's repetition
        penalty) applied; ``eos`` (ids) banned until ``min_new_tokens`` are out; then greedy (``warpers`` None),
        or sampled from the softmax of the scores after ``warpers`` (Hugging Face's own logits warpers, in its
        order; ``torch.multinomial``, so a seed gives generate's tokens); a row that produced one of ``eos`` is
        finished and gets ``pad`` from then on; stops when every row is finished. Positions follow
        ``attention_mask`` (left padding) as generate's do; ``streamer`` gets the prompt, then each step's
        tokens, then ``end()``."""
        batch, length = ids.shape
        cache = self.new_cache(capacity=length + new_tokens)
        mask = attention_mask
        positions = None if mask is None else (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        unfinished = torch.ones(batch, dtype=torch.bool)
        # min_new_tokens bans the end ids that are tokens (generate's processor ignores ids outside the vocabulary)
        banned = None if eos is None else eos[(eos >= 0) & (eos < self.lm_head.out_features)]
        out = [ids]
        if streamer is not None:
            streamer.put(ids.cpu())
        step_input = ids
        for step in range(new_tokens):
            logits, cache = self.forward(step_input, mask, positions, cache, None, True, 1)
            scores = logits[:, -1, :].float()
            so_far = torch.cat(out, dim=-1) if penalties or warpers is not None else ids
            for penalty in penalties:
                scores = penalty(so_far, scores)
            if banned is not None and step < min_new_tokens:
                scores[:, banned] = -float("inf")
            if warpers is None:
                chosen = scores.argmax(dim=-1)
            else:
                for warp in warpers:
                    scores = warp(so_far, scores)
                chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            if eos is not None:
                chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
                unfinished &= ~torch.isin(chosen, eos)
            out.append(chosen[:, None])
            if streamer is not None:
                streamer.put(chosen.cpu())
            if eos is not None and not bool(unfinished.any()):
                break
            step_input = chosen[:, None]
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
                positions = positions[:, -1:] + 1
        if streamer is not None:
            streamer.end()
        return torch.cat(out, dim=-1)


def _mlp(x: "torch.Tensor", gate_up: Any, silu_mul: Any, down: Any) -> "torch.Tensor":
    """``down(silu_mul(gate_up(x)))``, :data:`MLP_ROWS` rows of ``x`` at a time when it has more."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= MLP_ROWS:
        return down(silu_mul(gate_up(x)))
    parts = [down(silu_mul(gate_up(chunk))) for chunk in rows.split(MLP_ROWS)]
    return torch.cat(parts).view(*x.shape[:-1], -1)


# -- the logits processing of one-beam generate -------------------------------------------------------
Scores = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}      # generate's own, for what nothing sets
NEG_INF = -float("inf")


def temperature_warper(value: float) -> Scores:
    return lambda ids, scores: scores / value


def top_k_warper(k: int) -> Scores:
    """Only the ``k`` highest scores stay (ties with the k-th included)."""
    def warp(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        kth = torch.topk(scores, min(k, scores.size(-1)))[0][..., -1, None]
        return scores.masked_fill(scores < kth, NEG_INF)
    return warp


def top_p_warper(p: float) -> Scores:
    """The most likely tokens whose probabilities add up to ``p`` stay (at least the most likely one)."""
    def warp(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        ordered, order = torch.sort(scores, descending=False)
        dropped = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - p)
        dropped[..., -1:] = False
        return scores.masked_fill(dropped.scatter(1, order, dropped), NEG_INF)
    return warp


def min_p_warper(p: float) -> Scores:
    """Tokens at least ``p`` times as likely as the most likely one stay (that one always)."""
    def warp(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        probs = torch.softmax(scores, dim=-1)
        dropped = probs < p * probs.amax(dim=-1, keepdim=True)
        dropped.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        return scores.masked_fill(dropped, NEG_INF)
    return warp


def warpers(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float],
            min_p: Optional[float]) -> list[Scores]:
    """The sampling warpers of one beam, None taking generate's default, each only where it changes anything; a
    value Hugging Face's warper refuses (temperature not a float > 0, top-k not an int > 0, top-p or min-p
    outside [0, 1]) is a ValueError, as there."""
    temperature = SAMPLING_DEFAULTS["temperature"] if temperature is None else temperature
    top_k = SAMPLING_DEFAULTS["top_k"] if top_k is None else top_k
    top_p = SAMPLING_DEFAULTS["top_p"] if top_p is None else top_p
    chosen = []
    if temperature != 1.0:
        if not isinstance(temperature, float) or not temperature > 0:
            raise ValueError(f"temperature must be a float > 0, not {temperature!r}")
        chosen.append(temperature_warper(temperature))
    if top_k != 0:
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be an integer > 0 (0: off), not {top_k!r}")
        chosen.append(top_k_warper(top_k))
    if top_p < 1.0:
        if not 0 <= top_p <= 1:
            raise ValueError(f"top_p must be within [0, 1], not {top_p!r}")
        chosen.append(top_p_warper(top_p))
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be within [0, 1], not {min_p!r}")
        chosen.append(min_p_warper(min_p))
    return chosen


def repetition_penalty(penalty: float, mask: Optional["torch.Tensor"]) -> list[Scores]:
    """Every token already in a row made less likely (a score divided by ``penalty``, a negative one multiplied),
    the row's left padding (``mask``'s leading zeros) left out; [] for a penalty of 1 or None; a ValueError for one
    that is not a float > 0 (Hugging Face's processor refuses it)."""
    if penalty is None or penalty == 1.0:
        return []
    if not isinstance(penalty, float) or not penalty > 0:
        raise ValueError(f"repetition_penalty must be a float > 0, not {penalty!r}")
    padded = mask is not None and not bool((mask == 1).all())
    start = (mask != 0).int().argmax(dim=1) if padded else None

    def apply(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        vocab = scores.shape[-1]
        if start is not None:
            ids = ids.masked_fill(torch.arange(ids.shape[1])[None, :] < start[:, None], vocab)
        ids = ids.clamp(max=vocab)                       # ids past the vocabulary land in a column dropped after
        widened = torch.nn.functional.pad(scores, (0, 1))
        seen = torch.gather(widened, 1, ids)
        seen = torch.where(seen < 0, seen * penalty, seen / penalty)
        return widened.scatter(1, ids, seen)[..., :vocab]
    return [apply]
