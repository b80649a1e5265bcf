"""Non-finite weights pool as nn.EmbeddingBag pools them, on the kernels at every level and on the
pure-torch path (max pooling: the kernel started from -inf and std::max dropped a NaN, so a bag of one
NaN row came out -inf, where torch gives NaN)."""
from __future__ import annotations

import pytest
from nn_helpers import kernels  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.nn import MergedEmbeddingBag  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [3, 16])        # a dim the kernel compiles in, and one it does not
def test_nan_and_infinite_rows_pool_as_torch_does(kernels, dim, dtype):
    weight = torch.randn(6, dim)
    weight[1, 0] = float("nan")
    weight[2, 1] = float("inf")
    weight[3, :] = float("-inf")
    weight[4, 2] = float("nan")
    tables = [nn.EmbeddingBag.from_pretrained(weight.to(dtype), mode=mode) for mode in ("max", "sum", "mean")]
    #                 [nan first]  [nan later] [nan alone] [-inf] [inf, -inf]  []  [nan, nan]
    indices = torch.tensor([1, 0, 2, 0, 1, 5, 1, 3, 2, 3, 1, 4])
    offsets = torch.tensor([0, 3, 6, 7, 8, 10, 10])
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = merged([indices] * 3, [offsets] * 3)
        for number, (out, table) in enumerate(zip(got, tables)):
            torch.testing.assert_close(out, table(indices, offsets), equal_nan=True, msg=f"table {number}")
