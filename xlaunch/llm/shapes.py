"""Decoder shapes: which Hugging Face decoders :func:`xlaunch.llm.optimize` knows (read into a plain
:class:`DecoderSpec`), and presets of real decoders' configs for examples/llm.py and bench/llm.py.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (transformers 5)
whose layers have the standard shape: q/k/v/o and gate/up/down ``nn.Linear``, two RMSNorms, SiLU,
and a RoPE whose frequencies do not depend on the sequence length. Anything else gets a reason.

The presets (random weights written as a safetensors checkpoint one slice at a time, and a cache for
the big ones) are the published ``config.json`` values of the Hugging Face models (the files in
``meta-llama/Llama-3.2-1B``, ``meta-llama/Llama-3.2-3B``, ``Qwen/Qwen2.5-0.5B``,
``Qwen/Qwen2.5-1.5B`` and ``mistralai/Mistral-7B-v0.1``; the fields a decoder's shape depends on,
token ids and ``torch_dtype`` included), so a preset's checkpoint loads in transformers and
converts with llama.cpp as the real one does. No weight is downloaded: :func:`write_checkpoint`
fills every tensor from a seeded generator (normal(0, initializer_range) as transformers
initialises them, norms 1, biases 0). Nothing here imports torch until a checkpoint is written.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

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
    if not len(layers):
        return f"{name} has no decoder layers (num_hidden_layers={getattr(config, 'num_hidden_layers', None)!r})"
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


def record_spec(record: Any, max_layers: int) -> Optional[DecoderSpec]:
    """The :class:`DecoderSpec` a JSON record of it (``dataclasses.asdict``) holds, or None when any field is
    missing, extra, of another type or out of range (at most ``max_layers`` layers)."""
    fields = {field.name for field in dataclasses.fields(DecoderSpec)}
    if not isinstance(record, dict) or set(record) != fields:
        return None
    sizes = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
    windows, eps = record["windows"], record["eps"]
    ok = (record["architecture"] in SUPPORTED_ARCHITECTURES
          and all(type(record[name]) is int and record[name] > 0 for name in sizes)
          and record["num_layers"] <= max_layers and record["num_heads"] % record["num_kv_heads"] == 0
          and record["head_dim"] % 2 == 0 and type(eps) in (int, float) and math.isfinite(eps) and eps > 0
          and isinstance(windows, list) and len(windows) == record["num_layers"]
          and all(w is None or (type(w) is int and w > 0) for w in windows)
          and isinstance(record["rope_type"], str) and record["rope_type"] not in LENGTH_DEPENDENT_ROPE
          and type(record["tied_embeddings"]) is bool)
    return DecoderSpec(**dict(record, eps=float(eps), windows=tuple(windows))) if ok else None


# -- presets --------------------------------------------------------------------------------------
# Llama 3.2 (1B, 3B): meta-llama/Llama-3.2-{1B,3B}/config.json
_LLAMA32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
                hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-05, max_position_embeddings=131072,
                rope_theta=500000.0, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                tie_word_embeddings=True, vocab_size=128256, bos_token_id=128000, eos_token_id=128001,
                torch_dtype="bfloat16")
# Qwen2.5 (0.5B, 1.5B): Qwen/Qwen2.5-{0.5B,1.5B}/config.json (q/k/v have biases in every Qwen2)
_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", initializer_range=0.02,
               rms_norm_eps=1e-06, rope_theta=1000000.0, use_sliding_window=False, use_mrope=False,
               tie_word_embeddings=True, vocab_size=151936, bos_token_id=151643, eos_token_id=151643,
               torch_dtype="bfloat16")

PRESETS: dict[str, dict[str, Any]] = {
    # bench/llm.py's and examples/llm.py's model until these presets came: a random 168M Llama
    "llama-168m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
                       intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                       head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-06, rope_theta=10000.0,
                       initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       torch_dtype="float32"),
    # examples/llm.py --tiny: seconds to build and run (tests)
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
                 intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-06, rope_theta=10000.0,
                 initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 torch_dtype="float32"),
    "llama-3.2-1b": dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-3.2-3b": dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         max_window_layers=24, sliding_window=32768),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                         max_window_layers=28, sliding_window=131072),
    # mistralai/Mistral-7B-v0.1/config.json
    "mistral-7b-v0.1": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu",
                            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-05,
                            rope_theta=10000.0, sliding_window=4096, initializer_range=0.02,
                            tie_word_embeddings=False, vocab_size=32000, bos_token_id=1, eos_token_id=2,
                            torch_dtype="bfloat16"),
}
DEFAULT = "llama-168m"
CACHE_FROM_BYTES = 256 << 20      # checkpoints from this size up are cached (smaller ones: a temporary folder)
WRITER_VERSION = 1                # part of the cache key: bump when the written values change
CHUNK_BYTES = 64 << 20            # fp32 bytes generated at a time
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class ShapeError(ValueError):
    """An unknown preset name or an unusable config.json (the message is one line)."""


def preset(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s config; :class:`ShapeError` naming the presets when there is none."""
    if name not in PRESETS:
        raise ShapeError(f"--shape: unknown shape {name!r} (presets: {', '.join(PRESETS)})")
    return json.loads(json.dumps(PRESETS[name]))


def read_config(folder: Any) -> dict[str, Any]:
    """A checkpoint directory's ``config.json`` (json only: no transformers), checked to have a decoder's sizes."""
    from xlaunch.userfiles import UserFileError, read_user_text

    path = Path(folder) / "config.json"
    try:
        config = json.loads(read_user_text(str(path)))   # a regular file of at most 1 MiB
    except UserFileError as error:
        raise ShapeError(f"--model: {error}") from None
    except ValueError as error:
        raise ShapeError(f"--model: cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ShapeError(f"--model: {path} holds no JSON object (not a decoder's config)")
    missing = [key for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if not isinstance(config.get(key), int)]
    if missing:
        raise ShapeError(f"--model: {path} lacks {', '.join(missing)} (not a decoder's config)")
    return config


class Shape:
    """A decoder's sizes read from a config dict: tensor shapes, parameter count."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.hidden, self.intermediate = config["hidden_size"], config["intermediate_size"]
        self.layers, self.heads = config["num_hidden_layers"], config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.vocab = config["vocab_size"]
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.qkv_bias = config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False))
        self.o_bias = config.get("model_type") != "qwen2" and bool(config.get("attention_bias", False))
        self.mlp_bias = bool(config.get("mlp_bias", False))
        self.dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")

    def linears(self) -> dict[str, tuple[int, int]]:
        """One layer's linears as ``{name: (out_features, in_features)}``, q/k/v and gate/up apart."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"self_attn.q_proj": (q, self.hidden), "self_attn.k_proj": (kv, self.hidden),
                "self_attn.v_proj": (kv, self.hidden), "self_attn.o_proj": (self.hidden, q),
                "mlp.gate_proj": (self.intermediate, self.hidden), "mlp.up_proj": (self.intermediate, self.hidden),
                "mlp.down_proj": (self.hidden, self.intermediate)}

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """Every tensor of the checkpoint in file order: (name, shape, how it is filled: normal, ones, zeros)."""
        yield "model.embed_tokens.weight", (self.vocab, self.hidden), "normal"
        for index in range(self.layers):
            prefix = f"model.layers.{index}"
            yield f"{prefix}.input_layernorm.weight", (self.hidden,), "ones"
            for name, (n, k) in self.linears().items():
                yield f"{prefix}.{name}.weight", (n, k), "normal"
                bias = (self.qkv_bias and name[-6:] in ("q_proj", "k_proj", "v_proj")) or \
                    (self.o_bias and name.endswith("o_proj")) or (self.mlp_bias and name.startswith("mlp."))
                if bias:
                    yield f"{prefix}.{name}.bias", (n,), "zeros"
            yield f"{prefix}.post_attention_layernorm.weight", (self.hidden,), "ones"
        yield "model.norm.weight", (self.hidden,), "ones"
        if not self.tied:
            yield "lm_head.weight", (self.vocab, self.hidden), "normal"

    def parameters(self) -> int:
        """Parameters as ``model.parameters()`` counts them (a tied lm_head once)."""
        total = 0
        for _, shape, _ in self.tensors():
            count = 1
            for size in shape:
                count *= size
            total += count
        return total


def cache_dir() -> Path:
    """``$XLAUNCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch`` (as bench/_llamacpp.py)."""
    base = os.environ.get("XLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "xlaunch")
    return Path(base)


def checkpoint_key(config: dict[str, Any], seed: int) -> str:
    text = json.dumps({"config": config, "seed": seed, "writer": WRITER_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cached_checkpoint(name: str, seed: int = 0) -> Path:
    """Where preset ``name``'s checkpoint of ``seed`` is cached (whether or not it is written yet)."""
    return cache_dir() / "llm-shapes" / f"{name}-seed{seed}-{checkpoint_key(preset(name), seed)}"


def checkpoint_bytes(config: dict[str, Any]) -> int:
    shape = Shape(config)
    return shape.parameters() * DTYPE_BYTES.get(shape.dtype, 4)


def _header(shape: Shape) -> bytes:
    """The safetensors header of ``shape``'s tensors in ``shape.dtype``, padded to 8 bytes."""
    size, offset, entries = DTYPE_BYTES[shape.dtype], 0, {}
    for name, dims, _ in shape.tensors():
        count = 1
        for dim in dims:
            count *= dim
        entries[name] = {"dtype": SAFETENSORS_NAMES[shape.dtype], "shape": list(dims),
                         "data_offsets": [offset, offset + count * size]}
        offset += count * size
    entries["__metadata__"] = {"format": "pt"}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_checkpoint(folder: Any, config: dict[str, Any], seed: int = 0) -> Path:
    """``config.json`` and ``model.safetensors`` of random weights under ``folder``, written one slice of
    at most :data:`CHUNK_BYTES` at a time (the model is never in memory); the folder is made whole or not at all."""
    import torch

    shape = Shape(config)
    if shape.dtype not in SAFETENSORS_NAMES:
        raise ShapeError(f"cannot write a checkpoint of torch_dtype {shape.dtype!r}")
    folder = Path(folder)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, shape.dtype)
    std = float(config.get("initializer_range", 0.02))
    with open(partial / "model.safetensors", "wb") as out:
        out.write(_header(shape))
        for name, dims, fill in shape.tensors():
            row = 1
            for dim in dims[1:]:
                row *= dim
            step = max(1, CHUNK_BYTES // (4 * row))
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            for start in range(0, dims[0], step):
                rows = (min(dims[0], start + step) - start, *dims[1:])
                if fill == "normal":
                    chunk = torch.empty(rows).normal_(0.0, std, generator=generator)
                else:
                    chunk = torch.ones(rows) if fill == "ones" else torch.zeros(rows)
                out.write(memoryview(chunk.to(dtype).contiguous().view(torch.uint8).numpy()))
    (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    try:
        partial.rename(folder)
    except OSError:                      # another process finished it first
        if not (folder / "model.safetensors").is_file():
            raise
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    return folder


def ensure_checkpoint(name: str, seed: int = 0, scratch: Optional[Any] = None) -> Path:
    """Preset ``name``'s checkpoint: cached from :data:`CACHE_FROM_BYTES` up (written once, under a lock,
    so instances started together write it once), else written under ``scratch`` (a temporary folder)."""
    config = preset(name)
    if checkpoint_bytes(config) < CACHE_FROM_BYTES and scratch is not None:
        return write_checkpoint(Path(scratch) / name, config, seed)
    folder = cached_checkpoint(name, seed)
    if (folder / "model.safetensors").is_file():
        return folder
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "model.safetensors").is_file():
            print(f"writing the {name} checkpoint (random weights, seed {seed}) to {folder}", flush=True)
            write_checkpoint(folder, config, seed)
    return folder
