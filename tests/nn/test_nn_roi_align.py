"""roi_align / RoIAlign against a plain-Python transcription of torchvision's bilinear sampling,
forward and backward, on the compiled kernel and on the pure-torch path."""
from __future__ import annotations

import math

import pytest
from nn_helpers import dispatch, kernels  # noqa: F401 - the fixtures

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.nn import RoIAlign, roi_align  # noqa: E402

pytestmark = pytest.mark.torch


def reference(image: torch.Tensor, rois: list, out_h: int, out_w: int, scale: float, sampling: int, aligned: bool,
              upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's RoIAlign, loop by loop in float64: (output, gradient of sum(output * upstream))."""
    image = image.double()
    _, channels, height, width = image.shape
    out = torch.zeros(len(rois), channels, out_h, out_w, dtype=torch.float64)
    grad = torch.zeros_like(image)
    for k, (b, x1, y1, x2, y2) in enumerate(rois):
        b, offset = int(b), 0.5 if aligned else 0.0
        start_w, start_h = x1 * scale - offset, y1 * scale - offset
        roi_w, roi_h = x2 * scale - offset - start_w, y2 * scale - offset - start_h
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / out_h, roi_w / out_w
        grid_h = sampling if sampling > 0 else math.ceil(roi_h / out_h)
        grid_w = sampling if sampling > 0 else math.ceil(roi_w / out_w)
        count = max(grid_h * grid_w, 1)
        for ph in range(out_h):
            for pw in range(out_w):
                for iy in range(grid_h):
                    y = start_h + ph * bin_h + (iy + 0.5) * bin_h / grid_h
                    for ix in range(grid_w):
                        x = start_w + pw * bin_w + (ix + 0.5) * bin_w / grid_w
                        if y < -1.0 or y > height or x < -1.0 or x > width:
                            continue
                        yy, xx = max(y, 0.0), max(x, 0.0)
                        y_low, x_low = int(yy), int(xx)
                        if y_low >= height - 1:
                            y_low = y_high = height - 1
                            yy = float(y_low)
                        else:
                            y_high = y_low + 1
                        if x_low >= width - 1:
                            x_low = x_high = width - 1
                            xx = float(x_low)
                        else:
                            x_high = x_low + 1
                        ly, lx = yy - y_low, xx - x_low
                        hy, hx = 1.0 - ly, 1.0 - lx
                        for w, (r, c) in ((hy * hx, (y_low, x_low)), (hy * lx, (y_low, x_high)),
                                          (ly * hx, (y_high, x_low)), (ly * lx, (y_high, x_high))):
                            out[k, :, ph, pw] += w * image[b, :, r, c] / count
                            grad[b, :, r, c] += w * upstream[k, :, ph, pw].double() / count
    return out, grad


def case(seed: int = 0) -> tuple[torch.Tensor, list]:
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(2, 5, 9, 11, generator=gen)
    rois = [[0, 1.3, 2.1, 13.7, 11.2],        # in image coordinates, spatial_scale 0.5
            [1, -3.2, -1.7, 6.4, 5.9],        # partly outside the image
            [1, 15.1, 12.3, 25.8, 19.6],      # past the right and bottom edges
            [0, 4.4, 4.9, 5.1, 5.2],          # smaller than a pixel
            [1, 0.6, 0.3, 21.9, 17.4]]        # nearly the whole image
    return image, rois


_references: dict = {}


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling", [0, 2])
def test_forward_and_backward_equal_the_reference(kernels, aligned, sampling):
    image, rois = case()
    x = image.clone().requires_grad_()
    out = roi_align(x, torch.tensor(rois), (3, 4), 0.5, sampling, aligned)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(upstream)
    if (aligned, sampling) not in _references:    # the same for both kernels: computed once
        _references[aligned, sampling] = reference(image, rois, 3, 4, 0.5, sampling, aligned, upstream)
    want, want_grad = _references[aligned, sampling]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-5, atol=1e-5)


def test_boxes_as_a_list_per_image_and_the_module(kernels):
    image, rois = case()
    per_image = [torch.tensor([r[1:] for r in rois if r[0] == b]) for b in (0, 1)]
    as_tensor = torch.tensor(sorted(rois, key=lambda r: r[0]))
    module = RoIAlign(2, spatial_scale=0.5, sampling_ratio=-1, aligned=True)
    torch.testing.assert_close(module(image, per_image), roi_align(image, as_tensor, 2, 0.5, -1, True))
    assert "output_size=2" in repr(module)


def test_channels_last_in_is_channels_last_out(kernels):
    image, rois = case()
    last = image.to(memory_format=torch.channels_last).requires_grad_()
    out = roi_align(last, torch.tensor(rois), 3, 0.5, 2, False)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    out.sum().backward()
    assert last.grad.is_contiguous(memory_format=torch.channels_last)
    plain = roi_align(image, torch.tensor(rois), 3, 0.5, 2, False)
    assert plain.is_contiguous()
    torch.testing.assert_close(out, plain)


def test_bf16_input_and_autocast(kernels):
    image, rois = case()
    boxes = torch.tensor(rois)
    want = roi_align(image, boxes, 3, 0.5, 2, True)
    got = roi_align(image.bfloat16(), boxes, 3, 0.5, 2, True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=3e-2)
    conv = nn.Conv2d(5, 5, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = conv(image.to(memory_format=torch.channels_last))
        pooled = roi_align(features, boxes, 3, 0.5, 2, True)
    assert pooled.dtype == torch.bfloat16 and pooled.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(pooled.float(), roi_align(conv(image), boxes, 3, 0.5, 2, True), rtol=3e-2, atol=5e-2)


def test_results_do_not_depend_on_the_thread_count(kernels):
    gen = torch.Generator().manual_seed(3)
    image = torch.randn(2, 64, 20, 24, generator=gen).to(memory_format=torch.channels_last)
    boxes = torch.cat([torch.randint(0, 2, (40, 1)).float(), torch.rand(40, 2, generator=gen) * 20,
                       torch.rand(40, 2, generator=gen) * 20 + 20], dim=1)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = image.clone().requires_grad_()
            out = roi_align(x, boxes, 7, 0.5, 0, True)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), x.grad))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_box_on_a_missing_image_is_refused(kernels):
    image, _ = case()
    for index in (2.0, -1.0, 0.5, math.nan):
        with pytest.raises(ValueError, match=r"^roi_align: box 1 has batch index .* not an image index in \[0, 2\)$"):
            roi_align(image, torch.tensor([[0, 0, 0, 4, 4], [index, 0, 0, 4, 4]]), 2)
    with pytest.raises(ValueError, match="must be \\(K, 5\\)"):
        roi_align(image, torch.zeros(3, 4), 2)
    for size in (2.5, (2, 2, 2), True, "2"):
        with pytest.raises(TypeError, match="^roi_align: output_size must be an int or a pair"):
            roi_align(image, torch.zeros(1, 5), size)
    with pytest.raises(ValueError, match="^roi_align: input is on meta; xlaunch.nn runs on the CPU$"):
        roi_align(torch.empty(1, 5, 4, 4, device="meta"), torch.zeros(1, 5), 2)
    # boxes off the CPU failed deep inside ("item() cannot be called on meta tensors"), complex ones
    # lost their imaginary part with a warning
    with pytest.raises(ValueError, match=r"^roi_align: boxes is on meta; xlaunch.nn runs on the CPU$"):
        roi_align(image, torch.zeros(1, 5, device="meta"), 2)
    with pytest.raises(ValueError, match=r"^roi_align: boxes\[1\] is on meta; xlaunch.nn runs on the CPU$"):
        roi_align(image, [torch.zeros(1, 4), torch.zeros(1, 4, device="meta")], 2)
    with pytest.raises(TypeError, match=r"^roi_align: boxes must be real numbers, not torch.complex64$"):
        roi_align(image, torch.zeros(1, 5, dtype=torch.complex64), 2)


def test_non_finite_boxes_and_empty_images_sample_nothing(kernels):
    # A NaN corner (or an infinite one, whose bins are NaN) has no samples: zeros, as on the torch
    # path. The kernel converted NaN to an integer and wrote outside the gradient image.
    image = torch.arange(1.0, 3.0).view(1, 1, 1, 2).requires_grad_()
    nan, inf = math.nan, math.inf
    boxes = torch.tensor([[0, 0.5, nan, 1.5, 1.5], [0, nan, 0.2, 1.5, 1.5], [0, 0.1, 0.1, inf, 0.9],
                          [0, -inf, 0.1, 1.0, 0.9], [0, 0.1, 0.1, 1e30, 1e30]])
    for sampling in (2, 0):
        out = roi_align(image, boxes, 2, 1.0, sampling, False)
        assert torch.equal(out, torch.zeros(5, 1, 2, 2))
        out.sum().backward()
        assert torch.equal(image.grad, torch.zeros_like(image))
    good = roi_align(image, torch.tensor([[0, 0.5, 0.2, 1.5, 0.8]]), 2, 1.0, 2, False)
    assert torch.equal(roi_align(image, torch.tensor([[0, 0.5, 0.2, 1.5, 0.8], [0, nan, 0, 1, 1]]), 2, 1.0, 2,
                                 False)[:1], good)
    for shape in ((1, 3, 0, 5), (1, 3, 5, 0)):      # an empty image: it read the memory before it
        empty = torch.zeros(shape, requires_grad=True)
        out = roi_align(empty, torch.tensor([[0, 0.1, 0.1, 0.4, 0.4]]), 2, 1.0, 2, True)
        assert torch.equal(out, torch.zeros(1, 3, 2, 2))
        out.sum().backward()
        assert empty.grad.shape == shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_boxes_still_backpropagates(kernels, dtype):
    image = torch.randn(1, 2, 4, 4, dtype=dtype, requires_grad=True)
    for boxes in (torch.zeros(0, 5), [torch.zeros(0, 4)]):
        out = roi_align(image, boxes, 2)
        assert out.shape == (0, 2, 2, 2) and out.requires_grad
        (out.sum() * 1.0).backward()      # a loss over no boxes (the torch path had no graph: it raised)
        assert torch.equal(image.grad, torch.zeros_like(image))


def test_fp64_input_computes_in_fp64(kernels):
    image, rois = case(3)
    image = image.double().requires_grad_()
    upstream = torch.randn(len(rois), 5, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want, want_grad = reference(image.detach(), rois, 3, 2, 0.5, 0, True, upstream)
    got = roi_align(image, torch.tensor(rois, dtype=torch.float64), (3, 2), 0.5, 0, True)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(got, image, upstream)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dispatch", ["native"], indirect=True)
def test_torch_compile_equals_eager(dispatch):
    # The kernel had no meta implementation: tracing ran it on fake tensors and compiling failed,
    # fullgraph or not. (The pure-torch path's sample counts depend on the boxes: it compiles with
    # graph breaks, 8 s of the suite's CPU for what torch.compile itself does: not run here.)
    image, rois = case()
    module = RoIAlign((3, 2), 0.5, 2, True)
    compiled = torch.compile(module, fullgraph=dispatch == "native", backend="aot_eager")
    x, y = image.clone().requires_grad_(), image.clone().requires_grad_()
    got, want = compiled(x, torch.tensor(rois)), module(y, torch.tensor(rois))
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("later", [False, True])
def test_the_backward_runs_the_forwards_kernels_whatever_prefer_native_says_then(dispatch, later):
    """A compiled forward whose backward ran inside prefer_native(False) was an AttributeError
    ('NoneType' object has no attribute 'roi_align_backward')."""
    from xlaunch.nn import native

    image, rois = case()
    boxes, grads = torch.tensor(rois), []
    for switch in (False, True):
        x = image.clone().requires_grad_()
        out = roi_align(x, boxes, 3, 0.5, 2, True)
        with native.prefer_native(later) if switch else torch.enable_grad():
            out.backward(torch.ones_like(out))
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
