"""LLM decoding on CPUs: :func:`optimize` for Hugging Face decoder models (Llama, Mistral, Qwen2).

``xlaunch.llm.optimize(model, dtype=None, weights=None | "int8" | "int4")`` (dtype: bf16 where the CPU
has native bf16, else fp32; :func:`default_dtype`) returns the
same model object with its linear layers packed for the chosen precision (bf16, weight-only INT8
per output channel, weight-only INT4 group-wise with a 6-bit lm_head), fused RMSNorm and RoPE, a
preallocated KV cache and a forward that runs prefill and decode with few, fused calls per layer.
``model.generate`` works unchanged (one-beam greedy and sampling calls by xlaunch's own loop: the same
tokens). ``from_pretrained(path, ...)`` streams a safetensors checkpoint straight into
that packed form, and ``save_packed(model, path)`` writes it as one file that ``from_pretrained``
maps read-only, shared by every process that loads it. ``load_decoder(path)`` decodes from such a file with
torch alone (:mod:`xlaunch.llm.standalone`: no transformers, about 135 MiB less per process).
``import xlaunch.llm`` stays light: torch and transformers load on first use.
"""
from __future__ import annotations

from typing import Any

__all__ = ["optimize", "is_optimized", "default_dtype", "SUPPORTED_ARCHITECTURES", "PackedLinear", "from_pretrained",
           "save_packed", "load_decoder", "Decoder"]


def __getattr__(name: str) -> Any:
    if name in ("optimize", "is_optimized", "default_dtype", "SUPPORTED_ARCHITECTURES"):
        from xlaunch.llm import api as _api

        return getattr(_api, name)
    if name == "from_pretrained":
        from xlaunch.llm.loader import from_pretrained

        return from_pretrained
    if name == "save_packed":
        from xlaunch.llm.packed_file import save_packed

        return save_packed
    if name in ("load_decoder", "Decoder"):
        from xlaunch.llm import standalone

        return getattr(standalone, name)
    if name == "PackedLinear":
        from xlaunch.llm.linear import PackedLinear

        return PackedLinear
    raise AttributeError(f"module 'xlaunch.llm' has no attribute {name!r}")
