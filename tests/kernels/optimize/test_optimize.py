"""optimize(): folding, dropout, layout, bf16, precedence, optimizer return — checked on real numerics."""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xlaunch  # noqa: E402
import xlaunch.kernels  # noqa: E402
from xlaunch.kernels.optimize import precision  # noqa: E402
from xlaunch.kernels.optimize import dispatch, fold
from xlaunch.kernels.optimize.pipeline import OptimizeWarning, optimize, outputs_close  # noqa: E402

pytestmark = pytest.mark.torch

EAGER = {"weights_prepack": False, "measure": False}  # freezing and timing have their own tests


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BN non-trivial statistics and affine params, so a wrong fold shows."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=gen))
            module.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            if module.affine:
                module.weight.data.copy_(torch.randn(n, generator=gen))
                module.bias.data.copy_(torch.randn(n, generator=gen))
    return model


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def assert_close(reference: torch.Tensor, candidate: torch.Tensor, rtol: float = 1e-4) -> None:
    scale = reference.abs().max().item()
    error = (reference.float() - candidate.float()).abs().max().item()
    assert error <= rtol * scale, f"max error {error} vs scale {scale}"


def count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


class Nested(nn.Module):
    """Conv/BN pairs reached through plain attributes and a custom forward, not a Sequential."""

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, 3, padding=1)
            self.bn = nn.BatchNorm2d(cout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn(self.conv(x))) + x.mean()

    def __init__(self) -> None:
        super().__init__()
        self.stem = self.Block(3, 8)
        self.stages = nn.ModuleList([self.Block(8, 8), self.Block(8, 8)])
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(self.drop(x.mean((2, 3))))


@pytest.fixture
def image() -> torch.Tensor:
    return torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "conv, bn, shape",
    [
        (nn.Conv1d(3, 6, 3, bias=False), nn.BatchNorm1d(6), (2, 3, 10)),
        (nn.Conv2d(3, 6, 3, groups=3, bias=True), nn.BatchNorm2d(6), (2, 3, 9, 9)),
        (nn.Conv3d(3, 6, 2), nn.BatchNorm3d(6), (2, 3, 5, 5, 5)),
        (nn.ConvTranspose2d(3, 6, 3, stride=2), nn.BatchNorm2d(6), (2, 3, 5, 5)),
    ],
)
def test_conv_bn_fold_matches_unoptimized(conv: nn.Module, bn: nn.Module, shape: tuple) -> None:
    model = randomize_bn(nn.Sequential(conv, bn, nn.ReLU())).eval()
    x = torch.randn(*shape)
    optimized = optimize(model, **EAGER)
    assert count(optimized, nn.modules.batchnorm._BatchNorm) == 0
    assert optimized._xlaunch_optimize_report.folded == ["0+1"]
    assert_close(run(model, x), run(optimized, x))
    assert count(model, nn.modules.batchnorm._BatchNorm) == 1  # inplace=False: original untouched


def test_nested_custom_forward_folds_every_pair(image: torch.Tensor) -> None:
    model = randomize_bn(Nested()).eval()
    optimized = optimize(model, **EAGER)
    report = optimized._xlaunch_optimize_report
    assert sorted(report.folded) == ["stages.0.conv+stages.0.bn", "stages.1.conv+stages.1.bn", "stem.conv+stem.bn"]
    assert report.dropouts_removed == ["drop"]
    assert type(optimized) is Nested and isinstance(optimized.stem.bn, nn.Identity)
    assert_close(run(model, image), run(optimized, image))


def test_linear_bn_fold_needs_and_uses_sample_input() -> None:
    # the model's input goes straight into the linear: (N, 5) and (N, 7, 5) both run, so only a
    # sample input shows which one the batch norm sees
    model = randomize_bn(nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh())).eval()
    x = torch.randn(4, 5)
    with pytest.warns(OptimizeWarning, match=r"may see \(N, L, C\).*a sample_input would show"):
        unsure = optimize(model, **EAGER)
    assert count(unsure, nn.BatchNorm1d) == 1
    folded = optimize(model, sample_input=x, **EAGER)
    assert count(folded, nn.BatchNorm1d) == 0
    assert_close(run(model, x), run(folded, x))


def test_linear_bn_on_rank3_input_is_not_folded() -> None:
    # Linear acts on the last dim (7 -> 7) while BN1d normalizes dim 1 (7 channels): same counts,
    # different axes; folding would silently change results.
    model = randomize_bn(nn.Sequential(nn.Linear(7, 7), nn.BatchNorm1d(7))).eval()
    x = torch.randn(3, 7, 7)
    with pytest.warns(OptimizeWarning, match="rank 3"):
        optimized = optimize(model, sample_input=x, **EAGER)
    assert count(optimized, nn.BatchNorm1d) == 1
    assert torch.equal(run(model, x), run(optimized, x))


def test_shared_conv_is_left_alone(image: torch.Tensor) -> None:
    class SharedConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.bn1, self.bn2 = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn2(self.conv(self.bn1(self.conv(x))))

    model = randomize_bn(SharedConv()).eval()
    with pytest.warns(OptimizeWarning, match="conv is shared"):
        optimized = optimize(model, channels_last=False, **EAGER)  # layout alone may reorder sums
    assert count(optimized, nn.BatchNorm2d) == 2
    assert torch.equal(run(model, image), run(optimized, image))


def test_module_registered_under_two_names_is_not_folded(image: torch.Tensor) -> None:
    conv, bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(conv, bn), nn.Sequential(conv, nn.ReLU()))
    model = randomize_bn(model).eval()
    with pytest.warns(OptimizeWarning, match="shared"):
        optimized = optimize(model, channels_last=False, **EAGER)
    assert count(optimized, nn.BatchNorm2d) == 1
    assert torch.equal(run(model, image), run(optimized, image))


def test_shared_dropout_replaced_under_every_name(image: torch.Tensor) -> None:
    drop = nn.Dropout(0.3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), drop, nn.ReLU(), drop).eval()
    optimized = optimize(model, channels_last=False, **EAGER)
    assert count(optimized, nn.Dropout) == 0
    assert torch.equal(run(model, image), run(optimized, image))


def test_fx_untraceable_model_falls_back_to_sequentials(image: torch.Tensor) -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent: FX cannot trace this
                return self.body(x)
            return self.body(-x)

    model = randomize_bn(Branchy()).eval()
    with pytest.warns(OptimizeWarning, match="FX could not trace"):
        optimized = optimize(model, **EAGER)
    assert optimized._xlaunch_optimize_report.folded == ["body.0+body.1"]
    assert_close(run(model, image), run(optimized, image))


def test_bn_without_running_stats_is_untouched_and_says_why(image: torch.Tensor) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    weight = model[0].weight
    with pytest.warns(OptimizeWarning, match="no running statistics"):
        optimized = optimize(model, inplace=True, **EAGER)
    assert optimized is model and isinstance(model[1], nn.BatchNorm2d) and model[0].weight is weight


def test_fold_that_raises_leaves_module_as_it_was(monkeypatch: pytest.MonkeyPatch, image: torch.Tensor) -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))).eval()
    weight, bn = model[0].weight, model[1]

    def broken(*args: object) -> None:
        raise RuntimeError("simulated fold failure")

    monkeypatch.setattr(fold, "_folded_params", broken)
    with pytest.warns(OptimizeWarning, match="simulated fold failure"):
        optimize(model, inplace=True, **EAGER)
    assert model[1] is bn and model[0].weight is weight and model[0].bias is None


def test_fold_that_changes_results_is_undone(monkeypatch: pytest.MonkeyPatch, image: torch.Tensor) -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Dropout())).eval()
    reference = run(model, image)
    conv, weight, bn, drop = model[0], model[0].weight, model[1], model[2]
    real = fold._folded_params
    monkeypatch.setattr(fold, "_folded_params", lambda p, n, k: tuple(t * 1.5 for t in real(p, n, k)))
    with pytest.warns(OptimizeWarning, match="folding undone"):
        optimize(model, inplace=True, sample_input=image, **EAGER)
    assert model[0] is conv and conv.weight is weight and conv.bias is None
    assert model[1] is bn and model[2] is drop
    assert torch.equal(run(model, image), reference)


def test_training_model_keeps_bn_and_dropout(image: torch.Tensor) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout()).train()
    optimized = optimize(model, **EAGER)
    assert count(optimized, nn.BatchNorm2d) == 1 and count(optimized, nn.Dropout) == 1


def test_level_o0_does_nothing_and_flags_beat_levels(image: torch.Tensor) -> None:
    def model() -> nn.Module:
        return randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout())).eval()

    untouched = optimize(model(), level="O0")
    assert count(untouched, nn.BatchNorm2d) == 1 and count(untouched, nn.Dropout) == 1
    assert untouched[0].weight.is_contiguous()  # no channels_last either
    only_fold = optimize(model(), level="O0", conv_bn_folding=True)
    assert count(only_fold, nn.BatchNorm2d) == 0 and count(only_fold, nn.Dropout) == 1
    no_fold = optimize(model(), level="O1", conv_bn_folding=False, **EAGER)
    assert count(no_fold, nn.BatchNorm2d) == 1 and count(no_fold, nn.Dropout) == 0
    as_level = optimize(model(), conv_bn_folding=None, **EAGER)  # None means "what the level says"
    assert count(as_level, nn.BatchNorm2d) == 0


def test_bad_level_and_unknown_flag_are_rejected() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="level"):
        optimize(model, level="O3")
    with pytest.raises(TypeError, match="conv_bn_fold"):
        optimize(model, conv_bn_fold=True)
    with pytest.raises(ValueError, match="dtype"):
        optimize(model, dtype=torch.int8)


@pytest.mark.parametrize("kwargs, line", [
    (dict(inplace="False"), "optimize: inplace must be True or False, not 'False'"),
    (dict(conv_bn_folding=3), "optimize: conv_bn_folding must be True or False, not 3"),
    (dict(split_master_weight_for_bf16="no"), "optimize: split_master_weights must be True or False, not 'no'"),
])
def test_a_flag_that_is_not_a_bool_is_one_line_and_the_model_is_untouched(kwargs: dict, line: str) -> None:
    """``inplace="False"`` (truthy) rewrote the given model in place; a flag of 3 was taken as on."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    with pytest.raises(TypeError) as error:
        optimize(model, **kwargs, **EAGER)
    assert str(error.value) == line
    assert isinstance(model[1], nn.BatchNorm2d) and "forward" not in model.__dict__
    assert optimize(model, inplace=0, conv_bn_folding=True, **EAGER) is not model   # 0/1 are bools


@pytest.mark.parametrize("kwargs, line", [
    (dict(time_budget="abc"), "optimize: time_budget must be a number, not 'abc' (str)"),
    (dict(time_budget=float("nan")), "optimize: time_budget must be a finite number, got nan"),
    (dict(cache="no"), "optimize: cache must be True or False, not 'no'"),
])
def test_an_engine_option_of_the_wrong_kind_is_one_line(kwargs: dict, line: str) -> None:
    """``time_budget="abc"`` raised float()'s own "could not convert string to float: 'abc'" (naming no
    option); ``cache="no"`` (a true string) used the cache."""
    with pytest.raises((TypeError, ValueError)) as error:
        optimize(nn.Linear(2, 2).eval(), sample_input=torch.randn(1, 2), backend="eager", progress=False, **kwargs)
    assert str(error.value) == line


def test_channels_last_layout_keeps_values(image: torch.Tensor) -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))).eval()
    optimized = optimize(model, **EAGER)
    assert optimized._xlaunch_optimize_report.channels_last_convs == 2
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last)
               for m in optimized.modules() if isinstance(m, nn.Conv2d))
    assert_close(run(model, image), run(optimized, image))
    mlp = optimize(nn.Sequential(nn.Linear(3, 3)), **EAGER)
    assert mlp._xlaunch_optimize_report.channels_last_convs == 0


def test_cpuinfo_flags_and_bf16_decision(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    flags = precision.flags_from_cpuinfo(cpuinfo)
    assert {"avx2", "avx512_bf16"} <= flags
    assert precision.resolve_dtype(torch.bfloat16, False, flags) == (torch.bfloat16, None)
    assert precision.resolve_dtype(torch.bfloat16, False, frozenset({"amx_bf16"}))[0] == torch.bfloat16
    dtype, why = precision.resolve_dtype(torch.bfloat16, False, frozenset({"avx2", "fma"}))
    assert dtype == torch.float32 and "neither AVX512_BF16 nor AMX_BF16" in why
    assert precision.resolve_dtype(torch.bfloat16, True, frozenset({"avx2"})) == (torch.bfloat16, None)
    assert precision.resolve_dtype(None, False, frozenset()) == (torch.float32, None)
    assert precision.flags_from_cpuinfo(tmp_path / "missing") == frozenset()


def test_bf16_request_without_native_support_keeps_fp32(monkeypatch: pytest.MonkeyPatch, image: torch.Tensor) -> None:
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx2"}))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with pytest.warns(OptimizeWarning, match="bf16 not used") as said:
        optimized = xlaunch.optimize(model, dtype=torch.bfloat16, **EAGER)   # the public export (xlaunch._lazy)
    assert said[0].filename == __file__, said[0]   # the warning points at this line, not into xlaunch
    assert optimized[0].weight.dtype == torch.float32
    assert "forward" not in optimized.__dict__


def test_bf16_weights_and_autocast_where_supported(monkeypatch: pytest.MonkeyPatch, image: torch.Tensor) -> None:
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    model = randomize_bn(Nested()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizeWarning)
        optimized = optimize(model, dtype=torch.bfloat16, sample_input=image, **EAGER)
    assert optimized.stem.conv.weight.dtype == torch.bfloat16
    out = run(optimized, image)
    assert out.dtype == torch.float32  # outputs come back in the original model's dtype
    assert_close(run(model, image), out, rtol=5e-2)
    assert isinstance(copy.deepcopy(optimized), Nested)


def test_bf16_inference_model_widened_with_float_runs_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.float()`` of a bf16-optimized model is an fp32 model (it ran on under the bf16 autocast,
    its frozen graph too): outputs equal the plain fp32 model's with the same weights; ``.bfloat16()``
    makes it the bf16 model again."""
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 16)
    optimized = optimize(model, dtype=torch.bfloat16, sample_input=x, measure=False, force_bf16=True)
    bf16_out = run(optimized, x)
    optimized.float()
    plain = copy.deepcopy(model)
    plain.load_state_dict(optimized.state_dict())     # the bf16 weights, widened
    assert {p.dtype for p in optimized.parameters()} == {torch.float32}
    for _ in range(2):                                  # eager, then the graph frozen for the fp32 weights
        assert torch.allclose(run(optimized, x), run(plain, x), rtol=1e-6, atol=1e-6)
    assert torch.allclose(optimized(x), plain(x), rtol=1e-6, atol=1e-6)   # autograd on: the eager forward
    optimized.bfloat16()
    assert torch.equal(run(optimized, x), bf16_out)


class _TiedHead(nn.Module):
    """An embedding whose weight the output Linear shares (tied input and output embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.emb(tokens))))


def test_a_bf16_model_with_tied_weights_saves_every_key_in_its_original_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only one name of a tied weight was saved back in fp32: ``emb.weight`` came out bf16 beside an
    fp32 ``out.weight`` (the same tensor)."""
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    torch.manual_seed(0)
    model = _TiedHead().eval()
    optimized = optimize(model, dtype=torch.bfloat16, force_bf16=True, **EAGER)
    assert optimized.out.weight is optimized.emb.weight and optimized.emb.weight.dtype == torch.bfloat16
    state = optimized.state_dict()
    assert {key: value.dtype for key, value in state.items()} == dict.fromkeys(state, torch.float32)
    assert torch.equal(state["emb.weight"], state["out.weight"])
    assert torch.equal(state["emb.weight"], model.emb.weight.detach().bfloat16().float())


def test_a_bf16_optimized_model_optimized_again_without_dtype_keeps_its_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimize(optimize(model, dtype=torch.bfloat16), sample_input=x)`` (to freeze it, say) failed inside
    with "Input type (float) and bias type (c10::BFloat16) should be the same": the new forward dropped
    the autocast the bf16 weights need."""
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    once = optimize(model, dtype=torch.bfloat16, force_bf16=True, **EAGER)
    twice = optimize(once, sample_input=x, measure=False)
    assert twice[0].weight.dtype == torch.bfloat16
    assert any("stays under torch.bfloat16 autocast" in w for w in twice._xlaunch_optimize_report.warnings)
    assert torch.allclose(run(twice, x), run(once, x), rtol=1e-3, atol=1e-3)
    twice.float()                                          # still follows its weights
    plain = copy.deepcopy(model)
    plain.load_state_dict(twice.state_dict())
    assert torch.allclose(run(twice, x), run(plain, x), rtol=1e-5, atol=1e-5)


def test_bf16_keeps_attention_projection_dtypes_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"amx_bf16"}))
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    optimized = optimize(model, dtype=torch.bfloat16, **EAGER)
    attention = optimized.layers[0].self_attn
    assert attention.out_proj.weight.dtype == attention.in_proj_weight.dtype == torch.float32
    assert optimized.layers[0].linear1.weight.dtype == torch.bfloat16
    assert count(optimized, nn.Dropout) == 0
    assert_close(run(model, x), run(optimized, x), rtol=5e-2)


def test_returns_model_and_fused_optimizer_on_the_copy() -> None:
    pytest.importorskip("xlaunch.kernels.optim.fused")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = optimize(model, optimizer)
    assert isinstance(result, tuple) and len(result) == 2
    new_model, new_optimizer = result
    assert new_model is not model
    assert type(new_optimizer).__name__ == "FusedSGD"
    ours = {id(p) for p in new_model.parameters()}
    assert {id(p) for g in new_optimizer.param_groups for p in g["params"]} == ours
    assert all(id(p) not in ours for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    loss = new_model(torch.randn(3, 4)).square().sum()
    loss.backward()
    new_optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the user's model untouched
    assert not all(torch.equal(a, b) for a, b in zip(before, new_model.parameters()))



def test_a_scheduler_made_before_optimize_is_said_and_drives_the_optimizer_of_inplace() -> None:
    """``StepLR(opt)`` then ``optimize(model, opt)``: the copy of the optimizer optimize returns was not the
    scheduler's, and the learning rate stayed constant without a word. One warning; inplace=True keeps it driven."""
    pytest.importorskip("xlaunch.kernels.optim.fused")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimize(model, optimizer)                                      # no scheduler: nothing said
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.warns(OptimizeWarning, match="already has an LR scheduler"):
        _, copied = optimize(model, optimizer)
    model, fused = optimize(model, optimizer, inplace=True)
    model(torch.randn(3, 4)).square().sum().backward()
    fused.step()
    scheduler.step()
    assert fused.param_groups[0]["lr"] == 0.05 and copied.param_groups[0]["lr"] == 0.1

def test_bf16_training_gets_split_master_weights_and_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xlaunch.kernels.optim.fused")
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = optimize(model, optimizer, dtype=torch.bfloat16, inplace=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32
    out.square().sum().backward()
    optimizer.step()


def test_missing_fused_optimizers_return_the_optimizer_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xlaunch.kernels.optim.fused", None)  # import raises ImportError
    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(OptimizeWarning, match="optimizer kept as given"):
        same_model, same_optimizer = optimize(model, optimizer, inplace=True)
    assert same_model is model and same_optimizer is optimizer


def test_package_attribute_is_callable_even_after_submodule_import() -> None:
    import xlaunch.kernels.optimize.pipeline  # binds the module as the package attribute

    model = xlaunch.kernels.optimize(nn.Linear(2, 2), level="O0")
    assert isinstance(model, nn.Linear)


def test_outputs_close_catches_nan_and_shape() -> None:
    a = torch.ones(3)
    assert outputs_close(a, a + 1e-6, 1e-3) is None
    assert "exceeds" in outputs_close(a, torch.tensor([1.0, float("nan"), 1.0]), 1e-3)
    assert "shape" in outputs_close(a, torch.ones(4), 1e-3)


def test_sample_input_freezes_with_jit_behind_the_users_module(image: torch.Tensor) -> None:
    model = randomize_bn(Nested()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no deprecation noise reaches the user
        optimized = optimize(model, sample_input=image, measure=False)
    report = optimized._xlaunch_optimize_report
    assert type(optimized) is Nested and not isinstance(optimized, torch.jit.ScriptModule)
    assert report.frozen_with == "jit"
    forward = dispatch.of(optimized)
    graphs = [g for g in forward.frozen.values() if g is not None]
    assert len(graphs) == 1 and isinstance(graphs[0], torch.jit.ScriptModule)
    assert_close(run(model, image), run(optimized, image))
    other_batch = torch.randn(5, 3, 12, 12)
    assert_close(run(model, other_batch), run(optimized, other_batch))
    assert len([g for g in forward.frozen.values() if g is not None]) == 2   # one graph per signature
    with torch.enable_grad():   # autograd on: the eager forward, with gradients to the parameters
        out = optimized(image)
    assert out.requires_grad and out.grad_fn is not None


def test_freezing_that_changes_results_is_refused(monkeypatch: pytest.MonkeyPatch, image: torch.Tensor) -> None:
    from xlaunch.kernels.optimize import freeze

    def wrong(model, backend, sample_input=None):
        eager = dispatch.of(model).eager
        return lambda *args: eager(*args) + 1.0

    monkeypatch.setattr(freeze, "freeze", wrong)
    model = randomize_bn(Nested()).eval()
    with pytest.warns(OptimizeWarning, match="not frozen for inputs .*: the jit graph changed results"):
        optimized = optimize(model, sample_input=image, measure=False)
    assert optimized._xlaunch_optimize_report.frozen_with is None
    assert_close(run(model, image), run(optimized, image))


def test_weights_prepack_without_sample_input_freezes_on_first_no_grad_call(image: torch.Tensor) -> None:
    model = randomize_bn(Nested()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized = optimize(model, weights_prepack=True, measure=False)
    report = optimized._xlaunch_optimize_report
    assert report.frozen_with is None and not dispatch.of(optimized).frozen
    assert_close(run(model, image), run(optimized, image))
    assert report.frozen_with == "jit" and len(dispatch.of(optimized).frozen) == 1


def test_ipex_spellings_are_accepted(monkeypatch: pytest.MonkeyPatch, image: torch.Tensor) -> None:
    model = randomize_bn(Nested()).eval()
    optimized = optimize(model, level="O0", replace_dropout_with_identity=True)
    assert count(optimized, nn.Dropout) == 0 and count(optimized, nn.BatchNorm2d) == 3
    with pytest.warns(OptimizeWarning, match="auto_kernel_selection is an ipex.optimize knob"):
        optimize(model, level="O0", auto_kernel_selection=True)
    with pytest.raises(TypeError, match="unknown flag"):
        optimize(model, level="O0", replace_dropout=True)


def test_bf16_training_without_split_master_keeps_fp32_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xlaunch.kernels.optim.fused")
    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset({"avx512_bf16"}))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = optimize(model, optimizer, dtype=torch.bfloat16, inplace=True,
                                split_master_weight_for_bf16=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert type(optimizer).__name__ == "FusedSGD" and not optimizer.state
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32
    out.square().sum().backward()
    optimizer.step()


def test_inductor_is_refused_at_once_with_the_reason_where_a_path_has_a_space(tmp_path, monkeypatch) -> None:
    """torch 2.13's C++ builder leaves paths unquoted: with a space in inductor's cache folder (or the
    temporary folder, or the library folders) every compile failed after seconds with a bare "C++ compile
    error". The freeze backend and the engine route are refused before compiling, naming the folder."""
    from xlaunch.kernels.optimize import freeze
    from xlaunch.kernels.optimize.engines.routes.inductor_route import FrozenDynamicBatch

    spaced = tmp_path / "inductor cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(spaced))      # restored after the test
    freeze.inductor_blocker.cache_clear()
    try:
        reason = freeze.inductor_blocker()
        assert reason is not None and str(spaced) in reason and "pytorch/pytorch#191010" in reason
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
        with pytest.raises(freeze.InductorUnavailable, match="TORCHINDUCTOR_CACHE_DIR"):
            FrozenDynamicBatch(model)(torch.randn(2, 8))
        with pytest.warns(OptimizeWarning, match="inductor failed: InductorUnavailable: .*TORCHINDUCTOR_CACHE_DIR"):
            optimized = optimize(model, sample_input=torch.randn(2, 8), freeze_backend="inductor")
        x = torch.randn(2, 8)
        torch.testing.assert_close(optimized(x), model(x))
    finally:
        freeze.inductor_blocker.cache_clear()     # the next caller sees this process's own folders
