"""Which Hugging Face decoders :func:`xlaunch.llm.optimize` knows, read into a plain description.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (transformers 5)
whose layers have the standard shape: q/k/v/o and gate/up/down ``nn.Linear``, two RMSNorms, SiLU,
and a RoPE whose frequencies do not depend on the sequence length. Anything else gets a reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of a supported decoder."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    eps: float
    windows: tuple[Optional[int], ...]     # sliding window per layer, None: full attention
    rope_type: str
    tied_embeddings: bool


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict):
        return str(params.get("rope_type") or params.get("type") or "default")
    return "default"


def _window(model: Any, config: Any, index: int, attention: Any) -> Optional[int]:
    if hasattr(attention, "sliding_window"):
        window = attention.sliding_window
    elif type(model).__name__.startswith("Mistral"):
        window = getattr(config, "sliding_window", None)
    else:
        window = None
    return int(window) if window else None


def describe(model: Any) -> Union[DecoderSpec, str]:
    """The model's :class:`DecoderSpec`, or a one-line reason it is not supported."""
    import torch

    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return f"{name} is not a supported architecture ({', '.join(SUPPORTED_ARCHITECTURES)})"
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if config is None or layers is None or not hasattr(model, "lm_head"):
        return f"{name} lacks the config, model.layers or lm_head of a Hugging Face decoder"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"{name} uses hidden_act={config.hidden_act!r}; only silu is supported"
    rope = _rope_type(config)
    if rope in LENGTH_DEPENDENT_ROPE:
        return f"{name} uses the {rope!r} RoPE, whose frequencies change with the sequence length"
    linears = [model.lm_head]
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [getattr(attention, part, None) for part in ATTENTION_PARTS] + [getattr(mlp, p, None) for p in MLP_PARTS]
        if not all(isinstance(part, torch.nn.Linear) for part in parts):
            return f"{name}'s layers are not the standard q/k/v/o + gate/up/down nn.Linear (already optimized?)"
        if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return f"{name} normalizes queries and keys (q_norm/k_norm), which is not supported"
        linears += parts
    if not isinstance(model.lm_head, torch.nn.Linear) or model.lm_head.bias is not None:
        return f"{name}'s lm_head is not a bias-free nn.Linear"
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads or head_dim % 2:
        return f"{name} has {heads} heads over {kv_heads} KV heads of size {head_dim}: not supported"
    windows = tuple(_window(model, config, i, layer.self_attn) for i, layer in enumerate(layers))
    return DecoderSpec(
        architecture=name, num_layers=len(layers), hidden_size=config.hidden_size, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size, eps=float(getattr(config, "rms_norm_eps", 1e-6)), windows=windows,
        rope_type=rope, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
