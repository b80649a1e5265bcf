"""Copies of a split-bf16 model: ``copy.deepcopy`` (the "keep the best model" pattern), with or
without its optimizer, a pickle of the model, and a new optimizer over an optimized model or its
copy. The fp32 masters' low halves live in the optimizer; the model's checkpoint hooks lost them
on a copy (its ``state_dict`` gave the truncated bf16 values)."""
from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from resume_helpers import batches, build, checkpoint, differences, resume, snapshot, train  # noqa: E402

from xlaunch.kernels import master_params  # noqa: E402
from xlaunch.kernels.optim.fused import is_split  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

DATA = batches(4)


def _frozen(state: dict) -> dict[str, torch.Tensor]:
    """A state_dict as raw bytes with its dtype (a copy: not a view of live memory)."""
    return {f"{key} {value.dtype}": value.detach().reshape(-1).clone().view(torch.uint8)
            for key, value in state.items()}


def _masters_saved(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    state = model.state_dict()
    names = [name for name, _ in model.named_parameters()]
    return all(torch.equal(state[name], master) for name, master in zip(names, master_params(optimizer)))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_deep_copy_keeps_the_masters_of_its_moment_and_a_copied_pair_trains_on(name: str) -> None:
    model, optimizer = build(name, split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:2])
    at_copy = _frozen(model.state_dict())
    saved = checkpoint(model, optimizer)
    best = copy.deepcopy(model)
    pair = copy.deepcopy({"model": model, "optimizer": optimizer})    # model copied first
    reverse = copy.deepcopy((optimizer, model))                       # optimizer first
    buffer = io.BytesIO()
    torch.save(model, buffer)
    pickled = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for copied in (best, pair["model"], reverse[1], pickled):
        assert not differences(_frozen(copied.state_dict()), at_copy)

    train(model, optimizer, DATA[2:])
    expected = snapshot(model, optimizer)
    after = _frozen(model.state_dict())
    assert differences(after, at_copy)
    assert not differences(_frozen(best.state_dict()), at_copy)       # training the original left it
    for copied_model, copied_optimizer in ((pair["model"], pair["optimizer"]), (reverse[1], reverse[0])):
        for _ in range(2):   # trained on, then resumed (the optimizer's load keeps the copy's low halves)
            train(copied_model, copied_optimizer, DATA[2:])
            assert not differences(snapshot(copied_model, copied_optimizer), expected)
            assert not differences(_frozen(copied_model.state_dict()), after)
            resume(copied_model, copied_optimizer, saved)

    model.load_state_dict(best.state_dict())                           # roll back to the best
    assert not differences(_frozen(model.state_dict()), at_copy)
    assert _masters_saved(model, optimizer)


@pytest.mark.parametrize("inplace", [True, False])
def test_optimize_again_or_a_new_optimizer_over_a_model_or_its_copy_trains_its_masters(inplace: bool) -> None:
    """``optimize`` of an optimized model (with its optimizer, or a new one) or of its copy: the bf16
    parameters take the low halves the model's hooks know (a new optimizer trained them as bf16
    alone, and the model saved them joined with the old optimizer's stale low halves), and a copy
    (``inplace=False``) saves its copied optimizer's."""
    model, optimizer = build("adamw", split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:2])
    at_copy = _frozen(model.state_dict())
    best = copy.deepcopy(model)
    given = [(best, torch.optim.SGD(best.parameters(), lr=0.05, momentum=0.9)), (model, optimizer),
             (model, torch.optim.SGD(model.parameters(), lr=0.05))]   # the original's old optimizer alive
    for given_model, given_optimizer in given:
        before = _frozen(given_model.state_dict())   # inplace: trained by the round before
        tuned, tuned_optimizer = optimize(given_model, given_optimizer, dtype=torch.bfloat16, inplace=inplace,
                                          force_bf16=True)
        assert is_split(tuned_optimizer, tuned.conv.weight) and not is_split(tuned_optimizer, tuned.norm.weight)
        assert not differences(_frozen(tuned.state_dict()), before) and _masters_saved(tuned, tuned_optimizer)
        train(tuned, tuned_optimizer, DATA[2:])
        assert differences(_frozen(tuned.state_dict()), before) and _masters_saved(tuned, tuned_optimizer)
    assert not differences(_frozen(best.state_dict()), at_copy) == inplace   # trained only inplace


def test_a_split_model_widened_with_float_saves_its_masters_and_trains_on_in_fp32() -> None:
    """``model.float()`` after split-bf16 training (to export or evaluate in fp32): ``state_dict()`` raised
    TypeError ("join needs (bfloat16, int16)") and the next step failed inside its write-back after running
    the update on garbage masters. The widened parameters become their exact fp32 masters."""
    model, optimizer = build("adamw", split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:2])
    masters = {name: master for (name, _), master in zip(model.named_parameters(), master_params(optimizer))}
    model.float()
    state = model.state_dict()
    assert all(state[name].dtype == torch.float32 and torch.equal(state[name], m) for name, m in masters.items())
    assert all(torch.equal(p, masters[name]) for name, p in model.named_parameters())
    assert not any(is_split(optimizer, p) for p in model.parameters())
    reference = copy.deepcopy((model, optimizer))       # the same fp32 parameters and moments, torch's AdamW
    reference[1].__class__ = torch.optim.AdamW
    train(model, optimizer, DATA[2:])
    train(*reference, DATA[2:])
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(model.parameters(), reference[0].parameters()))
    model.half()                                         # not a widening: the values as cast, no crash
    assert all(v.dtype == torch.float16 for v in model.state_dict().values() if v.is_floating_point())


@pytest.mark.parametrize("how", ["optimize", "to_fused"])
def test_a_split_model_widened_with_float_computes_in_fp32_with_its_masters(how: str) -> None:
    """After split-bf16 training, ``model.float()`` is the fp32 model of the masters: its forward ran
    on under the bf16 autocast (max difference ~1e-2 from the plain fp32 model), and before the next
    step or ``state_dict`` on the truncated bf16 halves. Made bf16 again (a new split), autocast is back."""
    from xlaunch.kernels import to_fused
    from resume_helpers import Net

    if how == "optimize":
        model, optimizer = build("sgd", split=True, inplace=True, seed=0)
    else:
        torch.manual_seed(0)
        model = Net().train()
        optimizer = to_fused(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, dtype=torch.bfloat16)
    train(model, optimizer, DATA[:2])
    masters = master_params(optimizer)
    plain = Net()
    with torch.no_grad():
        for p, master in zip(plain.parameters(), masters):
            p.copy_(master)
        for b, own in zip(plain.buffers(), model.buffers()):
            b.copy_(own)
    if model.conv.weight.is_contiguous(memory_format=torch.channels_last):   # as optimize laid it out
        plain.conv.weight.data = plain.conv.weight.data.contiguous(memory_format=torch.channels_last)
    x = DATA[3][0]
    model.float()                                      # no state_dict or step before the forward
    for mode in ("eval", "train"):
        getattr(model, mode)(), getattr(plain, mode)()
        with torch.no_grad():
            got, want = model(x), plain(x)
        assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters))
    model.train()
    optimizer = to_fused(optimizer, model, dtype=torch.bfloat16)   # split again: the bf16 forward again
    assert is_split(optimizer, model.conv.weight)
    with torch.no_grad():
        assert not torch.allclose(model(x), plain(x), rtol=1e-4, atol=1e-4)
