"""Checkpoints of split-bf16 training for model shapes the resume tests' Net has not: frozen
parameters (in the optimizer, never stepped), a checkpoint before the first step, and parameters
tied between two modules (one tensor under two ``state_dict`` keys)."""
from __future__ import annotations

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from resume_helpers import OPTIMIZERS, differences, snapshot, train  # noqa: E402

from xlaunch.kernels import master_params  # noqa: E402
from xlaunch.kernels.optim.fused import TRAIL_KEY, is_split  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (tied), a trained and a frozen linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.out(torch.relu(self.hidden(h)) + self.frozen(h)).mean(1)


def _data(n: int) -> list:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 10, (4, 5), generator=gen), torch.randn(4, 10, generator=gen)) for _ in range(n)]


DATA = _data(4)


def _build(name: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied().train()
    model, optimizer = optimize(model, OPTIMIZERS[name](model.parameters()), dtype=torch.bfloat16,
                                force_bf16=True)
    assert is_split(optimizer, model.emb.weight) and is_split(optimizer, model.frozen.weight)
    return model, optimizer


def _checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_frozen_and_unstepped_split_parameters_checkpoint_copy_and_resume(name: str) -> None:
    """A split parameter with no optimizer state but its low half (frozen, or before the first
    step): torch's Adam raised ``KeyError: 'step'`` loading, deep-copying or unpickling it."""
    model, optimizer = _build(name, seed=0)
    before = snapshot(model, optimizer)
    optimizer.load_state_dict(optimizer.state_dict())                # a checkpoint before any step
    for twin in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        assert twin.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    train(model, optimizer, DATA[:2])
    assert torch.equal(master_params(optimizer)[3], before["master 3"].view(torch.float32).view(8, 8))  # frozen
    saved = _checkpoint(model, optimizer)
    after_two = snapshot(model, optimizer)
    copied = copy.deepcopy(optimizer)
    assert not differences({k: v for k, v in snapshot(model, copied).items() if k.startswith("state")},
                           {k: v for k, v in after_two.items() if k.startswith("state")})
    train(model, optimizer, DATA[2:])
    expected = snapshot(model, optimizer)

    fresh, fresh_optimizer = _build(name, seed=1)
    fresh.load_state_dict(saved["model"])
    fresh_optimizer.load_state_dict(saved["optimizer"])
    assert not differences(snapshot(fresh, fresh_optimizer), after_two)
    train(fresh, fresh_optimizer, DATA[2:])
    assert not differences(snapshot(fresh, fresh_optimizer), expected)


def test_a_split_checkpoint_with_frozen_parameters_loads_into_plain_torch() -> None:
    """The same checkpoint in a model and optimizer never optimized: the fp32 masters, and
    torch's own AdamW (which cannot take an entry without ``step``) trains on from it."""
    model, optimizer = _build("adamw", seed=0)
    train(model, optimizer, DATA[:2])
    saved = _checkpoint(model, optimizer)
    torch.manual_seed(1)
    plain = Tied().train()
    plain_optimizer = OPTIMIZERS["adamw"](plain.parameters())
    plain.load_state_dict(saved["model"])
    plain_optimizer.load_state_dict(saved["optimizer"])
    for master, p in zip(master_params(optimizer), plain.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master)
    train(plain, plain_optimizer, DATA[2:])


def test_tied_parameters_save_and_load_their_master_under_every_name() -> None:
    """``out.weight`` is ``emb.weight``: the checkpoint held the master under the first name and
    the truncated bf16 half under the second, so a plain model loading it ended with the bf16
    value (the second key loads last), and a plain fp32 checkpoint's second key replaced the
    master's top half with the fp32 value rounded to bf16."""
    model, optimizer = _build("sgd", seed=0)
    train(model, optimizer, DATA[:2])
    master = master_params(optimizer)[0]
    state = model.state_dict()
    assert state["out.weight"].dtype == torch.float32
    assert torch.equal(state["emb.weight"], master) and torch.equal(state["out.weight"], master)
    plain = Tied()
    plain.load_state_dict(state)
    assert torch.equal(plain.emb.weight.detach(), master) and plain.out.weight is plain.emb.weight

    torch.manual_seed(5)
    fp32 = Tied()
    fresh, fresh_optimizer = _build("sgd", seed=1)
    fresh.load_state_dict(fp32.state_dict())
    for loaded, p in zip(master_params(fresh_optimizer), fp32.parameters()):
        assert torch.equal(loaded, p.detach())
    old_style = dict(state, **{"out.weight": state["out.weight"].to(torch.bfloat16)})   # before this fix
    fresh.load_state_dict(old_style)
    assert torch.equal(master_params(fresh_optimizer)[0], master)
    assert TRAIL_KEY in fresh_optimizer.state[fresh.emb.weight]
