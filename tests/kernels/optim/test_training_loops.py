"""The fused optimizers driven as real training scripts drive torch's: GradScaler, several
optimizers on one model, ... step for step against torch's own optimizer."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore::xlaunch.kernels.native_dtypes.EmulatedPrecisionWarning")

from xlaunch.kernels.optim.fused import (  # noqa: E402
    FusedAdagrad,
    FusedAdam,
    FusedAdamW,
    FusedSGD,
    master_params,
    to_fused,
)

PAIRS = [
    (torch.optim.SGD, FusedSGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.Adagrad, FusedAdagrad, dict(lr=0.1)),
    (torch.optim.Adam, FusedAdam, dict(lr=0.01, amsgrad=True)),
    (torch.optim.AdamW, FusedAdamW, dict(lr=0.01)),
]
IDS = [ref.__name__ for ref, _, _ in PAIRS]


def _model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _loss(model, i: int, autocast: bool = False) -> "torch.Tensor":
    generator = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(5, 8, generator=generator), torch.randn(5, 3, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    return ((out.float() - y) ** 2).mean()


def _scaled_run(cls, kwargs: dict) -> tuple[list, float]:
    model = _model()
    optimizer = cls(model.parameters(), **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    history = []
    for i in range(4):
        optimizer.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        if i == 2:   # an overflow: that step is skipped and the scale halved
            model[0].weight.grad[0, 0] = float("inf")
        if i == 3:   # unscale_ then clip, as torch's AMP recipe does
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, scaler.get_scale()


@pytest.mark.parametrize("fused_flag", [None, True], ids=["default", "fused=True"])
@pytest.mark.parametrize("reference_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_grad_scaler_steps_as_torch(reference_cls, fused_cls, kwargs, fused_flag) -> None:
    """With ``fused=True`` torch's GradScaler leaves unscaling and the inf skip to the step: ours
    got the gradients still multiplied by the scale (an SGD update 1024x too large)."""
    kwargs = dict(kwargs, fused=fused_flag)
    (want, want_scale), (got, got_scale) = _scaled_run(reference_cls, kwargs), _scaled_run(fused_cls, kwargs)
    assert got_scale == want_scale == 512.0
    for step, (a, b) in enumerate(zip(want, got)):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=f"step {step}")
