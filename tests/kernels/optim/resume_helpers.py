"""A tiny training run for the resume tests (imported by the test and by its second process)."""
from __future__ import annotations

import io
from typing import Any, Callable

import torch
from torch import nn

from xlaunch.kernels import master_params
from xlaunch.kernels.optim.fused import FusedLamb, is_split
from xlaunch.kernels.optimize.pipeline import optimize

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
    "lamb": lambda params: FusedLamb(params, lr=1e-2),
}


class Net(nn.Module):
    """A conv (channels-last under optimize), a BatchNorm (its parameters stay fp32) and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 2, 5, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(n)]


def build(name: str, split: bool, inplace: bool, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer ``optimize`` makes: split-bf16 (forced, emulated or not) or fp32."""
    torch.manual_seed(seed)
    model = Net().train()
    optimizer = OPTIMIZERS[name](model.parameters())
    model, optimizer = optimize(model, optimizer, dtype=torch.bfloat16 if split else None, inplace=inplace,
                                force_bf16=True)
    assert is_split(optimizer, model.conv.weight) == split and not is_split(optimizer, model.norm.weight)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).clone().view(torch.uint8)   # a copy: not a view of live memory


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer, fp32 master and optimizer-state tensor, as raw bytes."""
    found = {f"param {name} {p.dtype}": _bits(p) for name, p in model.named_parameters()}
    found.update({f"buffer {name}": _bits(b) for name, b in model.named_buffers()})
    found.update({f"master {i}": _bits(m) for i, m in enumerate(master_params(optimizer))})
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                found[f"state {i} {key} {value.dtype}"] = _bits(value)
    return found


def differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    if got.keys() != expected.keys():
        return [f"entries differ: {sorted(got.keys() ^ expected.keys())}"]
    return [key for key in expected if not torch.equal(got[key], expected[key])]


def checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def resume(model: nn.Module, optimizer: torch.optim.Optimizer, data: bytes) -> None:
    state = torch.load(io.BytesIO(data), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
