"""interaction(): DLRM's dense feature + pairwise dot products, against the eager bmm/gather
formulation, forward and gradients on random upstream gradients."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import xlaunch.nn.functional as F  # noqa: E402
from xlaunch.nn import interaction  # noqa: E402

pytestmark = pytest.mark.torch


def eager(*features: torch.Tensor) -> torch.Tensor:
    stacked = torch.stack(features, dim=1)
    dots = torch.bmm(stacked, stacked.transpose(1, 2))
    rows, cols = zip(*[(i, j) for i in range(len(features)) for j in range(i)])   # DLRM's li, lj
    return torch.cat([features[0], dots[:, list(rows), list(cols)]], dim=1)


def test_forward_and_gradients_equal_the_eager_formulation():
    gen = torch.Generator().manual_seed(0)
    features = [torch.randn(5, 7, generator=gen, requires_grad=True) for _ in range(6)]
    got, want = interaction(*features), eager(*features)
    assert got.shape == (5, 7 + 6 * 5 // 2)
    torch.testing.assert_close(got, want)
    upstream = torch.randn(got.shape, generator=gen)
    for g, w in zip(torch.autograd.grad(got, features, upstream), torch.autograd.grad(want, features, upstream)):
        torch.testing.assert_close(g, w)
    assert F.interaction is interaction


def test_gradcheck_in_double_precision():
    gen = torch.Generator().manual_seed(1)
    features = [torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    assert torch.autograd.gradcheck(interaction, features)
    # Second derivatives too (a gradient penalty): the saved stack was not a function of the
    # features, so double backward silently left its term out.
    assert torch.autograd.gradgradcheck(interaction, features)
    assert torch.autograd.gradgradcheck(F.InteractionFunc.apply, features)


def test_torch_compile_fullgraph_equals_eager():
    # It failed to compile at all (the function saved a view of an intermediate), fullgraph or not.
    gen = torch.Generator().manual_seed(2)
    features = [torch.randn(4, 8, generator=gen, requires_grad=True) for _ in range(5)]
    upstream = torch.randn(4, 8 + 10, generator=gen)
    compiled = torch.compile(interaction, fullgraph=True, backend="aot_eager")
    got = compiled(*features)
    torch.testing.assert_close(got, eager(*features))
    for g, w in zip(torch.autograd.grad(got, features, upstream), torch.autograd.grad(eager(*features), features, upstream)):
        torch.testing.assert_close(g, w)


def test_bf16_features_and_refusals():
    gen = torch.Generator().manual_seed(2)
    features = [torch.randn(4, 8, generator=gen) for _ in range(3)]
    got = interaction(*[f.bfloat16() for f in features])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), eager(*features), rtol=2e-2, atol=5e-2)
    with pytest.raises(ValueError, match="feature 1 must be a \\(batch, dim\\) tensor"):
        interaction(features[0], torch.randn(4, 9))
    with pytest.raises(ValueError, match="feature 2 is torch.bfloat16"):
        interaction(features[0], features[1], features[2].bfloat16())


def test_non_float_features_are_refused_and_fp64_bf16_sum_in_their_precision():
    with pytest.raises(TypeError, match="float dtype"):
        interaction(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64))
    gen = torch.Generator().manual_seed(2)
    features = [torch.randn(4, 64, dtype=torch.float64, generator=gen) for _ in range(3)]
    torch.testing.assert_close(interaction(*features), eager(*features), rtol=1e-15, atol=1e-13)
    narrow = [f.bfloat16() for f in features]
    got = interaction(*narrow)
    assert got.dtype == torch.bfloat16
    # fp32 sums rounded once: within one bf16 rounding of the exact dots of the bf16 inputs
    exact = eager(*[f.double() for f in narrow])
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-6)


def test_autocast_promotes_as_ipex_and_fp32_features_stay_fp32():
    """Under CPU autocast, IPEX casts the features to the type promoted from the autocast dtype and
    theirs: a bf16 MLP output with fp32 embedding outputs (DLRM under autocast) computes in fp32
    (it was a ValueError), and fp32 features stay fp32 (autocast recast the bmm inside to bf16:
    fp32 outputs holding bf16-rounded dots, 2e-2 off)."""
    gen = torch.Generator().manual_seed(3)
    features = [torch.randn(4, 16, generator=gen, requires_grad=True) for _ in range(3)]
    exact = [f.detach().double().requires_grad_() for f in features]
    want = interaction(*exact)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, exact, upstream)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = interaction(*features)
        got_grads = torch.autograd.grad(got, features, upstream.float())
        dense = features[0].detach().bfloat16().requires_grad_()
        mixed = interaction(dense, *features[1:])
        all_bf16 = interaction(*[f.detach().bfloat16() for f in features])
    assert got.dtype == torch.float32 and mixed.dtype == torch.float32 and all_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    mixed.sum().backward()
    assert dense.grad is not None and dense.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="feature 1 is torch.float32"):       # outside autocast: one dtype
        interaction(dense.detach(), *features[1:])


def test_interaction_func_apply_checks_its_features_as_interaction_does():
    # IPEX's spelling went straight to the autograd function: a (2, 16) feature beside a (2, 8) one
    # was cut into two vectors of 12, and the result, of the wrong shape, came back without a word.
    with pytest.raises(ValueError, match=r"feature 1 must be a \(batch, dim\) tensor shaped like the dense feature \(2, 8\)"):
        F.InteractionFunc.apply(torch.randn(2, 8), torch.randn(2, 16))
    features = [torch.randn(2, 8) for _ in range(3)]
    torch.testing.assert_close(F.InteractionFunc.apply(*features), eager(*features))
