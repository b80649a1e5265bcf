"""Tiny random Hugging Face decoders for tests/llm (built from configs: no download)."""
from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 512


def tiny(architecture: str = "llama", seed: int = 0, **overrides):
    """A random-weight causal LM (hidden 128, 2 layers, 4 heads over 2 KV heads) in fp32, eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    common.update(overrides)
    if architecture == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif architecture == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise ValueError(architecture)
    return model.eval()


def clone(model):
    return copy.deepcopy(model)


def prompts(batch: int, length: int, seed: int = 1):
    """(input_ids, attention_mask): rows left-padded to ``length`` with decreasing real lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        pad = min(length - 1, row * max(1, length // 8))
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def relative_error(logits, reference) -> float:
    """max |logits - reference| / max |reference| over every position and vocabulary entry."""
    return float((logits.float() - reference.float()).abs().max() / reference.float().abs().max())


def read_manifest(path: Path) -> dict:
    """The manifest of a packed file."""
    data = path.read_bytes()
    return json.loads(data[16:16 + struct.unpack("<Q", data[8:16])[0]])


def rewrite_manifest(source: Path, target: Path, change) -> Path:
    """A copy of a packed file with its manifest changed (the tensors stay where they were)."""
    data = bytearray(source.read_bytes())
    length = struct.unpack("<Q", data[8:16])[0]
    manifest = json.loads(data[16:16 + length])
    first = min(entry["offset"] for entry in manifest["tensors"].values())
    change(manifest)
    header = json.dumps(manifest).encode()
    assert 16 + len(header) <= first
    data[16:16 + length] = b" " * length
    data[8:16] = struct.pack("<Q", len(header))
    data[16:16 + len(header)] = header
    target.write_bytes(bytes(data))
    return target
