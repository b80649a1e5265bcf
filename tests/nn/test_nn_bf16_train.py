"""``to_bfloat16_train()`` of the fused classes from every weight dtype: a split fp32 master holding
the tables' exact values (fp16 tables were left fp16, silently)."""
from __future__ import annotations

import pytest
from nn_helpers import kernels  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.nn import MergedEmbeddingBagWithAdaGrad, MergedEmbeddingBagWithSGD  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("fused", [MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad], ids=lambda c: c.__name__)
def test_to_bfloat16_train_splits_every_float_dtype_into_an_exact_master(kernels, fused, dtype):
    gen = torch.Generator().manual_seed(7)
    tables = [nn.EmbeddingBag.from_pretrained(torch.randn(9, 4, generator=gen).to(dtype), freeze=False, mode=mode)
              for mode in ("sum", "mean")]
    indices, offsets = [torch.tensor([0, 3, 3, 8]), torch.tensor([1, 2, 1])], [torch.tensor([0, 2]), torch.tensor([0, 1])]
    upstream = [torch.randn(2, 4, generator=gen).bfloat16() for _ in tables]
    split = fused.from_embeddingbag_list(tables, lr=0.1).to_bfloat16_train()
    assert split.weight.dtype == torch.bfloat16 and split.trail is not None
    want = torch.cat([t.weight.detach().float().reshape(-1) for t in tables])
    assert torch.equal(split.master_weight(), want)             # fp16 and fp32 exactly; fp64 its fp32 value
    cast = fused.from_embeddingbag_list(tables, lr=0.1).bfloat16()    # the module cast, the same split
    for module in (split, cast):
        torch.autograd.backward(module(indices, offsets), upstream)
    assert torch.equal(split.master_weight(), cast.master_weight())
    assert not torch.equal(split.master_weight(), want)         # and it trained


def _cached_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _cached_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _cached_tensors(item)


@pytest.mark.parametrize("convert", ["to_bfloat16_train", "float", "half"])
def test_a_cast_keeps_no_view_of_the_old_weight(convert):
    """The pure-torch forward caches views of the weight's blocks; after a cast they held the old
    storage (the whole table: 205 MB more after to_bfloat16_train of a 205 MB table) until the next
    forward on that path."""
    from xlaunch.nn import native
    tables = [nn.EmbeddingBag(30, 4, mode="sum"), nn.EmbeddingBag(20, 4, mode="sum")]
    merged = MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables).double()
    indices, offsets = [torch.tensor([1, 2, 3])] * 2, [torch.tensor([0, 1])] * 2
    with native.prefer_native(False), torch.no_grad():
        merged(indices, offsets)                                  # fills the cache
        old = merged.weight.data_ptr()
        assert any(t.untyped_storage().data_ptr() == old for t in _cached_tensors(merged.layout.cache))
        getattr(merged, convert)()
        assert not any(t.untyped_storage().data_ptr() == old for t in _cached_tensors(merged.layout.cache))
        got = merged(indices, offsets)
    want = [nn.EmbeddingBag.from_pretrained(w.float(), mode="sum")(i, o) for w, i, o in zip(merged.weights, indices, offsets)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, rtol=1e-2, atol=1e-2)
