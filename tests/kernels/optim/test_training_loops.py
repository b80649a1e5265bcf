"""The fused optimizers driven as real training scripts drive torch's: GradScaler, several
optimizers on one model, ... step for step against torch's own optimizer."""
from __future__ import annotations

import copy
import io
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
    split_params,
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


def test_two_split_optimizers_on_one_model_train_and_save_their_masters() -> None:
    """An SGD for the first layer and an Adam for the second, both split-bf16: the first
    ``to_fused`` cast the second layer to bf16 (rounded), so the second trained plain bf16 without
    masters, and ``model.state_dict()`` gave bf16 tensors for it."""
    model, reference = _model(), _model()
    exact = [p.detach().clone() for p in model.parameters()]
    first = to_fused(torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9), model, dtype=torch.bfloat16)
    second = to_fused(torch.optim.Adam(model[2].parameters(), lr=0.01), model, dtype=torch.bfloat16)
    masters = master_params(first) + master_params(second)
    assert all(torch.equal(a, b) for a, b in zip(masters, exact))   # nothing rounded on the way in
    plain = [torch.optim.SGD(reference[0].parameters(), lr=0.1, momentum=0.9),
             torch.optim.Adam(reference[2].parameters(), lr=0.01)]
    for i in range(4):
        for optimizer in (first, second, *plain):
            optimizer.zero_grad()
        _loss(model, i).backward()
        _loss(reference, i, autocast=True).backward()
        for optimizer in (first, second, *plain):
            optimizer.step()
    masters = master_params(first) + master_params(second)
    saved = model.state_dict()
    assert [v.dtype for v in saved.values()] == [torch.float32] * 4
    assert all(torch.equal(a, b) for a, b in zip(masters, saved.values()))
    for got, want in zip(masters, reference.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=2e-2, atol=2e-2)
    restored = _model()
    restored_first = to_fused(torch.optim.SGD(restored[0].parameters(), lr=0.1, momentum=0.9), restored,
                              dtype=torch.bfloat16)
    restored_second = to_fused(torch.optim.Adam(restored[2].parameters(), lr=0.01), restored, dtype=torch.bfloat16)
    restored.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in
               zip(master_params(restored_first) + master_params(restored_second), masters))


def test_split_leaves_trainable_parameters_of_no_optimizer_fp32_and_casts_frozen_ones() -> None:
    model = _model()
    model[0].bias.requires_grad_(False)
    weight = model[2].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_fused(torch.optim.AdamW([model[0].weight], lr=0.01), model, dtype=torch.bfloat16)
    assert model[0].weight.dtype == model[0].bias.dtype == torch.bfloat16
    assert model[2].weight.dtype == torch.float32 and torch.equal(model[2].weight, weight)
    assert model(torch.randn(2, 8)).dtype == torch.float32


def _hand_grads(cls, kwargs: dict, transposed_param: bool, split: bool = False) -> list:
    """Two steps with gradients set by hand in another memory layout than their parameter's."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3, 4).t() if transposed_param else torch.randn(4, 3))
    optimizer = cls([param], **kwargs)
    if split:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "without the model": there is none
            optimizer = to_fused(optimizer, dtype=torch.bfloat16)
    for i in range(2):
        grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        other = grad if transposed_param else grad.t().contiguous().t()   # same values, other strides
        param.grad = other.to(param.dtype)
        assert param.grad.stride() != param.stride()
        optimizer.step()
    return master_params(optimizer) if split else [param.detach().clone()]


@pytest.mark.parametrize("transposed_param", [False, True], ids=["grad-transposed", "param-transposed"])
@pytest.mark.parametrize("reference_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_a_gradient_in_another_layout_than_its_parameter(reference_cls, fused_cls, kwargs, transposed_param) -> None:
    """torch's fused kernels pair a parameter and its gradient in memory order: a gradient set by
    hand with other strides (a transposed copy, say) was applied to the wrong elements."""
    want = _hand_grads(reference_cls, dict(kwargs, foreach=False), transposed_param)
    torch.testing.assert_close(_hand_grads(fused_cls, kwargs, transposed_param), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_hand_grads(fused_cls, kwargs, transposed_param, split=True), want,
                               rtol=2e-2, atol=2e-2)


def _sliced_run(cls, kwargs: dict, split: bool = False) -> list:
    """A Linear cut to its first 5 inputs (``weight.data[:, :5]``: a view with gaps), trained 3 steps."""
    model = _model()
    model[0].weight.data, model[0].in_features = model[0].weight.data[:, :5], 5
    assert not model[0].weight.is_contiguous()
    optimizer = cls(model.parameters(), **kwargs)
    if split:
        optimizer = to_fused(optimizer, model, dtype=torch.bfloat16)
    for i in range(3):
        optimizer.zero_grad()
        generator = torch.Generator().manual_seed(i)
        ((model(torch.randn(5, 5, generator=generator)).float() - 1) ** 2).mean().backward()
        optimizer.step()
    return master_params(optimizer) if split else [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("reference_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_a_sliced_parameter_trains_as_with_torch(reference_cls, fused_cls, kwargs) -> None:
    """torch's fused kernels walk a parameter in memory order: one with gaps (a weight cut with
    ``w.data[:, :k]``) was updated at the wrong elements (torch's own ``fused=True`` too), and
    ``to_fused(dtype=torch.bfloat16)`` refused it ("split-bf16 needs a dense tensor") from deep inside."""
    want = _sliced_run(reference_cls, dict(kwargs, foreach=False))
    torch.testing.assert_close(_sliced_run(fused_cls, kwargs), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_sliced_run(reference_cls, kwargs, split=True), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("plateau", [False, True], ids=["StepLR", "ReduceLROnPlateau"])
def test_a_scheduler_made_before_to_fused_drives_the_fused_optimizer(plateau: bool) -> None:
    """The fused twin had its own param groups: a scheduler (or a hand-set lr) on the optimizer
    given to ``to_fused`` changed nothing, silently, and torch warned of a wrong call order."""
    results = []
    for convert in (False, True):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = (torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.1) if plateau
                     else torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.1))
        stepped = to_fused(optimizer) if convert else optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(3):
                stepped.zero_grad()
                loss = _loss(model, i)
                loss.backward()
                stepped.step()
                scheduler.step(i) if plateau else scheduler.step()   # i: never better, so it decays
        results.append(([p.detach().clone() for p in model.parameters()], stepped.param_groups[0]["lr"]))
    (want, want_lr), (got, got_lr) = results
    assert got_lr == pytest.approx(want_lr) and want_lr < 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_to_fused_refuses_what_is_not_an_optimizer_or_a_model() -> None:
    with pytest.raises(TypeError, match=r"^to_fused: optimizer must be a torch.optim.Optimizer, not Sequential$"):
        to_fused(_model())
    with pytest.raises(TypeError, match=r"^to_fused: model must be a torch.nn.Module or None, not str$"):
        to_fused(torch.optim.SGD(_model().parameters(), lr=0.1), "model", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^master_params: optimizer must be a torch.optim.Optimizer, not str$"):
        master_params("optimizer")
    fused = to_fused(torch.optim.SGD(_model().parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"^split_params: model must be a torch.nn.Module or None, not str$"):
        split_params(fused, "model")


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=torch.tensor(0.01)), "lr"), (dict(lr=None), "lr"), (dict(lr="0.1"), "lr"), (dict(lr=-1.0), "lr"),
    (dict(betas=(0.9,)), "betas"), (dict(betas=(0.9, 1.0)), "betas"), (dict(betas=0.9), "betas"),
    (dict(eps=-1.0), "eps"), (dict(weight_decay=None), "weight_decay"), (dict(max_trust_ratio=-1.0), "max_trust_ratio"),
    (dict(max_trust_ratio=0.0), "max_trust_ratio"), (dict(bias_correction="yes"), "bias_correction"),
])
def test_lamb_refuses_bad_hyperparameters_in_one_line(kwargs: dict, name: str) -> None:
    from xlaunch.kernels.optim.fused import FusedLamb
    with pytest.raises((ValueError, TypeError), match=rf"^FusedLamb: {name} ") as caught:
        FusedLamb(_model().parameters(), **kwargs)
    assert "\n" not in str(caught.value)


def test_lamb_takes_numpy_scalars() -> None:
    numpy = pytest.importorskip("numpy")
    from xlaunch.kernels.optim.fused import FusedLamb
    FusedLamb(_model().parameters(), lr=numpy.float32(0.01), betas=(numpy.float64(0.9), 0.99), max_trust_ratio=10)


def test_a_scheduler_made_before_to_fused_still_drives_it_after_a_resume() -> None:
    """``load_state_dict`` gave the fused optimizer new group dicts, cutting off the scheduler."""
    results = []
    for convert in (False, True):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        stepped = to_fused(optimizer) if convert else optimizer
        stepped.load_state_dict(torch.optim.Adam(_model().parameters(), lr=0.01).state_dict())
        for i in range(3):
            stepped.zero_grad()
            _loss(model, i).backward()
            stepped.step()
            scheduler.step()
        results.append(([p.detach().clone() for p in model.parameters()], stepped.param_groups[0]["lr"]))
    (want, want_lr), (got, got_lr) = results
    assert got_lr == pytest.approx(want_lr) == 0.01 / 8
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["add_param_group", "new optimizer", "new Adagrad", "pickled, add_param_group",
                                 "deep copy, add_param_group"])
def test_a_layer_frozen_at_to_fused_and_unfrozen_later_trains_on_its_fp32_master(how: str) -> None:
    """``to_fused(..., dtype=torch.bfloat16)`` rounded the frozen layer to bf16: saved as bf16, and
    once unfrozen and given to the optimizer it trained in plain bf16 (bf16 moments, no master). A pickle
    (``torch.save`` of the pair, a new process) or deep copy of the pair lost that: the copy's frozen
    parameters were not taken over."""
    second = torch.optim.Adagrad if how == "new Adagrad" else torch.optim.Adam
    model, reference = _model(), _model()
    exact = [p.detach().clone() for p in model[0].parameters()]
    for m in (model, reference):
        m[0].requires_grad_(False)
    optimizer = to_fused(torch.optim.Adam(model[2].parameters(), lr=1e-3), model, dtype=torch.bfloat16)
    plain = torch.optim.Adam(reference[2].parameters(), lr=1e-3)
    for i in range(2):
        for opt, m, autocast in ((optimizer, model, False), (plain, reference, True)):
            opt.zero_grad()
            _loss(m, i, autocast).backward()
            opt.step()
    assert model[0].weight.dtype == torch.bfloat16
    saved = model.state_dict()
    assert torch.equal(saved["0.weight"], exact[0]) and torch.equal(saved["0.bias"], exact[1])
    if how.startswith("pickled"):
        buffer = io.BytesIO()
        torch.save((model, optimizer), buffer)
        model, optimizer = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    elif how.startswith("deep copy"):
        model, optimizer = copy.deepcopy((model, optimizer))
    for m in (model, reference):
        m[0].requires_grad_(True)
    if how.endswith("add_param_group"):
        plain.add_param_group({"params": reference[0].parameters()})
        optimizer.add_param_group({"params": model[0].parameters()})
        owner = optimizer
    else:
        plain = [plain, second(reference[0].parameters(), lr=1e-3)]
        owner = to_fused(second(model[0].parameters(), lr=1e-3), model, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(master_params(owner)[-2:], exact))
    stepped = list({id(o): o for o in (optimizer, owner, *(plain if isinstance(plain, list) else [plain]))}.values())
    for i in range(2, 12):
        for opt in stepped:
            opt.zero_grad()
        _loss(model, i).backward()
        _loss(reference, i, autocast=True).backward()
        for opt in stepped:
            opt.step()
    assert all(v.dtype == torch.float32 for k, v in owner.state[model[0].weight].items() if k != "bf16_trail")
    masters = master_params(owner)[-2:]
    assert all(torch.equal(a, b) for a, b in zip(masters, (model.state_dict()["0.weight"], model.state_dict()["0.bias"])))
    for got, want in zip(masters, reference[0].parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-3)


def test_a_split_model_given_to_to_fused_again_with_adagrad() -> None:
    """Adagrad makes its ``sum`` in its constructor, from the (already bf16) parameters: the step
    then failed with "expected scalar type Float but found BFloat16"."""
    model, reference = _model(), _model()
    optimizer = to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    optimizer = to_fused(torch.optim.Adagrad(model.parameters(), lr=0.05), model, dtype=torch.bfloat16)
    plain = torch.optim.Adagrad(reference.parameters(), lr=0.05)
    for i in range(4):
        for opt, m, autocast in ((optimizer, model, False), (plain, reference, True)):
            opt.zero_grad()
            _loss(m, i, autocast).backward()
            opt.step()
    assert optimizer.state[model[0].weight]["sum"].dtype == torch.float32
    for got, want in zip(master_params(optimizer), reference.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("how", ["to_fused", "optimize", "optimize-inplace"])
@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adagrad(ps, lr=0.05),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.01)], ids=["Adagrad", "AdamW"])
def test_a_split_model_given_a_new_fp32_optimizer_trains_on_from_its_masters(how: str, make) -> None:
    """A split-bf16 model given to to_fused/optimize again without dtype=bf16: its parameters stayed bf16
    and trained in plain bf16, and ``state_dict()`` joined each new bf16 half with its stale low half. They
    become their exact fp32 masters (Adagrad's "sum", made from the bf16 parameter, fp32 too) and train on
    as fp32 torch would."""
    from xlaunch.kernels.optimize.pipeline import optimize

    model = _model()
    first = to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    for i in range(2):
        first.zero_grad()
        _loss(model, i).backward()
        first.step()
    reference = _model()
    with torch.no_grad():
        for p, master in zip(reference.parameters(), master_params(first)):
            p.copy_(master)
    plain = make(reference.parameters())
    if how == "to_fused":
        optimizer = to_fused(make(model.parameters()), model)
    else:
        model, optimizer = optimize(model, make(model.parameters()), inplace=how == "optimize-inplace",
                                    progress=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for i in range(2, 5):
        for opt, m in ((optimizer, model), (plain, reference)):
            opt.zero_grad()
            _loss(m, i).backward()
            opt.step()
    for (name, got), want in zip(model.state_dict().items(), reference.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_fused_adagrad_made_for_a_layer_unfrozen_after_to_fused_keeps_fp32_state() -> None:
    model = _model()
    model[0].requires_grad_(False)
    optimizer = to_fused(torch.optim.SGD(model[2].parameters(), lr=0.1), model, dtype=torch.bfloat16)
    model[0].requires_grad_(True)
    layer = FusedAdagrad(model[0].parameters(), lr=0.1)   # takes the layer's master back
    before = master_params(layer)
    for opt in (optimizer, layer):
        opt.zero_grad()
    _loss(model, 0).backward()
    layer.step()
    assert layer.state[model[0].weight]["sum"].dtype == torch.float32
    assert all(not torch.equal(a, b) for a, b in zip(master_params(layer), before))


@pytest.mark.parametrize("reference_cls, fused_cls, kwargs", PAIRS, ids=IDS)
def test_step_hooks_run_once_on_torchs_own_step_too(reference_cls, fused_cls, kwargs) -> None:
    """A tensor ``lr`` takes torch's own step, which (once any torch optimizer of that class was
    made) ran the step hooks a second time: an EMA post-hook updated twice per step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    reference_cls(_model().parameters(), **kwargs)   # torch wraps its class's step with the hooks
    model = _model()
    optimizer = fused_cls(model.parameters(), **dict(kwargs, lr=torch.tensor(kwargs["lr"])))
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    handle = register_optimizer_step_post_hook(lambda *args: calls.append("global"))
    try:
        _loss(model, 0).backward()
        optimizer.step()
    finally:
        handle.remove()
    assert calls == ["pre", "post", "global"]
