"""Fused optimizers: step-for-step equal to torch's reference, and split-bf16 bit-exact with an
fp32 master updated by the same kernel."""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
# these tests are about the arithmetic; the "bf16 is emulated here" warning has its own test
pytestmark = pytest.mark.filterwarnings("ignore::xlaunch.kernels.native_dtypes.EmulatedPrecisionWarning")

from xlaunch.kernels import optim  # noqa: E402
from xlaunch.kernels.optim.fused import (  # noqa: E402
    TRAIL_KEY,
    FusedAdagrad,
    FusedAdam,
    FusedAdamW,
    FusedLamb,
    FusedSGD,
    is_split,
    master_params,
    split_params,
    to_fused,
)

STEPS = 50

CASES = [
    (torch.optim.SGD, FusedSGD, dict(lr=0.05)),
    (torch.optim.SGD, FusedSGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.SGD, FusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    (torch.optim.SGD, FusedSGD, dict(lr=0.002, momentum=0.8, dampening=0.1, maximize=True)),
    (torch.optim.Adagrad, FusedAdagrad, dict(lr=0.05, lr_decay=1e-3, weight_decay=1e-2,
                                             initial_accumulator_value=0.1)),
    (torch.optim.Adam, FusedAdam, dict(lr=1e-2)),
    (torch.optim.Adam, FusedAdam, dict(lr=1e-2, amsgrad=True, weight_decay=1e-2, maximize=True)),
    (torch.optim.AdamW, FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, FusedAdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.9))),
]
IDS = [f"{ref.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for ref, _, kw in CASES]


def _model(seed: int = 0) -> "torch.nn.Module":
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batches(n: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(n)]


def _train(model, optimizer, batches, autocast: bool = False) -> list[float]:
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reference_cls,fused_cls,kwargs", CASES, ids=IDS)
def test_fused_matches_torch_step_for_step(reference_cls, fused_cls, kwargs) -> None:
    reference, fused = _model(), _model()
    ref_opt = reference_cls(reference.parameters(), foreach=False, **kwargs)
    fused_opt = fused_cls(fused.parameters(), **kwargs)
    assert isinstance(fused_opt, reference_cls)
    for x, y in _batches(STEPS):
        for model, opt in ((reference, ref_opt), (fused, fused_opt)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        for p_ref, p_fused in zip(reference.parameters(), fused.parameters()):
            torch.testing.assert_close(p_fused, p_ref, rtol=1e-4, atol=1e-5)  # FMA vs mul+add


@pytest.mark.parametrize("reference_cls,fused_cls,kwargs", CASES, ids=IDS)
def test_fused_is_bit_identical_to_torch_fused_kernel(reference_cls, fused_cls, kwargs) -> None:
    """Our fast path calls the same single-pass kernel torch's ``fused=True`` uses."""
    reference, fused = _model(), _model()
    ref_opt = reference_cls(reference.parameters(), fused=True, **kwargs)
    fused_opt = fused_cls(fused.parameters(), **kwargs)
    _train(reference, ref_opt, _batches(20))
    _train(fused, fused_opt, _batches(20))
    for p_ref, p_fused in zip(reference.parameters(), fused.parameters()):
        assert torch.equal(p_ref, p_fused)


def test_multiple_param_groups_and_params_without_grad() -> None:
    reference, fused = _model(), _model()
    frozen_before = fused[2].bias.detach().clone()

    def groups(model):
        return [{"params": [model[0].weight, model[0].bias], "lr": 0.1},
                {"params": [model[2].weight, model[2].bias], "momentum": 0.5}]

    reference[2].bias.requires_grad_(False)
    fused[2].bias.requires_grad_(False)
    ref_opt = torch.optim.SGD(groups(reference), lr=0.01, foreach=False)
    fused_opt = FusedSGD(groups(fused), lr=0.01)
    _train(reference, ref_opt, _batches(10))
    _train(fused, fused_opt, _batches(10))
    for p_ref, p_fused in zip(reference.parameters(), fused.parameters()):
        torch.testing.assert_close(p_fused, p_ref)
    assert torch.equal(fused[2].bias, frozen_before)
    assert fused[2].bias not in fused_opt.state


def test_closure_and_state_dict_round_trip() -> None:
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2, amsgrad=True)
    x, y = _batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor)
    twin = _model()
    twin.load_state_dict(model.state_dict())
    twin_opt = FusedAdam(twin.parameters(), lr=1e-2, amsgrad=True)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    batches = _batches(5, seed=7)
    _train(model, opt, batches)
    _train(twin, twin_opt, batches)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_lamb_matches_a_plain_reference() -> None:
    """LAMB against a direct per-tensor transcription of the algorithm."""
    model = _model()
    reference = _model()
    opt = FusedLamb(model.parameters(), lr=1e-2, weight_decay=0.01, max_trust_ratio=10.0)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.999), 1e-6, 0.01
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in reference.parameters()}
    for step, (x, y) in enumerate(_batches(STEPS), start=1):
        for m in (model, reference):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        with torch.no_grad():
            for p in reference.parameters():
                m, v = state[p]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps) + wd * p
                w_norm, u_norm = p.norm().item(), update.norm().item()
                trust = min(w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0, 10.0)
                p.add_(update, alpha=-lr * trust)
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_lamb_rejects_bad_hyperparameters() -> None:
    with pytest.raises(ValueError, match="betas"):
        FusedLamb(_model().parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        FusedLamb(_model().parameters(), lr=-1.0)


@pytest.mark.parametrize("reference_cls,fused_cls,kwargs", CASES[1:3] + CASES[4:6] + CASES[7:8], ids=IDS[1:3] + IDS[4:6] + IDS[7:8])
def test_split_bf16_is_bit_exact_with_an_fp32_master(reference_cls, fused_cls, kwargs) -> None:
    """A bf16 model trained with split masters == an fp32 master copy updated by the same fused
    kernel with the same (bf16, widened) gradients; the model's bf16 weights are its top halves."""
    model = _model()
    master = [p.detach().clone() for p in model.parameters()]
    opt = to_fused(reference_cls(model.parameters(), **kwargs), model, dtype=torch.bfloat16)
    master_params_ = [torch.nn.Parameter(t) for t in master]
    master_opt = fused_cls(master_params_, **kwargs)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(is_split(opt, p) for p in model.parameters())
    for x, y in _batches(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        for mp, p in zip(master_params_, model.parameters()):
            mp.grad = p.grad.float()
        opt.step()
        master_opt.step()
        for mp, joined, p in zip(master_params_, master_params(opt), model.parameters()):
            assert torch.equal(joined.view(torch.int32), mp.detach().view(torch.int32))
            assert torch.equal(p.detach().view(torch.int16), (mp.detach().view(torch.int32) >> 16).to(torch.int16))


def test_split_bf16_costs_four_bytes_per_parameter() -> None:
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    opt = to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    weight_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    trail_bytes = sum(opt.state[p][TRAIL_KEY].untyped_storage().nbytes() for p in model.parameters())
    assert weight_bytes == 2 * n and trail_bytes == 2 * n


def test_split_bf16_training_converges_like_fp32() -> None:
    fp32_model, bf16_model = _model(), _model()
    fp32_losses = _train(fp32_model, FusedAdamW(fp32_model.parameters(), lr=1e-2), _batches(40), autocast=True)
    opt = to_fused(torch.optim.AdamW(bf16_model.parameters(), lr=1e-2), bf16_model, dtype=torch.bfloat16)
    bf16_losses = []
    for x, y in _batches(40):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(bf16_model(x.bfloat16()).float(), y)
        loss.backward()
        opt.step()
        bf16_losses.append(loss.item())
    assert bf16_losses[-1] < bf16_losses[0] * 0.8
    assert abs(bf16_losses[-1] - fp32_losses[-1]) < 0.1 * fp32_losses[0]


def test_to_fused_keeps_groups_hyperparameters_and_state() -> None:
    model = _model()
    plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, plain, _batches(3))
    saved = copy.deepcopy(plain.state_dict())   # to_fused shares the state tensors with ``plain``
    fused = to_fused(plain)
    assert type(fused) is FusedSGD
    assert fused.param_groups[0]["lr"] == 0.05 and fused.param_groups[0]["momentum"] == 0.9
    for p in model.parameters():
        assert torch.equal(fused.state[p]["momentum_buffer"], plain.state[p]["momentum_buffer"])
    twin = copy.deepcopy(model)
    twin_plain = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9, foreach=False)
    twin_plain.load_state_dict(saved)
    batches = _batches(5, seed=3)
    _train(model, fused, batches)
    _train(twin, twin_plain, batches)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_to_fused_on_an_unknown_optimizer_warns_once_and_returns_it() -> None:
    model = _model()
    rmsprop = torch.optim.RMSprop(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert to_fused(rmsprop, model, dtype=torch.bfloat16) is rmsprop
    assert len(caught) == 1 and "RMSprop" in str(caught[0].message)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_to_fused_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError, match="dtype"):
        to_fused(torch.optim.SGD(_model().parameters(), lr=0.1), dtype=torch.float16)


def test_split_params_needs_a_fused_optimizer() -> None:
    with pytest.raises(TypeError, match="fused"):
        split_params(torch.optim.SGD(_model().parameters(), lr=0.1))


TENSOR_LR = {
    "sgd": lambda params: torch.optim.SGD(params, lr=torch.tensor(0.05), momentum=0.9, foreach=False),
    "adam": lambda params: torch.optim.Adam(params, lr=torch.tensor(0.01), foreach=False),
    "adamw": lambda params: torch.optim.AdamW(params, lr=torch.tensor(0.01), foreach=False),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=torch.tensor(0.05), foreach=False),
}


@pytest.mark.parametrize("name", sorted(TENSOR_LR))
def test_tensor_lr_takes_torchs_own_step_on_split_masters(name: str) -> None:
    """An option the fast path does not cover still gives the fp32-master result (Adam's own step
    raised ``KeyError: 'exp_avg'``: the state it found held only the low half)."""
    model = _model()
    master = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = to_fused(TENSOR_LR[name](model.parameters()), model, dtype=torch.bfloat16)
    master_opt = TENSOR_LR[name](master)
    for x, y in _batches(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        for mp, p in zip(master, model.parameters()):
            mp.grad = p.grad.float()
        opt.step()
        master_opt.step()
    for joined, mp in zip(master_params(opt), master):
        torch.testing.assert_close(joined, mp.detach(), rtol=0, atol=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_exports_are_lazy_from_the_package() -> None:
    import xlaunch.kernels as kernels

    assert kernels.FusedSGD is FusedSGD and kernels.FusedLamb is optim.FusedLamb
