"""A frozen graph answers as the model does: the same output structure (dicts, lists, named tuples,
None), and models whose only TracerWarnings come from torch's own shape checks still freeze."""
from __future__ import annotations

import copy
import warnings
from collections import namedtuple

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optimize import dispatch  # noqa: E402
from xlaunch.kernels.optimize.pipeline import OptimizeWarning, optimize  # noqa: E402

pytestmark = pytest.mark.torch

Output = namedtuple("Output", "logits hidden")
NO_TIMING = {"measure": False}   # the frozen graph is kept whatever a loaded machine measures


class Structured(nn.Module):
    """Returns a dict holding a named tuple, a list and a None, as detection/HF-style models do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        hidden = self.conv(x).relu()
        logits = self.head(hidden.mean((2, 3)))
        return {"out": Output(logits, hidden), "extra": [logits.sum(1), None], "none": None}


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.head(x), x * 2)


def _graphs(model: nn.Module) -> list:
    forward = dispatch.of(model)
    return [g for g in forward.frozen.values() if g is not None]


def _same(reference, candidate) -> None:
    assert type(candidate) is type(reference)
    if isinstance(reference, torch.Tensor):
        torch.testing.assert_close(candidate, reference, rtol=1e-4, atol=1e-5)
    elif isinstance(reference, dict):
        assert list(candidate) == list(reference)
        for key in reference:
            _same(reference[key], candidate[key])
    elif isinstance(reference, (list, tuple)):
        assert len(candidate) == len(reference)
        for a, b in zip(reference, candidate):
            _same(a, b)
    else:
        assert candidate == reference


@pytest.mark.parametrize("make, shape", [(Structured, (2, 3, 8, 8)), (Named, (3, 4))])
def test_the_frozen_graph_returns_the_models_structure(make, shape) -> None:
    model = make().eval()
    x = torch.randn(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizeWarning)
        optimized = optimize(model, sample_input=x, **NO_TIMING)
    assert optimized._xlaunch_optimize_report.frozen_with == "jit"
    with torch.no_grad():
        for batch in (x, torch.randn(5, *shape[1:])):   # the sample's graph, then a new one
            _same(model(batch), optimized(batch))
    assert len(_graphs(optimized)) == 2


def test_a_named_tuple_keeps_its_fields() -> None:
    optimized = optimize(Named().eval(), sample_input=torch.randn(2, 4), **NO_TIMING)
    with torch.no_grad():
        out = optimized(torch.randn(2, 4))
    assert isinstance(out, Output) and out.logits.shape == (2, 2)


def test_torchs_own_shape_checks_do_not_refuse_freezing() -> None:
    """GroupNorm's batch-size check warns under tracing from inside torch (about shapes, which a
    graph per input signature bakes in rightly): the model freezes and answers right."""
    model = nn.Sequential(nn.Conv2d(4, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()).eval()
    x = torch.randn(2, 4, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizeWarning)
        optimized = optimize(model, sample_input=x, **NO_TIMING)
    assert optimized._xlaunch_optimize_report.frozen_with == "jit"
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-5)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:      # control flow on the data: a trace would bake in this branch
            return self.lin(x)
        return -self.lin(x)


def test_control_flow_on_the_users_data_is_still_refused() -> None:
    with pytest.warns(OptimizeWarning, match=r"not frozen .*UnsafeTrace.*test_frozen_outputs\.py:\d+"):
        optimized = optimize(Branchy().eval(), sample_input=torch.ones(2, 4), **NO_TIMING)
    with torch.no_grad():
        torch.testing.assert_close(optimized(-torch.ones(2, 4)), Branchy.forward(optimized, -torch.ones(2, 4)))
    assert not _graphs(optimized)


def test_train_on_a_model_folded_for_inference_says_what_it_lacks() -> None:
    """model.train() on the inference rewrite warns once: it trains without the folded batch norms and
    the removed dropout (its training-mode outputs are not the given model's); eval() is silent."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5)).eval()
    optimized = optimize(model, **NO_TIMING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized.eval()
    with pytest.warns(OptimizeWarning, match=r"Sequential\.train\(\): .*1 batch norm\(s\) folded .* 1 dropout\(s\) "
                                             r"removed.*optimize that model in training mode") as caught:
        assert optimized.train() is optimized and optimized.training and optimized[0].training
        optimized.train()
    assert len([w for w in caught if issubclass(w.category, OptimizeWarning)]) == 1
    assert not optimized.eval().training and not optimized[0].training
    plain = optimize(nn.Sequential(nn.Linear(2, 2)).eval(), **NO_TIMING)   # nothing folded: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.train()


class Doubles(nn.Module):
    """Changes its input in place, as a leading ``ReLU(inplace=True)`` or ``x.sub_(mean)`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


def _call(model: nn.Module, rows: int) -> tuple:
    x = torch.ones(rows, 4)
    with torch.no_grad():
        return model(x), x


def test_a_forward_that_changes_its_input_gets_the_callers_input_once() -> None:
    """A graph is built, checked and timed on copies: the call that builds it answers on the
    caller's tensor as eager does (it ran on an input doubled 6 times: wrong outputs, x == 128)."""
    model = Doubles().eval()
    sample = torch.ones(2, 4)
    optimized = optimize(model, sample_input=sample, **NO_TIMING)
    assert torch.equal(sample, torch.ones(2, 4))          # optimize never changes the caller's sample
    assert optimized._xlaunch_optimize_report.frozen_with == "jit"
    lazy = optimize(model, weights_prepack=True, **NO_TIMING)   # no sample: built on the first call
    for candidate in (optimized, lazy):
        for rows in (2, 3, 3):     # the sample's graph, a graph built by this call, then that graph
            (want, x_want), (got, x_got) = _call(model, rows), _call(candidate, rows)
            torch.testing.assert_close(got, want)
            assert torch.equal(x_got, x_want)


def test_engines_never_run_the_callers_sample() -> None:
    sample = torch.ones(2, 4)
    optimized = optimize(Doubles().eval(), sample_input=sample, backend="eager", cache=False, progress=False)
    assert torch.equal(sample, torch.ones(2, 4))
    assert optimized.report.backend == "eager"


class Stateful(nn.Module):
    """Updates buffers in its eval forward (a call counter, an EMA of its features)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        features = self.bn(self.conv(x)).mean((2, 3))
        self.ema.mul_(0.9).add_(0.1 * features.mean(0))
        return self.head(features) + self.ema


def test_a_forward_that_updates_its_buffers_keeps_its_state_and_is_frozen() -> None:
    """The runs of a build, check and timing leave no trace in the model's own state (after optimize
    the counter read 8-11 and every output was off by up to 0.6), and the graph updates the state as
    eager does, so it serves every call (it was rebuilt on each one, then given up)."""
    torch.manual_seed(0)
    model = Stateful().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    optimized = optimize(model, sample_input=x, **NO_TIMING)
    report = optimized._xlaunch_optimize_report
    assert report.frozen_with == "jit" and report.folded == ["conv+bn"]
    for module in (model, optimized):
        assert module.calls.item() == 0 and torch.equal(module.ema, torch.zeros(4))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", OptimizeWarning)
        for batch in (x, x[:1], x, x[:1]):
            torch.testing.assert_close(optimized(batch), reference(batch))
            torch.testing.assert_close(optimized.ema, reference.ema)
    assert optimized.calls.item() == reference.calls.item() == 4
    forward = dispatch.of(optimized)
    assert len(_graphs(optimized)) == 2 and forward.rebuilds == 0


def test_engines_refuse_a_forward_that_updates_its_buffers() -> None:
    model = Stateful().eval()
    with pytest.warns(OptimizeWarning, match=r"the torch route is used: the forward updates its buffers \(calls, ema\)"):
        optimized = optimize(model, sample_input=torch.randn(2, 3, 8, 8), backend="auto", cache=False, progress=False)
    assert optimized.report.backend == "torch"
    assert model.calls.item() == optimized.calls.item() == 0
