"""What ipex's ``test_load_after_optimize`` checks (tests/cpu/test_ipex_optimize.py), in our own
test: for O0 and O1, fp32 and bf16, training parameters have the asked dtype (ipex's O0 makes them
bf16 with fp32 masters when given ``dtype=torch.bfloat16``), a model and optimizer checkpoint taken
after two steps and loaded after two more gives the parameters and state back, and the training
checkpoint loads into an inference model optimized with the same dtype and level.

bf16 is forced (``force_bf16=True``): without AVX512_BF16/AMX_BF16 ``optimize`` keeps fp32 unless
told (docs/kernels.md), where ipex always converts.
"""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optim.fused import FusedLamb, is_split, master_params  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),
    "lamb": lambda params: FusedLamb(params, lr=0.1),
}


class Model(nn.Module):
    """ipex's test model (conv, linear, transposed conv), small."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.linear = nn.Linear(6, 6)
        self.conv_transpose2d = nn.ConvTranspose2d(2, 2, 3)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
        return self.conv(x1).sum() + self.linear(x2).sum() + self.conv_transpose2d(x3)


def inputs() -> tuple:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(1, 3, 8, 8, generator=gen), torch.randn(5, 6, generator=gen),
            torch.randn(2, 2, 3, 3, generator=gen))


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        model(*inputs()).sum().backward()
        optimizer.step()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.detach().reshape(-1).view(torch.uint8),
                                              b.detach().reshape(-1).view(torch.uint8))


def tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for group in optimizer.param_groups for p in group["params"]
            for _, value in sorted(optimizer.state[p].items()) if isinstance(value, torch.Tensor)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("level", ["O0", "O1"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_load_after_optimize(name: str, level: str, dtype: torch.dtype) -> None:
    inplace = (name in ("adam", "lamb", "sgd")) == (level == "O0")   # both, across the cases
    torch.manual_seed(0)
    model = Model().train()
    model, optimizer = optimize(model, OPTIMIZERS[name](model.parameters()), dtype=dtype, level=level,
                                inplace=inplace, force_bf16=True)
    assert [p.dtype for p in model.parameters()] == [dtype] * 6   # ipex: "dtype do not match" at O0
    assert all(is_split(optimizer, p) == (dtype == torch.bfloat16) for p in model.parameters())

    steps(model, optimizer, 2)
    ref_params = [p.detach().clone() for p in model.parameters()]
    ref_masters = master_params(optimizer)
    ref_model_state = copy.deepcopy(model.state_dict())
    ref_optimizer_state = copy.deepcopy(optimizer.state_dict())
    ref_tensors = [t.clone() for t in tensors(optimizer)]

    steps(model, optimizer, 2)
    assert not any(same_bits(a, b) for a, b in zip(model.parameters(), ref_params))
    model.load_state_dict(ref_model_state)
    optimizer.load_state_dict(ref_optimizer_state)
    assert all(same_bits(a, b) for a, b in zip(model.parameters(), ref_params))
    assert all(same_bits(a, b) for a, b in zip(master_params(optimizer), ref_masters))
    assert all(same_bits(a, b) for a, b in zip(tensors(optimizer), ref_tensors))
    state = model.state_dict()
    assert state.keys() == ref_model_state.keys()
    assert all(same_bits(state[key], ref_model_state[key]) for key in state)   # fp32 masters

    torch.manual_seed(1)
    inference = optimize(Model().eval(), dtype=dtype, level=level, inplace=inplace, force_bf16=True)
    assert [p.dtype for p in inference.parameters()] == [dtype] * 6
    inference.load_state_dict(ref_model_state)
    loaded = inference.state_dict()
    for key, master in ref_model_state.items():   # saved in the original dtype: the master, rounded to dtype
        assert same_bits(loaded[key], master.to(dtype).float())
    for trained, served in zip(model.parameters(), inference.parameters()):
        # the inference weight rounds the master to nearest; the training one is the master truncated
        # (split-bf16's top half): equal in fp32, at most one bf16 ulp apart in bf16
        torch.testing.assert_close(served, trained, rtol=0 if dtype == torch.float32 else 2.0**-7, atol=0)


def test_an_optimizer_without_a_fused_version_keeps_fp32_parameters() -> None:
    """ipex's O0 gives any optimizer bf16 parameters with fp32 masters (a non-fused master update);
    xlaunch's masters need a fused optimizer, so another optimizer keeps fp32 parameters (trained
    under bf16 autocast) and says so: the case where ipex's test and ours differ (docs/kernels.md)."""
    model = Model().train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = optimize(model, torch.optim.RMSprop(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                                    level="O0", force_bf16=True)
    assert type(optimizer) is torch.optim.RMSprop
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any("no fused version of RMSprop" in str(w.message) for w in caught)
    steps(model, optimizer, 1)
