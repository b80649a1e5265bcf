"""``to_fused(optimizer, model, dtype=torch.bfloat16)`` as docs/kernels.md writes it: the fp32
training loop runs unchanged, checkpoints hold fp32 masters, and a CPU that only emulates bf16
says so."""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels import master_params, native_dtypes, to_fused  # noqa: E402  (as documented)
from xlaunch.kernels.native_dtypes import EmulatedPrecisionWarning  # noqa: E402

pytestmark = pytest.mark.torch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).train()


def batches(n: int) -> list:
    """Inputs and a target the MLP can learn."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, 4, generator=gen)
    inputs = [torch.randn(16, 8, generator=gen) for _ in range(n)]
    return [(x, torch.tanh(x @ teacher)) for x in inputs]


def test_documented_recipe_trains_with_the_fp32_loop_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_dtypes, "isa_flags", lambda: frozenset({"avx512_bf16"}))   # no emulation warning
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = to_fused(torch.optim.AdamW(model.parameters(), lr=1e-2), model, dtype=torch.bfloat16)
    linear, norm = model[0], model[1]
    assert linear.weight.dtype == torch.bfloat16 and optimizer.state[linear.weight]["bf16_trail"].dtype == torch.int16
    assert norm.weight.dtype == torch.float32   # batch_norm takes bf16 inputs with fp32 parameters only
    losses = []
    for x, y in batches(20):            # fp32 inputs, targets and loss: the loop of the fp32 model
        optimizer.zero_grad()
        out = model(x)
        assert out.dtype == torch.float32
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    state = model.state_dict()           # checkpoints hold the fp32 masters, bit for bit
    trained = [state[name] for name, _ in model.named_parameters()]
    assert all(t.dtype == torch.float32 for t in trained)
    assert all(torch.equal(a, b) for a, b in zip(trained, master_params(optimizer)))
    plain = mlp()
    plain.load_state_dict(state)
    twin = copy.deepcopy(model)          # a copy runs its own parameters
    with torch.no_grad():
        x = batches(1)[0][0]
        model.eval(), twin.eval(), plain.eval()
        torch.testing.assert_close(twin(x), model(x))
        torch.testing.assert_close(model(x), plain(x), rtol=0.05, atol=0.05)   # bf16 halves vs fp32 masters


def test_emulated_bf16_is_said_once_and_not_under_force_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_dtypes, "isa_flags", lambda: frozenset({"avx2", "fma"}))
    model = mlp()
    with pytest.warns(EmulatedPrecisionWarning, match="neither AVX512_BF16 nor AMX_BF16, so bf16 .* emulated") as caught:
        to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    assert len(caught) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_fused(torch.optim.SGD(mlp().parameters(), lr=0.1), dtype=torch.bfloat16)
    assert [w.category for w in caught] == [EmulatedPrecisionWarning, UserWarning]
    assert "without the model: its parameters are bf16 now, so run its forward under" in str(caught[1].message)

    from xlaunch.kernels.optimize import dispatch, precision
    from xlaunch.kernels.optimize.pipeline import optimize

    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx2"}))
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedPrecisionWarning)   # force_bf16 knows it is emulated
        model, optimizer = optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                                    force_bf16=True)
    assert type(optimizer).__name__ == "FusedSGD" and dispatch.of(model) is not None   # optimize's own autocast forward
    assert model(batches(1)[0][0]).dtype == torch.float32


def test_a_model_made_channels_last_after_the_split_trains_its_masters() -> None:
    """``model.to(memory_format=torch.channels_last)`` after ``to_fused``: the same masters and
    checkpoint, step for step, as the model made channels-last before it (same gradients)."""
    def conv_net(channels_last_before: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).train()
        if channels_last_before:
            model.to(memory_format=torch.channels_last)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulatedPrecisionWarning)
            optimizer = to_fused(torch.optim.AdamW(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
        return model.to(memory_format=torch.channels_last), optimizer

    (before, before_optimizer), (after, after_optimizer) = conv_net(True), conv_net(False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, q in zip(before.parameters(), after.parameters()):
            grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            p.grad, q.grad = torch.empty_like(p).copy_(grad), torch.empty_like(q).copy_(grad)
        before_optimizer.step()
        after_optimizer.step()
        for master, other in zip(master_params(before_optimizer), master_params(after_optimizer)):
            assert torch.equal(master.contiguous().view(torch.int32), other.contiguous().view(torch.int32))
        expected, got = before.state_dict(), after.state_dict()
        assert all(torch.equal(expected[key], got[key]) for key in expected)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "split-bf16"])
def test_a_model_made_channels_last_between_steps_keeps_its_momentum_on_its_elements(dtype) -> None:
    """torch's fused kernels pair a parameter and its state in memory order: a model made
    channels-last after a step (contiguous moments) had its moments applied to other elements
    (masters off by 0.25 here). Each step gives the state its parameter's layout, as optimize()
    does for an optimizer it is handed (layout.match_optimizer_state)."""
    from xlaunch.kernels.optimize.layout import match_optimizer_state

    def run(relay_by_hand: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulatedPrecisionWarning)
            optimizer = to_fused(torch.optim.AdamW(model.parameters(), lr=0.1), model, dtype=dtype)
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            if step == 1:
                model.to(memory_format=torch.channels_last)
                if relay_by_hand:
                    assert match_optimizer_state(optimizer) > 0
            for p in model.parameters():
                p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen))
            optimizer.step()
        return [m.contiguous().view(torch.int32) for m in master_params(optimizer)]

    assert all(torch.equal(got, expected) for got, expected in zip(run(False), run(True)))


def test_a_model_cast_to_bf16_before_is_said_to_train_without_masters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model made bf16 (or fp16) before ``to_fused``/``optimize(dtype=torch.bfloat16)`` has no fp32
    master to split: it trained in plain bf16 (updates below half an ulp lost) and nothing said so, the
    optimize report included."""
    from xlaunch.kernels.optimize.notes import OptimizeWarning
    from xlaunch.kernels.optimize.pipeline import optimize

    monkeypatch.setattr(native_dtypes, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).bfloat16()
    with pytest.warns(UserWarning, match=r"4 of the optimizer's parameters are already bfloat16: trained in "
                                         r"that precision, without fp32 master weights"):
        to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    model[0].half()
    with pytest.warns(OptimizeWarning, match=r"4 of the optimizer's parameters are already 2 float16 and 2 bfloat16"):
        optimized, _ = optimize(model.train(), torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                                force_bf16=True, progress=False)
    assert any("without fp32 master weights" in w for w in optimized._xlaunch_optimize_report.warnings)
    model = mlp()                                           # fp32: split, no such warning; again: already split
    optimizer = to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_fused(optimizer, model, dtype=torch.bfloat16)
