"""Offsets are checked table by table before anything is read or written, on the compiled kernels
and on the pure-torch paths (the ``kernels`` fixture runs both): an offset that would make a bag
read another table's indices, a decreasing or negative one, a first offset other than 0, and an
``include_last_offset`` table whose last offset is not its number of indices each raise one
``ValueError`` naming the table and the position; the weights (and Adagrad's sums) stay as they
were, and the next valid call pools and trains as the tables do."""
from __future__ import annotations

import pytest
from nn_helpers import kernels  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.nn import MergedEmbeddingBag, MergedEmbeddingBagWithAdaGrad, MergedEmbeddingBagWithSGD  # noqa: E402

pytestmark = pytest.mark.torch

INDICES = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 3, 4])]
GOOD = [torch.tensor([0, 2, 2]), torch.tensor([0, 1, 3]), torch.tensor([0, 2, 2, 5])]   # table 2: include_last_offset
# (table, its offsets, what the error says): each keeps the good call's shapes (the cached call plan's signature)
BAD = [
    (0, [0, 2, 7], r"offset 7 at position 2 of table 0 is out of range \[0, 5\]"),    # would read table 1's indices
    (0, [0, 6, 6], r"offset 6 at position 1 of table 0 is out of range \[0, 5\]"),
    (1, [0, 3, 2], r"offset 2 at position 2 of table 1 is less than the offset before it \(3\)"),
    (1, [0, -1, 2], r"offset -1 at position 1 of table 1 is out of range \[0, 4\]"),
    (1, [2, 2, 3], r"offset 2 at position 0 of table 1 is not 0"),
    (2, [0, 2, 2, 4], r"offset 4 at position 3 of table 2 is not the table's number of indices \(5\)"),
    (2, [0, 2, 2, 6], r"offset 6 at position 3 of table 2 is out of range \[0, 5\]"),
]


def make_tables(modes: tuple) -> list[nn.EmbeddingBag]:
    torch.manual_seed(0)
    return [nn.EmbeddingBag(rows, 4, mode=mode, include_last_offset=last)
            for rows, mode, last in zip((7, 5, 6), modes, (False, False, True))]


def with_bad(table: int, values: list) -> list[torch.Tensor]:
    offsets = list(GOOD)
    offsets[table] = torch.tensor(values)
    return offsets


# "run": one dim and mode (the pure-torch path pools the tables in one embedding_bag), "mixed": one call each
@pytest.mark.parametrize("modes", [("sum", "sum", "sum"), ("sum", "mean", "max")], ids=["run", "mixed"])
@pytest.mark.parametrize("fused", [MergedEmbeddingBag, MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad])
def test_bad_offsets_name_the_table_and_position_and_change_nothing(kernels, fused, modes):
    tables = make_tables(modes)
    merged = fused.from_embeddingbag_list(tables)
    with torch.no_grad():
        merged(INDICES, GOOD)                    # the pure-torch forward caches this signature's plan
    before = [t.detach().clone() for t in (merged.weight, *merged.buffers())]
    upstream = [torch.ones(3, 4) for _ in tables]
    for table, values, message in BAD:
        offsets = with_bad(table, values)
        with pytest.raises(ValueError, match=message), torch.no_grad():
            merged(INDICES, offsets)
        with pytest.raises(ValueError, match=message):
            torch.autograd.backward(merged(INDICES, offsets), upstream)
    assert all(torch.equal(t, b) for t, b in zip((merged.weight, *merged.buffers()), before))
    assert merged.weight.grad is None
    with torch.no_grad():
        for got, table, idx, off in zip(merged(INDICES, GOOD), tables, INDICES, GOOD):
            torch.testing.assert_close(got, table(idx, off))
    torch.autograd.backward(merged(INDICES, GOOD), upstream)                  # and a step still trains
    assert merged.weight.grad is not None if fused is MergedEmbeddingBag else not torch.equal(merged.weight, before[0])


def test_include_last_offset_follows_the_documented_csr_form(kernels):
    """nn.EmbeddingBag documents the last offset as the indices' size; for one that stops short it
    disagrees with itself (sum stops at it, mean divides that sum by the bag's count to the end, max
    reads to the end), so a short last offset is refused; equal to the size, every mode matches."""
    idx, short = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 4])
    weight = torch.arange(20.0).view(10, 2)
    torch_mean = nn.EmbeddingBag.from_pretrained(weight, mode="mean", include_last_offset=True)(idx, short)
    assert torch_mean[2].tolist() == pytest.approx([14 / 3, 16 / 3])            # rows 3 + 4 over three lookups
    for mode in ("sum", "mean", "max"):
        table = nn.EmbeddingBag.from_pretrained(weight, mode=mode, include_last_offset=True)
        merged = MergedEmbeddingBag.from_embeddingbag_list([table])
        with pytest.raises(ValueError, match="position 3 of table 0 is not the table's number of indices"):
            merged([idx], [short])
        full = torch.tensor([0, 2, 2, 5])
        torch.testing.assert_close(merged([idx], [full])[0], table(idx, full))


@pytest.mark.parametrize("fused", [MergedEmbeddingBag, MergedEmbeddingBagWithSGD])
def test_two_d_bags_of_size_zero_and_offsets_of_another_type(kernels, fused):
    tables = make_tables(("sum", "mean", "max"))
    merged = fused.from_embeddingbag_list(tables)
    before = merged.weight.detach().clone()
    empty = [torch.zeros(3, 0, dtype=torch.int64)] * 3      # (batch, bag size 0): arange's step was 0
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            outs = merged(empty)
        assert [tuple(o.shape) for o in outs] == [(3, 4)] * 3 and all(not o.any() for o in outs)
        if grad:
            sum(o.sum() for o in outs).backward()
    assert torch.equal(merged.weight.detach(), before)
    floats = [GOOD[0].float(), *GOOD[1:]]                   # were truncated to integers, silently
    with pytest.raises(TypeError, match=r"^offsets of table 0 must be an integer tensor, not torch.float32$"):
        merged(INDICES, floats)
    with pytest.raises(ValueError, match=r"^indices of table 1 are on meta; xlaunch.nn runs on the CPU$"):
        merged([INDICES[0], INDICES[1].to("meta"), INDICES[2]], GOOD)
