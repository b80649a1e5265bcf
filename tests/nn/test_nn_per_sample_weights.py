"""Per-sample weights that require grad get their gradient from every merged class, the fused ones
included (they update the rows in backward; the weights' gradient is taken before the update)."""
from __future__ import annotations

import pytest
from nn_helpers import kernels  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.nn import (MergedEmbeddingBag, MergedEmbeddingBagWithAdaGrad,  # noqa: E402
                        MergedEmbeddingBagWithSGD)
from xlaunch.nn import bag_ops  # noqa: E402

pytestmark = pytest.mark.torch
CLASSES = [MergedEmbeddingBag, MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad]


def _case():
    gen = torch.Generator().manual_seed(3)
    tables = [nn.EmbeddingBag.from_pretrained(torch.randn(rows, dim, generator=gen), freeze=False, mode=mode)
              for rows, dim, mode in ((7, 4, "sum"), (5, 4, "sum"), (6, 3, "mean"))]
    indices = [torch.tensor([0, 1, 2, 1, 1, 6]), torch.tensor([3, 3, 1]), torch.tensor([1, 2, 5])]
    offsets = [torch.tensor([0, 4, 4]), torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2])]   # an empty bag
    weights = [torch.randn(6, generator=gen), torch.randn(3, generator=gen), None]
    upstream = [torch.randn(3, t.embedding_dim, generator=gen) for t in tables]
    return tables, indices, offsets, weights, upstream


def _expected(tables, indices, offsets, weights, upstream) -> torch.Tensor:
    """torch's gradient of table 0's per-sample weights (in float64)."""
    table = nn.EmbeddingBag.from_pretrained(tables[0].weight.detach().double(), mode="sum")
    psw = weights[0].double().requires_grad_()
    (table(indices[0], offsets[0], per_sample_weights=psw) * upstream[0].double()).sum().backward()
    return psw.grad


@pytest.mark.parametrize("recorded", [False, True], ids=["eager", "registered-op"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_per_sample_weights_get_their_gradient_from_every_class(kernels, cls, recorded, monkeypatch):
    tables, indices, offsets, weights, upstream = _case()
    merged = cls.from_embeddingbag_list(tables)
    before = merged.weight.detach().clone()
    psw = [weights[0].clone().requires_grad_(), weights[1].clone(), None]     # table 1's do not require grad
    if recorded:     # the path jit.trace and torch.compile record: the registered operator and its autograd
        monkeypatch.setattr(bag_ops, "_recorded", lambda: True)
    torch.autograd.backward(merged(indices, offsets, psw), upstream)
    assert psw[0].grad is not None, "the per-sample weights got no gradient"
    torch.testing.assert_close(psw[0].grad.double(), _expected(tables, indices, offsets, weights, upstream))
    assert psw[1].grad is None
    if cls is not MergedEmbeddingBag:
        assert not torch.equal(merged.weight.detach(), before)        # and the rows were still updated


@pytest.mark.parametrize("cls", CLASSES[1:], ids=lambda c: c.__name__)
def test_bf16_split_tables_take_the_gradient_from_the_bf16_weights_the_forward_read(kernels, cls):
    tables, indices, offsets, weights, upstream = _case()
    merged = cls.from_embeddingbag_list(tables).to_bfloat16_train()
    for table, view in zip(tables, merged.weights):
        table.weight.data = view.float()                                # what the bf16 forward reads
    psw = [weights[0].clone().requires_grad_(), None, None]
    torch.autograd.backward(merged(indices, offsets, psw), [u.bfloat16() for u in upstream])
    want = _expected(tables, indices, offsets, weights, [u.bfloat16().float() for u in upstream])
    torch.testing.assert_close(psw[0].grad.double(), want, rtol=0.01, atol=0.05)


@pytest.mark.parametrize("recorded", [False, True], ids=["eager", "registered-op"])
@pytest.mark.parametrize("cls", CLASSES[1:], ids=lambda c: c.__name__)
def test_a_frozen_fused_weight_is_not_updated_when_only_the_weights_train(kernels, cls, recorded, monkeypatch):
    tables, indices, offsets, weights, upstream = _case()
    merged = cls.from_embeddingbag_list(tables)
    merged.weight.requires_grad_(False)
    before = merged.weight.detach().clone()
    psw = [weights[0].clone().requires_grad_(), None, None]
    if recorded:
        monkeypatch.setattr(bag_ops, "_recorded", lambda: True)
    torch.autograd.backward(merged(indices, offsets, psw), upstream)
    torch.testing.assert_close(psw[0].grad.double(), _expected(tables, indices, offsets, weights, upstream))
    assert torch.equal(merged.weight, before)
