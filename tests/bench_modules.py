"""``load(name)``: bench/<name>.py imported as module ``bench_<name>`` (once per process), for the
tests of the benches' own logic."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str):
    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    if str(BENCH) not in sys.path:        # bench modules import their siblings (_llamacpp, _procmem, ...)
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tiny_packed(folder: Path, weights: str, group_size: int = 128) -> tuple[Path, Path]:
    """(a tiny random Llama checkpoint, its packed file in fp32 activations at ``weights``) under ``folder``, for
    the LLM benches' live tests; skips without torch or transformers."""
    import pytest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import xlaunch.llm

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "checkpoint")
    model = xlaunch.llm.from_pretrained(folder / "checkpoint", dtype=torch.float32, weights=weights,
                                        group_size=group_size)
    return folder / "checkpoint", xlaunch.llm.save_packed(model, folder / f"xlaunch-{weights}.xlp")
