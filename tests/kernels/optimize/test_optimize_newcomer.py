"""What a newcomer and an IPEX port trip on (issue 23): messages printed once, Linear+BatchNorm1d
folded without a sample input where the graph fixes the rank, ``inplace=True`` rewriting the given
module as IPEX's own test expects."""
from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optimize.pipeline import OptimizeWarning, optimize  # noqa: E402

pytestmark = pytest.mark.torch
EAGER = {"measure": False, "weights_prepack": False}


def randomized(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with BN statistics and affine parameters a wrong fold would show."""
    gen = torch.Generator().manual_seed(5)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=gen))
            module.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            module.weight.data.copy_(torch.randn(n, generator=gen))
            module.bias.data.copy_(torch.randn(n, generator=gen))
    return model.eval()


def bn1d_count(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm1d) for m in model.modules())


class MeanHead(nn.Module):
    """conv -> mean over the two spatial dims -> linear -> BN1d: the mean leaves (N, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(torch.relu(self.conv(x)).mean((2, 3))))


class Reshaped(nn.Module):
    """``x.view(...)``/``torch.flatten(x, 1)`` before the linear, as ResNet-style heads write it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(12, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1) if self.how == "view2" else torch.flatten(x, 1)
        return self.bn(self.fc(torch.relu(x)))


class Untraceable(nn.Module):
    """A data-dependent branch FX cannot trace; the Sequential inside still shows the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 6), nn.BatchNorm1d(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return y if y.sum() > 0 else -y


FOLDED_WITHOUT_SAMPLE = {
    "Flatten, Linear, BN1d": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.BatchNorm1d(6)), (5, 3, 4)),
    "Flatten through ReLU/Dropout/Linear": (lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 6), nn.BatchNorm1d(6)), (5, 3, 4)),
    "EmbeddingBag then Linear": (lambda: _Bag(), None),
    "conv, mean((2, 3)), Linear": (MeanHead, (2, 3, 6, 6)),
    "x.view(N, -1)": (lambda: Reshaped("view2"), (5, 3, 4)),
    "torch.flatten(x, 1)": (lambda: Reshaped("flatten1"), (5, 3, 4)),
    "untraceable, Sequential fallback": (Untraceable, (5, 3, 4)),
}


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(self.bag(indices)))


@pytest.mark.parametrize("name", sorted(FOLDED_WITHOUT_SAMPLE))
def test_linear_bn1d_folds_without_a_sample_where_the_graph_fixes_the_rank(name: str) -> None:
    make, shape = FOLDED_WITHOUT_SAMPLE[name]
    torch.manual_seed(0)
    model = randomized(make())
    x = torch.randint(0, 10, (5, 3)) if shape is None else torch.randn(*shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimized = optimize(model, **EAGER)
    assert bn1d_count(model) == 1 and bn1d_count(optimized) == 0, [str(w.message) for w in caught]
    assert not [w for w in caught if "not folded" in str(w.message)]
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-5)


def test_linear_bn1d_is_not_folded_where_the_rank_is_unknown_or_three() -> None:
    # (N, 12) and (N, 6, 12) both run through Linear(12, 6)+BN1d(6): the graph cannot tell which
    unknown = randomized(nn.Sequential(nn.Linear(12, 6), nn.BatchNorm1d(6)))
    with pytest.warns(OptimizeWarning, match=r"0\+1 not folded: nothing before the linear fixes the rank"):
        kept = optimize(unknown, **EAGER)
    assert bn1d_count(kept) == 1
    x = torch.randn(4, 6, 12)
    with torch.no_grad():
        assert torch.equal(kept(x), unknown(x))    # rank 3 runs, and the result is unchanged
    folded = optimize(unknown, sample_input=torch.randn(4, 12), **EAGER)   # a sample shows (N, C)
    assert bn1d_count(folded) == 0

    class RankThree(nn.Module):   # reshape fixes rank 3: BN1d(6) normalizes dim 1 (6), not the linear's
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.fc(x.reshape(x.size(0), 6, 6)))

    model = randomized(RankThree())
    with pytest.warns(OptimizeWarning, match="rank 3"):
        kept = optimize(model, **EAGER)
    assert bn1d_count(kept) == 1


class IpexTestModule(nn.Module):
    """The model of IPEX's test_optimize_inplace_behavior_eval_mode."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 10)
        self.conv = nn.Conv2d(1, 10, 5, 1)
        self.bn = nn.BatchNorm2d(num_features=10)
        self.embeddingbag = nn.EmbeddingBag(10, 3, mode="sum")

    def forward(self, x, y, indices, offsets):
        x = self.bn(self.conv(x))
        y = self.linear(y)
        self.embeddingbag(indices, offsets)
        return x + y


def test_inplace_eval_rewrites_the_given_module_ipex_port() -> None:
    """IPEX's test, in xlaunch's terms: IPEX's ``inplace=True`` returns a new GraphModule and leaves
    the given module's conv as it was; here the given module itself is rewritten."""
    original = randomized(IpexTestModule())
    inputs = (torch.randn(2, 1, 9, 14), torch.randn(2, 10, 5, 5), torch.tensor([1, 2, 4, 5]), torch.tensor([0, 2]))
    with torch.no_grad():
        expected = original(*inputs)
    for dtype, level in itertools.product([torch.float32, torch.bfloat16], ["O0", "O1"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)   # bf16 is refused where it is emulated
            given = copy.deepcopy(original)
            before = {name: t.data_ptr() for name, t in given.state_dict().items()}
            copied = optimize(given, dtype=dtype, level=level, inplace=False)
            assert {name: t.data_ptr() for name, t in given.state_dict().items()} == before
            assert copied.embeddingbag.weight.data_ptr() != given.embeddingbag.weight.data_ptr()
            conv_weight = given.conv.weight
            same = optimize(given, dtype=dtype, level=level, inplace=True)
        assert same is given
        assert given.embeddingbag.weight.data_ptr() == before["embeddingbag.weight"]   # untouched part shared
        if level == "O1":   # folded into the given module's own conv
            assert given.conv.weight is not conv_weight and isinstance(given.bn, nn.Identity)
            assert "bn.running_mean" not in given.state_dict()
        else:
            assert given.conv.weight is conv_weight and isinstance(given.bn, nn.BatchNorm2d)
        # bf16 runs natively where the CPU has AVX512_BF16 or AMX (refused where it would be emulated)
        rtol, atol = (1e-4, 1e-5) if dtype is torch.float32 else (3e-2, 8e-2)
        with torch.no_grad():
            torch.testing.assert_close(given(*inputs).float(), expected, rtol=rtol, atol=atol)


ONCE = textwrap.dedent('''
    import logging, sys, warnings
    import torch
    from torch import nn
    from xlaunch.kernels.optimize import measure
    from xlaunch.kernels.optimize.pipeline import optimize

    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s %(message)s")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    x = torch.randn(2, 3, 6, 6)
    print("STEP knob", file=sys.stderr, flush=True)
    optimize(model, optimize_lstm=True, measure=False)
    print("STEP eager", file=sys.stderr, flush=True)
    # the measurement, made deterministic: the eager rewrite clearly fastest in every round
    measure.interleaved = lambda variants, **_: measure.Timings(
        {name: [{"given": 3.0, "eager": 1.0}.get(name, 2.0)] * 5 for name in variants})
    kept = optimize(model, sample_input=x, weights_prepack=False)
    assert kept._xlaunch_optimize_report.kept == "eager", kept._xlaunch_optimize_report
    print("STEP captured", file=sys.stderr, flush=True)
    logging.captureWarnings(True)
    optimize(model, deployment_mode=True, measure=False)
''')


def test_each_message_is_printed_once_with_logging_basicconfig() -> None:
    result = subprocess.run([sys.executable, "-c", ONCE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = dict(part.split("\n", 1) for part in result.stderr.split("STEP ")[1:])
    # (Python 3.13 prints a warning's source line under it, indented, for ``-c`` code too)
    knob = [line for line in steps["knob"].splitlines() if "optimize_lstm" in line and not line.startswith(" ")]
    assert len(knob) == 1 and "OptimizeWarning" in knob[0] and not knob[0].startswith("LOG"), steps["knob"]
    kept = [line for line in steps["eager"].splitlines() if "kept" in line]
    assert kept == [line for line in kept if line.startswith("LOG INFO xlaunch.optimize")] and len(kept) == 1, steps["eager"]
    assert "Warning" not in steps["eager"]
    captured = [line for line in steps["captured"].splitlines() if "deployment_mode" in line and not line.startswith(" ")]
    assert len(captured) == 1 and captured[0].startswith("LOG WARNING py.warnings"), steps["captured"]


def test_a_subclass_with_its_own_forward_is_not_taken_for_its_base() -> None:
    class Unflatten(nn.Flatten):      # named like a Flatten, but gives (N, 6, 2)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(x.size(0), 6, -1)

    class Keep(nn.Identity):          # an Identity that is one (RemovedDropout is such a subclass)
        pass

    from xlaunch.kernels.optimize import tensor_rank as ranks

    assert ranks.through_modules([nn.Flatten(), Keep(), nn.Linear(12, 6)]) == frozenset({2})
    assert ranks.through_modules([Unflatten(), nn.Linear(2, 6)]) is None
    model = randomized(nn.Sequential(Unflatten(), nn.Linear(2, 6), nn.BatchNorm1d(6)))
    with pytest.warns(OptimizeWarning, match="rank 3"):   # FX traces into the subclass: reshape to 3 sizes
        kept = optimize(model, **EAGER)
    assert bn1d_count(kept) == 1
