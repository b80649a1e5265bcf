"""IPEX's own CPU operator tests, mirrored: the calls, argument forms, attribute names, dtypes and
reference checks of intel-extension-for-pytorch's tests/cpu/test_merged_embeddingbag.py,
test_interaction.py, test_frozen_batch_norm.py and test_roialign.py, at small sizes.

The body reaches every operator through ``ipex`` as IPEX's tests do (``ipex.nn.modules.X``,
``ipex.nn.functional.interaction``, ``ipex.nn.modules._roi_align.RoIAlign``): the import line below
is the one line a port changes. One deviation, marked where it is: IPEX builds the bf16 reference
of the fused update with ``ipex.optimize(dtype=torch.bfloat16, optimizer=...)``, which also casts
``nn.EmbeddingBag`` weights; ``xlaunch.optimize`` casts convolution and linear weights only, so the
bf16 reference here is the fp32 tables with ``torch.optim``, compared at IPEX's bf16 tolerance.
"""
from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import xlaunch as ipex  # noqa: E402  (IPEX: import intel_extension_for_pytorch as ipex)

pytestmark = pytest.mark.torch

MULTI_HOT = [3, 2, 1, 12]      # IPEX's list of 26 pooling factors, four of them
ROWS, BATCH = 40, 5


def assert_equal(actual, expected, rtol=None, atol=None) -> None:
    """``TestCase.assertEqual`` as IPEX's tests use it: dtypes must match, NaN equals NaN."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


class EmbeddingBagList(torch.nn.Module):
    """The unmerged reference: one ``nn.EmbeddingBag`` per table, called in a loop."""

    def __init__(self, tables: int, dim: int, dtype: torch.dtype, include_last_offset: bool = False,
                 mode: str = "sum") -> None:
        super().__init__()
        self.list = torch.nn.ModuleList(torch.nn.EmbeddingBag(ROWS, dim, dtype=dtype, mode=mode,
                                                              include_last_offset=include_last_offset)
                                        for _ in range(tables))

    def forward(self, indices, offsets):
        return [emb(indices[i], offsets[i]) for i, emb in enumerate(self.list)]


class CatDense(torch.nn.Module):
    def __init__(self, emb_list: EmbeddingBagList) -> None:
        super().__init__()
        self.emb_list = emb_list

    def forward(self, indices, offsets, dense):
        return torch.cat([dense] + self.emb_list(indices, offsets), dim=1)


class Merged(torch.nn.Module):
    """A model holding a merged bag as ``merged_emb`` (the attribute IPEX's tests read)."""

    def __init__(self, cls, emb_list: EmbeddingBagList, **kwargs) -> None:
        super().__init__()
        self.merged_emb = cls.from_embeddingbag_list(emb_list.list, **kwargs)

    def forward(self, *inputs):
        return self.merged_emb(*inputs)


def bag_inputs(index_type: torch.dtype, include_last_offset: bool) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(0)
    indices = [torch.randint(ROWS, (BATCH * hot,), generator=gen).to(index_type) for hot in MULTI_HOT]
    count = BATCH + 1 if include_last_offset else BATCH
    offsets = [torch.arange(0, count * hot, hot).to(index_type) for hot in MULTI_HOT]
    return indices, offsets


# (index dtype, include_last_offset, dim): IPEX loops over all of them; each test here takes one
# of two combinations per parameter set, so that the set covers both (dim 128: the kernels' fast
# path, 129: the general one).
CASES = [(torch.int32, True, 128), (torch.int64, False, 129)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_merged_inference_trace_autocast_and_cat(dtype, mode):
    """test_merged_embeddingbag.py::test_inference: forward equal to the loop, a traced and frozen
    module equal too, bf16 and fp16 outputs under autocast (fp32 tables), and the cat form (sum)."""
    torch.manual_seed(0)
    for index_type, include_last_offset, dim in [CASES[(DTYPES.index(dtype) + (mode == "sum")) % 2]]:
        indices, offsets = bag_inputs(index_type, include_last_offset)
        emb_list = EmbeddingBagList(len(MULTI_HOT), dim, dtype, include_last_offset=include_last_offset, mode=mode)
        m, ref_m = Merged(ipex.nn.modules.MergedEmbeddingBag, emb_list).eval(), copy.deepcopy(emb_list).eval()
        with torch.no_grad():
            ref_out = ref_m(indices, offsets)
            assert_equal(m(indices, offsets), ref_out)
            if mode == "sum":
                jit_m = torch.jit.freeze(torch.jit.trace(m, (indices, offsets)))
                jit_m(indices, offsets)
                assert_equal(jit_m(indices, offsets), ref_out)
        for low in (torch.bfloat16, torch.float16) if dtype == torch.float32 else ():
            with torch.no_grad(), torch.autocast("cpu", dtype=low):
                out = m(indices, offsets)
            assert all(o.dtype is low for o in out)
            assert_equal([o.float() for o in out], [o.float() for o in ref_out], atol=0.1, rtol=0.1)
        if mode == "sum":
            dense = torch.randn(BATCH, dim, dtype=dtype)
            cat_m = Merged(ipex.nn.modules.MergedEmbeddingBagWithCat, emb_list).eval()
            with torch.no_grad():
                assert_equal(cat_m(indices, offsets, dense), CatDense(emb_list)(indices, offsets, dense))


def _check_trained(m, ref_m, inputs, opt=None, bf16=False) -> None:
    """IPEX's _test_training: equal outputs; after ``sum(out).sum().backward()`` (and the
    reference optimizer's step) equal dense grads, or equal weights for the fused classes."""
    m.train()
    ref_m.train()
    if opt is not None:
        opt.zero_grad()
    out, ref_out = m(*inputs), ref_m(*inputs)
    if bf16:    # the deviation (module doc): an fp32 reference for the split-bf16 tables
        assert_equal([o.float() for o in out], ref_out, rtol=0.1, atol=0.1)
    else:
        assert_equal(out, ref_out)
    sum(out).sum().backward()
    sum(ref_out).sum().backward()
    if opt is not None:
        opt.step()
    narrow = bf16 or m.merged_emb.weights[0].dtype in (torch.float16, torch.bfloat16)
    rtol, atol = (0.1, 0.1) if narrow else (1e-5, 0.016)
    for i in range(len(out)):
        if opt is not None:
            got = m.merged_emb.weights[i].float() if bf16 else m.merged_emb.weights[i]
            assert_equal(got, ref_m.list[i].weight, rtol=rtol, atol=atol)
        else:
            assert_equal(m.merged_emb.weights[i].grad, ref_m.list[i].weight.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_training_dense_grads_sgd_and_adagrad(dtype):
    """test_merged_embeddingbag.py::test_training: per-table dense grads (``weights[i].grad``),
    and one fused SGD / Adagrad step equal to ``torch.optim`` on the loop (bf16: split-bf16 tables
    after ``to_bfloat16_train``; IPEX skips fp16 for the fused classes, so does this test)."""
    torch.manual_seed(0)
    for index_type, include_last_offset, dim in [CASES[DTYPES.index(dtype) % 2]]:
        inputs = bag_inputs(index_type, include_last_offset)
        mode = "sum" if dtype in (torch.float64, torch.bfloat16) else "mean"
        emb_list = EmbeddingBagList(len(MULTI_HOT), dim, dtype, include_last_offset=include_last_offset, mode=mode)
        _check_trained(Merged(ipex.nn.modules.MergedEmbeddingBag, copy.deepcopy(emb_list)), copy.deepcopy(emb_list),
                       inputs)
        if dtype == torch.float16:
            continue
        if dtype == torch.bfloat16:
            emb_list = EmbeddingBagList(len(MULTI_HOT), dim, torch.float32, include_last_offset=include_last_offset)
        for cls, optim, kwargs in ((ipex.nn.modules.MergedEmbeddingBagWithSGD, torch.optim.SGD, {"lr": 0.1}),
                                   (ipex.nn.modules.MergedEmbeddingBagWithAdaGrad, torch.optim.Adagrad, {"lr": 0.01})):
            m = Merged(cls, copy.deepcopy(emb_list), **kwargs)
            ref_m = copy.deepcopy(emb_list)
            opt = optim(ref_m.parameters(), **kwargs)
            if dtype == torch.bfloat16:
                m.merged_emb.to_bfloat16_train()
            _check_trained(m, ref_m, inputs, opt=opt, bf16=dtype == torch.bfloat16)


def _join_bf16(top: torch.Tensor, trail: torch.Tensor) -> torch.Tensor:
    """``torch_ipex.cat_bfloat16_float``: fp32 values from their bf16 high and low halves."""
    high = top.view(torch.int16).to(torch.int32) << 16
    return (high | (trail.view(torch.int16).to(torch.int32) & 0xFFFF)).view(torch.float32)


def test_sgd_args_and_adagrad_args_hold_ipex_fields():
    """The older test_merged_embeddingbag.py's test_cast_bfloat16 and test_training_with_weight_decay
    read ``sgd_args`` (lr, weight_decay, per-table bf16_trail); the distributed test reads
    ``adagrad_args.hessian`` per table. The trails are the exact low halves of the fp32 master."""
    tables = [torch.nn.EmbeddingBag(9, 4, mode="sum"), torch.nn.EmbeddingBag(6, 4, mode="sum")]
    model = ipex.nn.modules.MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=1.0, weight_decay=0.1)
    assert (model.sgd_args.lr, model.sgd_args.weight_decay) == (1.0, 0.1)
    model.to_bfloat16_train()
    for number, table in enumerate(tables):
        trail = model.sgd_args.bf16_trail[number]
        assert trail.dtype == torch.bfloat16 and trail.shape == table.weight.shape
        assert torch.equal(_join_bf16(model.weights[number], trail), table.weight.detach())
    adagrad = ipex.nn.modules.MergedEmbeddingBagWithAdaGrad.from_embeddingbag_list(tables, lr=0.5, eps=1e-8)
    out = adagrad([torch.tensor([1, 8]), torch.tensor([5])], [torch.tensor([0, 1]), torch.tensor([0, 1])])
    sum(out).sum().backward()
    hessian = adagrad.adagrad_args.hessian
    assert [h.shape for h in hessian] == [(9, 4), (6, 4)] and adagrad.adagrad_args.lr == 0.5
    assert torch.equal(hessian[0][1], torch.ones(4)) and torch.equal(hessian[1][5], torch.ones(4))
    assert float(hessian[0].sum() + hessian[1].sum()) == 4 * 3


def _interact_features(x, ly):
    batch_size, d = x.shape
    stacked = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
    z = torch.bmm(stacked, torch.transpose(stacked, 1, 2))
    _, ni, nj = z.shape
    li = torch.tensor([i for i in range(ni) for j in range(i)])
    lj = torch.tensor([j for i in range(nj) for j in range(i)])
    return torch.cat([x] + [z[:, li, lj]], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature_size", [127, 128])
def test_interaction_matches_cat_bmm_index(dtype, feature_size):
    """test_interaction.py: ``ipex.nn.functional.interaction(*[x] + ly)`` against cat + bmm + index,
    forward at 1e-4 in fp32 and at IPEX's rtol 0.005 / atol 0.1 in bf16 (two bf16 reductions may
    round a value one bf16 step apart, 2^-7 relative: which values do depends on the CPU's
    kernels), gradients at rtol 0.005 / atol 0.1 (batch 64 here, 26 sparse features)."""
    torch.manual_seed(0)
    x1 = torch.randn([64, feature_size]).to(dtype).clone().detach().requires_grad_()
    x2 = x1.clone().detach().requires_grad_()
    ly1 = [torch.randn([64, feature_size]).to(dtype).requires_grad_() for _ in range(26)]
    ly2 = [v.clone().detach().requires_grad_() for v in ly1]
    a = ipex.nn.functional.interaction(*([x1] + ly1))
    b = _interact_features(x2, ly2)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.005, atol=0.1)
    torch.testing.assert_close(a, b, **tolerance)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0.005, atol=0.1)
    for v1, v2 in zip(ly1, ly2):
        torch.testing.assert_close(v1.grad, v2.grad, rtol=0.005, atol=0.1)


def _frozen_bn_reference(x, weight, bias, running_mean, running_var, eps=1e-5):
    """torchvision.ops.misc.FrozenBatchNorm2d's forward (the reference of IPEX's test)."""
    scale = weight * (running_var + eps).rsqrt()
    shift = bias - running_mean * scale
    return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("autocast", [False, True])
def test_frozen_batch_norm_matches_torchvision_formula(autocast):
    """test_frozen_batch_norm.py: random statistics set as attributes (NaN where the variance is
    negative, as in the reference), fp32 or bf16 under autocast, the dtype and channels-last kept
    in the output and in the input's gradient."""
    torch.manual_seed(0)
    m = ipex.nn.FrozenBatchNorm2d(100)
    m.running_mean = torch.randn(100)
    m.running_var = torch.randn(100)
    dtype = torch.bfloat16 if autocast else torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        base = torch.randn(2, 100, 5, 7).to(dtype)
        for memory_format in (torch.contiguous_format, torch.channels_last):
            x = base.clone().detach().to(memory_format=memory_format).requires_grad_()
            x1 = base.clone().detach().requires_grad_()
            y = m(x)
            y1 = _frozen_bn_reference(x1, m.weight, m.bias, m.running_mean, m.running_var).to(dtype)
            assert y.dtype == dtype and y.is_contiguous(memory_format=memory_format)
            assert_equal(y, y1, rtol=0.1 if autocast else None, atol=0.1 if autocast else None)
            y.mean().backward()
            y1.mean().backward()
            assert x.grad.dtype == dtype and x.grad.is_contiguous(memory_format=memory_format)
            assert_equal(x.grad, x1.grad)


def _bilinear(data, y, x):
    """IPEX's bilinear_interpolate (border snapped), on every channel of ``(C, H, W)`` at once."""
    height, width = data.shape[1:]
    y = 0 if -1 < y <= 0 else (height - 1 if height - 1 <= y < height else y)
    x = 0 if -1 < x <= 0 else (width - 1 if width - 1 <= x < width else x)
    y_low, x_low = int(math.floor(y)), int(math.floor(x))
    value = 0
    for wx, xp in ((1 - (x - x_low), x_low), (x - x_low, x_low + 1)):
        for wy, yp in ((1 - (y - y_low), y_low), (y - y_low, y_low + 1)):
            if 0 <= yp < height and 0 <= xp < width:
                value = value + wx * wy * data[:, yp, xp]
    return value


def _expected_roi_align(in_data, rois, pool_h, pool_w):
    """IPEX's plain-loop RoIAlign (spatial scale 1, adaptive sampling, not aligned), differentiable
    (its loop over channels vectorized)."""
    out = []
    for roi in rois:
        batch, x_begin, y_begin, x_end, y_end = (float(v) for v in roi)
        bin_h, bin_w = (y_end - y_begin) / pool_h, (x_end - x_begin) / pool_w
        grid_h, grid_w = int(math.ceil(bin_h)), int(math.ceil(bin_w))
        planes = in_data[int(batch)]
        for i in range(pool_h):
            for j in range(pool_w):
                total = 0
                for iy in range(grid_h):
                    y = y_begin + i * bin_h + (iy + 0.5) * bin_h / grid_h
                    for ix in range(grid_w):
                        total = total + _bilinear(planes, y, x_begin + j * bin_w + (ix + 0.5) * bin_w / grid_w)
                out.append(total / (grid_h * grid_w))
    return torch.stack(out, dim=1).view(in_data.shape[1], len(rois), pool_h, pool_w).transpose(0, 1)


def test_roialign_dtypes_channels_last_and_autocast():
    """test_roialign.py::test_roialign: ``ipex.nn.modules._roi_align.RoIAlign`` for fp64, fp32 and
    fp16 input (no_grad forward, forward + backward, channels-last kept), and under autocast with
    bf16 input and bf16 boxes; against the plain-loop reference in fp32."""
    torch.manual_seed(0)
    pool = 5
    rois32 = torch.tensor([[0, 0, 0, 9, 9], [0, 0, 5, 4, 9], [0, 5, 5, 9, 9], [1, 0, 0, 9, 9]], dtype=torch.float32)
    x = torch.rand(2, 2 * pool ** 2, 10, 10)     # IPEX: n_channels % pool ** 2 == 0
    gt_x = x.clone().requires_grad_()
    gt_y = _expected_roi_align(gt_x, rois32, pool, pool)
    gt_y.mean().backward()

    def fn(inp, rois):
        return ipex.nn.modules._roi_align.RoIAlign((pool, pool), spatial_scale=1, sampling_ratio=-1,
                                                   aligned=False)(inp, rois)

    for dtype in (torch.double, torch.float32, torch.float16):
        xd, rois = x.to(dtype), rois32.to(dtype)
        with torch.no_grad():
            y0 = fn(xd.clone(), rois)
        assert y0.dtype == dtype and torch.allclose(gt_y.to(dtype), y0, rtol=1e-2, atol=1e-2)
        for memory_format in (torch.contiguous_format, torch.channels_last):
            x1 = xd.clone().to(memory_format=memory_format).requires_grad_()
            y1 = fn(x1, rois)
            assert y1.dtype == dtype and y1.is_contiguous(memory_format=memory_format)
            assert torch.allclose(gt_y.to(dtype), y1, rtol=1e-2, atol=1e-2)
            y1.mean().backward()
            assert x1.grad.dtype == dtype and x1.grad.is_contiguous(memory_format=memory_format)
            assert torch.allclose(gt_x.grad.to(dtype), x1.grad, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu"):
        x3 = x.clone().bfloat16().to(memory_format=torch.channels_last).requires_grad_()
        y3 = fn(x3, rois32.bfloat16())
        y3.mean().backward()
        assert y3.dtype == torch.bfloat16 and torch.allclose(gt_y.to(y3.dtype), y3, rtol=1e-2, atol=1e-2)
        assert x3.grad.dtype == torch.bfloat16
        assert torch.allclose(gt_x.grad.to(x3.dtype), x3.grad, rtol=1e-5, atol=1e-5)
