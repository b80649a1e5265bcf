"""Tiny models for the engine cache's key tests, imported by the tests and by their subprocess
(one module name in both, as a user's program imports its model)."""
from __future__ import annotations

import torch
from torch import nn

SCALE = 2.0


def helper(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


class Comprehensions(nn.Module):
    """A forward with a comprehension, a generator, a lambda and a set constant: code objects in
    its constants (their repr holds an address)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.act = lambda t: torch.relu(t) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [layer(x) for layer in self.layers]
        total = sum(p for p in parts)
        if "mode" in {"mode", "other"}:
            total = helper(total)
        return self.act(total)


def encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).eval()


def comprehensions() -> nn.Module:
    torch.manual_seed(0)
    return Comprehensions().eval()


def keys() -> dict:
    """The key of each model, as optimize computes it (routes, threads and ISA fixed)."""
    from xlaunch.kernels.optimize.engines.cache import model_key
    from xlaunch.kernels.optimize.engines.sample import Sample

    out = {}
    for name, make, x in (("encoder", encoder, torch.randn(2, 5, 16)), ("comprehensions", comprehensions, torch.randn(3, 8))):
        model = make()
        out[name] = model_key(model, Sample(model, x).spec, ("eager", "onnxruntime"), 1, "avx2", "O1", {})
    return out
