"""RoIAlign in vectorized torch ops: the path used when the compiled kernel is not built.

Same sampling as the kernel (torchvision's: the same coordinate arithmetic, in fp32, or in fp64
for fp64 input as torchvision computes it; out-of-image samples skipped), differentiable through autograd. Every sample's four corners become rows of a
gather from the image as a ``(N * H * W, C)`` matrix, weighted and summed into their output bin
with ``index_add``; boxes are processed in chunks so that the gathered rows stay below
``CHUNK_ELEMENTS`` values. Single-threaded in practice, and several times slower than the kernel.
"""
from __future__ import annotations

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor

__all__ = ["roi_align_torch"]

CHUNK_ELEMENTS = 1 << 24


def _interpolate(coords: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torchvision's bilinear rule along one axis: (low, high, weight of low, of high, valid)."""
    valid = (coords >= -1.0) & (coords <= float(size)) & (size > 0)   # NaN: no sample; nor on an empty axis
    v = coords.clamp(min=0.0)
    low = v.floor().long()
    edge = low >= size - 1
    low = torch.where(edge, torch.full_like(low, size - 1), low)
    high = torch.where(edge, low, low + 1)
    v = torch.where(edge, low.to(v.dtype), v)
    frac = v - low.to(v.dtype)
    return low, high, 1.0 - frac, frac, valid


def _samples(start: Tensor, bin_size: Tensor, grid: Tensor, bins: int, size: int) -> tuple:
    """Every box's sample coordinates along one axis, box after box: (box, bin, interpolation)."""
    counts = bins * grid
    boxes = torch.repeat_interleave(torch.arange(len(grid)), counts)
    firsts = torch.cumsum(counts, 0) - counts
    local = torch.arange(int(counts.sum())) - firsts[boxes]
    g = grid[boxes]
    which_bin, step = local // g.clamp(min=1), local % g.clamp(min=1)
    size_b = bin_size[boxes]
    real = start.dtype
    coords = start[boxes] + which_bin.to(real) * size_b + (step.to(real) + 0.5) * size_b / g.to(real)
    return boxes, which_bin, _interpolate(coords, size), firsts, counts


def roi_align_torch(input: Tensor, rois: Tensor, spatial_scale: float, out_h: int, out_w: int,
                    sampling_ratio: int, aligned: bool) -> Tensor:
    """RoIAlign of ``input`` (N, C, H, W) over ``rois`` (K, 5), in torch ops (see the module doc)."""
    batches, channels, height, width = input.shape
    count = rois.shape[0]
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    rois = rois.to(compute)   # fp64 boxes and coordinates for fp64 input (torchvision's rule)
    if count and not bool(((rois[:, 0] >= 0) & (rois[:, 0] < batches) & (rois[:, 0] == rois[:, 0].floor())).all()):
        raise RuntimeError(f"roi_align: a box batch index is not an image index in [0, {batches})")
    offset = 0.5 if aligned else 0.0
    start_w, start_h = rois[:, 1] * spatial_scale - offset, rois[:, 2] * spatial_scale - offset
    roi_w = rois[:, 3] * spatial_scale - offset - start_w
    roi_h = rois[:, 4] * spatial_scale - offset - start_h
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)
    bin_h, bin_w = roi_h / out_h, roi_w / out_w
    if sampling_ratio > 0:
        grid_h = grid_w = torch.full((count,), sampling_ratio, dtype=torch.long)
    else:
        grid_h = torch.ceil(roi_h / out_h).long().clamp(min=0)
        grid_w = torch.ceil(roi_w / out_w).long().clamp(min=0)
    inv_count = 1.0 / (grid_h * grid_w).clamp(min=1).to(compute)
    _, y_bin, (y_low, y_high, y_wl, y_wh, y_ok), y_first, y_count = _samples(start_h, bin_h, grid_h, out_h, height)
    _, x_bin, (x_low, x_high, x_wl, x_wh, x_ok), x_first, x_count = _samples(start_w, bin_w, grid_w, out_w, width)
    image = input.to(compute).permute(0, 2, 3, 1).reshape(batches * height * width, channels)
    pairs = y_count * x_count
    chunks, first = [], 0
    while first < count:
        stop, budget = first, 0
        while stop < count and (stop == first or budget + int(pairs[stop]) * 4 * channels <= CHUNK_ELEMENTS):
            budget += int(pairs[stop]) * 4 * channels
            stop += 1
        chunks.append(_chunk(image, rois, first, stop, pairs, y_first, y_count, x_first, x_count, y_bin, x_bin,
                             (y_low, y_high, y_wl, y_wh, y_ok), (x_low, x_high, x_wl, x_wh, x_ok), inv_count,
                             (height, width, out_h, out_w, channels), compute))
        first = stop
    out = torch.cat(chunks) if chunks else image.narrow(0, 0, 0)   # no boxes: still on the input's graph
    out = out.view(count, out_h, out_w, channels).permute(0, 3, 1, 2).to(input.dtype)
    channels_last = not input.is_contiguous() and input.is_contiguous(memory_format=torch.channels_last)
    return out if channels_last else out.contiguous()


def _chunk(image: Tensor, rois: Tensor, first: int, stop: int, pairs: Tensor, y_first: Tensor, y_count: Tensor,
           x_first: Tensor, x_count: Tensor, y_bin: Tensor, x_bin: Tensor, ys: tuple, xs: tuple, inv_count: Tensor,
           sizes: tuple, compute: torch.dtype) -> Tensor:
    """The output rows (box, bin_y, bin_x) x channels of boxes ``[first, stop)``."""
    height, width, out_h, out_w, channels = sizes
    boxes = torch.arange(first, stop)
    box = torch.repeat_interleave(boxes, pairs[first:stop])
    local = torch.arange(int(pairs[first:stop].sum())) - (torch.cumsum(pairs[first:stop], 0) - pairs[first:stop])[box - first]
    yi = y_first[box] + local // x_count[box].clamp(min=1)
    xi = x_first[box] + local % x_count[box].clamp(min=1)
    y_low, y_high, y_wl, y_wh, y_ok = (t[yi] for t in ys)
    x_low, x_high, x_wl, x_wh, x_ok = (t[xi] for t in xs)
    keep = y_ok & x_ok
    row = ((box - first) * out_h + y_bin[yi]) * out_w + x_bin[xi]
    base = rois[box, 0].long() * height
    scale = inv_count[box].to(compute)
    corners = [((base + y_low) * width + x_low, y_wl * x_wl), ((base + y_low) * width + x_high, y_wl * x_wh),
               ((base + y_high) * width + x_low, y_wh * x_wl), ((base + y_high) * width + x_high, y_wh * x_wh)]
    pixels = torch.cat([pixel[keep] for pixel, _ in corners])
    weights = torch.cat([(weight.to(compute) * scale)[keep] for _, weight in corners])
    rows = torch.cat([row[keep]] * 4)
    zeros = torch.zeros((stop - first) * out_h * out_w, channels, dtype=compute)
    return zeros.index_add(0, rows, image.index_select(0, pixels) * weights[:, None])
