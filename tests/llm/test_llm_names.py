"""Every name xlaunch.llm and xlaunch.llm.api declare in ``__all__`` resolves from the package."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["xlaunch.llm", "xlaunch.llm.api"])
def test_every_declared_name_resolves_from_the_package(module):
    declared = importlib.import_module(module).__all__
    package = importlib.import_module("xlaunch.llm")
    missing = [name for name in declared if not hasattr(package, name)]
    assert not missing, f"{module}.__all__ names what xlaunch.llm does not give: {missing}"


def test_is_optimized_says_no_for_a_plain_module():
    import torch

    from xlaunch.llm import is_optimized

    assert is_optimized(torch.nn.Linear(2, 2)) is False


def test_a_decoding_run_starts_without_torchaos_import_noise():
    """transformers imports torchao, whose import logs CUDA-only library misses and pytree
    deprecations; importing xlaunch.llm first keeps stderr clean (a real, fresh process)."""
    import subprocess
    import sys

    program = ("import xlaunch.llm.api\n"
               "from transformers import LlamaConfig, LlamaForCausalLM\n"
               "LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
               "    num_attention_heads=4, num_key_value_heads=2, vocab_size=64))\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr, done.stderr
