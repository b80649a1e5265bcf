"""Build an optimized model from parts already packed, without a full-precision model in memory.

:func:`skeleton` makes the Hugging Face model of a config on the meta device (no weights allocated);
:func:`install` puts the packed linears, norms and embeddings (read from a checkpoint by
:mod:`xlaunch.llm.loader` or mapped from a packed file by :mod:`xlaunch.llm.packed_file`) into it and
gives it the same runtime and forward as :func:`xlaunch.llm.optimize`; :func:`runtime_of` makes the runtime
alone (:mod:`xlaunch.llm.standalone`). Importing this module imports neither transformers nor the Hugging Face
side of :mod:`xlaunch.llm`: those come with :func:`skeleton` and :func:`install`.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from xlaunch._errors import error_line
from xlaunch._torch import needs_torch, paused_gc

with needs_torch(__name__):
    import torch

from xlaunch.llm.shapes import DecoderSpec, describe  # noqa: E402
from xlaunch.llm.decoder import DecoderRuntime, LayerWeights, RopeTable, TokenEmbedding  # noqa: E402
from xlaunch.llm.linear import PackedLinear  # noqa: E402

LAYER_LINEARS = ("qkv", "out", "gate_up", "down")
HUGE_PAGE = 2 << 20


@dataclass
class Parts:
    """Everything an optimized decoder computes with, per layer and outside the layers."""

    embed: Optional["torch.Tensor"]             # None: tied, the rows are lm_head's
    final_norm: "torch.Tensor"
    lm_head: PackedLinear
    input_norms: list["torch.Tensor"]
    post_attention_norms: list["torch.Tensor"]
    linears: list[dict[str, PackedLinear]]      # per layer: LAYER_LINEARS -> PackedLinear


def skeleton(config: Any) -> tuple[Any, DecoderSpec]:
    """(the causal LM of ``config`` on the meta device, its spec); a ValueError when not supported."""
    import transformers

    try:
        with paused_gc(), torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as error:      # noqa: BLE001 - sizes transformers' checks let through (a negative head_dim...)
        raise ValueError(f"xlaunch.llm.from_pretrained: its config does not build a model ({error_line(error)})") from None
    spec = describe(model)
    if not isinstance(spec, DecoderSpec):
        raise ValueError(f"xlaunch.llm.from_pretrained: {spec}")
    return model.eval(), spec


def huge_empty(shape: Sequence[int], dtype: "torch.dtype") -> "torch.Tensor":
    """An uninitialized tensor; from 2 MiB up, in its own anonymous mapping advised to use 2 MiB pages."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(tuple(shape), dtype=dtype)
    rounded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    area = mmap.mmap(-1, rounded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # shared: no THP
    base = torch.frombuffer(area, dtype=torch.uint8)      # keeps ``area`` alive
    start = -base.data_ptr() % HUGE_PAGE
    if hasattr(area, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE, start, rounded)
    return base[start:start + nbytes].view(dtype).reshape(tuple(shape))


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):       # not glibc (musl, macOS): nothing to call
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    Streaming a checkpoint frees thousands of 1 MiB temporaries; once glibc's mmap threshold has risen
    they come from its heap, and the pages it keeps stay resident: about 90 MiB after Llama-3.2-1B's
    shape in INT8 on the AVX2 VM (peak RSS 1700 MiB, 1608 after a trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _parameter(tensor: "torch.Tensor") -> "torch.nn.Parameter":
    return torch.nn.Parameter(tensor, requires_grad=False)


def layer_weights(spec: DecoderSpec, parts: Parts) -> list[LayerWeights]:
    """What each layer computes with, from ``parts``."""
    return [LayerWeights(input_norm=parts.input_norms[index], post_attention_norm=parts.post_attention_norms[index],
                         qkv=linears["qkv"], out=linears["out"], gate_up=linears["gate_up"], down=linears["down"],
                         window=window)
            for index, (linears, window) in enumerate(zip(parts.linears, spec.windows))]


def runtime_of(spec: DecoderSpec, dtype: "torch.dtype", parts: Parts, rope: RopeTable) -> DecoderRuntime:
    """The runtime of ``parts`` alone, no Hugging Face model around it."""
    return DecoderRuntime(spec, dtype, parts.embed, layer_weights(spec, parts), parts.final_norm, parts.lm_head, rope)


def install(model: Any, spec: DecoderSpec, dtype: "torch.dtype", parts: Parts) -> Any:
    """Put ``parts`` into the meta ``model`` and give it :func:`~xlaunch.llm.optimize`'s runtime; returns it."""
    from xlaunch.llm.api import _Retired, attach

    inner = model.model
    for index, layer in enumerate(inner.layers):
        linears = parts.linears[index]
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj, attention.o_proj = linears["qkv"], linears["out"]
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, name, _Retired("self_attn.qkv_proj"))
        mlp.gate_up_proj, mlp.down_proj = linears["gate_up"], linears["down"]
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, _Retired("mlp.gate_up_proj"))
        layer.input_layernorm.weight = _parameter(parts.input_norms[index])
        layer.post_attention_layernorm.weight = _parameter(parts.post_attention_norms[index])
    inner.embed_tokens = TokenEmbedding(parts.embed, dtype, parts.lm_head)
    inner.norm.weight = _parameter(parts.final_norm)
    model.lm_head = parts.lm_head
    # the rotary module's inverse frequencies were made on the meta device: make them again, in fp32
    with torch.device("cpu"):
        rotary = type(inner.rotary_emb)(config=model.config).float()
    if hasattr(rotary, "original_inv_freq"):
        rotary.inv_freq = rotary.original_inv_freq.float().clone()
    inner.rotary_emb = rotary
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"xlaunch.llm.from_pretrained: no weights for {', '.join(left[:4])}")
    attach(model, runtime_of(spec, dtype, parts, RopeTable.of(rotary, spec.head_dim, dtype)))
    return model


def parts_of(model: Any) -> tuple[DecoderRuntime, Parts]:
    """(runtime, parts) of an optimized model (by :func:`~xlaunch.llm.optimize` or a loader)."""
    from xlaunch.llm.api import MARK

    runtime: Optional[DecoderRuntime] = getattr(model, MARK, None)
    if runtime is None:
        raise ValueError("xlaunch.llm.save_packed: the model is not optimized (call xlaunch.llm.optimize first)")
    layers = runtime.layers
    return runtime, Parts(
        embed=runtime.embed, final_norm=runtime.final_norm, lm_head=runtime.lm_head,
        input_norms=[l.input_norm for l in layers], post_attention_norms=[l.post_attention_norm for l in layers],
        linears=[{"qkv": l.qkv, "out": l.out, "gate_up": l.gate_up, "down": l.down} for l in layers])
