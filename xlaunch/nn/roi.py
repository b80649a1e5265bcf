"""RoIAlign with torchvision's semantics, multi-threaded, any memory format, fp32 or bf16.

    roi_align(input, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False)

``input`` is ``(N, C, H, W)``; ``boxes`` a ``Tensor[K, 5]`` of ``(batch index, x1, y1, x2, y2)`` or
a list of ``Tensor[L, 4]``, one per image. Each box is scaled by ``spatial_scale``, split into
``output_size`` bins, and each bin averages ``sampling_ratio``^2 bilinear samples (``-1`` or
``0``: ``ceil(box size / bins)`` per axis, per box). ``aligned=True`` shifts boxes by half a pixel
(Detectron2's alignment). The result is ``(K, C, out_h, out_w)`` in the input's dtype and
memory format: channels-last in, channels-last out. fp64 input computes in fp64 (boxes and
coordinates included, as torchvision does); bf16 input is read as bf16 and summed in fp32 (what
the input of RoIAlign under ``torch.autocast`` usually is); fp16 computes in fp32 and is cast back.

The compiled kernel splits the boxes across threads in the forward and bands of image rows in
the backward (no two threads add into one gradient element). Without it, a vectorized torch
formulation (:mod:`xlaunch.nn.roi_torch`) gives the same results.
"""
from __future__ import annotations

import operator
from typing import Sequence, Union

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor, nn

from xlaunch.nn import native
from xlaunch._errors import flag, real_number, whole_number
from xlaunch.nn.roi_torch import roi_align_torch

__all__ = ["roi_align", "RoIAlign", "boxes_to_rois"]

Boxes = Union[Tensor, Sequence[Tensor]]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def boxes_to_rois(boxes: Boxes, dtype: torch.dtype = torch.float32) -> Tensor:
    """``(K, 5)`` rows ``(batch index, x1, y1, x2, y2)`` from either form of boxes (float32, or
    ``dtype``: float64 for fp64 input)."""
    if isinstance(boxes, Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise ValueError(f"boxes as one tensor must be (K, 5), got {tuple(boxes.shape)}")
        return _real_cpu(boxes, "boxes").detach().to(dtype).contiguous()
    if not isinstance(boxes, (list, tuple)):
        raise TypeError("boxes must be a (K, 5) tensor or a list of (L, 4) tensors, one per image")
    rows = []
    for image, per_image in enumerate(boxes):
        if not isinstance(per_image, Tensor) or per_image.dim() != 2 or per_image.shape[1] != 4:
            raise ValueError(f"boxes[{image}] must be an (L, 4) tensor")
        index = torch.full((per_image.shape[0], 1), float(image), dtype=dtype)
        rows.append(torch.cat([index, _real_cpu(per_image, f"boxes[{image}]").detach().to(dtype)], dim=1))
    return torch.cat(rows).contiguous() if rows else torch.zeros(0, 5, dtype=dtype)


def _real_cpu(boxes: Tensor, name: str) -> Tensor:
    """``boxes`` if it is a real CPU tensor, else one line naming it (complex coordinates lost their
    imaginary part; a meta tensor failed deep inside)."""
    if boxes.is_complex() or boxes.dtype == torch.bool:
        raise TypeError(f"roi_align: {name} must be real numbers, not {boxes.dtype}")
    if not boxes.is_cpu:
        raise ValueError(f"roi_align: {name} is on {boxes.device}; xlaunch.nn runs on the CPU")
    return boxes


def _pair(output_size: Union[int, Sequence[int]]) -> tuple[int, int]:
    """``(height, width)`` from an int or a pair of ints (anything ``operator.index`` takes)."""
    sides = tuple(output_size) if isinstance(output_size, (list, tuple, torch.Size)) else (output_size, output_size)
    try:
        if len(sides) != 2 or any(isinstance(side, bool) for side in sides):
            raise TypeError
        return operator.index(sides[0]), operator.index(sides[1])
    except TypeError:
        raise TypeError(f"roi_align: output_size must be an int or a pair (height, width) of ints, "
                        f"not {output_size!r}") from None


def _geometry(output_size: Union[int, Sequence[int]], spatial_scale: float, sampling_ratio: int,
              aligned: bool) -> tuple[float, int, int, int, bool]:
    """``(spatial_scale, height, width, sampling_ratio, aligned)`` checked: positive integer sides,
    a finite scale, an integer sampling ratio (``<= 0``: adaptive; 1.5 is refused, not truncated),
    a bool ``aligned``; one line naming the argument otherwise."""
    height, width = _pair(output_size)
    if height <= 0 or width <= 0:
        raise ValueError(f"roi_align: output_size must be positive, got {(height, width)}")
    return (real_number(spatial_scale, "roi_align: spatial_scale"), height, width,
            whole_number(sampling_ratio, "roi_align: sampling_ratio", None), flag(aligned, "roi_align: aligned"))


def _check_images(rois: Tensor, images: int) -> None:
    """``ValueError`` naming the first box whose batch index is not an image of the input (one
    pass; not while tracing or compiling, where the kernels' own check raises)."""
    if rois.numel() == 0 or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return
    index = rois[:, 0]
    bad = (index < 0) | (index >= images) | (index != index.floor())   # NaN too
    if bool(bad.any()):
        box = int(bad.nonzero()[0, 0])
        raise ValueError(f"roi_align: box {box} has batch index {float(index[box])}, which is not an image "
                         f"index in [0, {images})")


def _channels_last(x: Tensor) -> bool:
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _channels_inner(x: Tensor) -> Tensor:
    """``x`` with contiguous channels (the kernel's layout): itself, or a channels-last copy."""
    return x if x.shape[1] == 1 or x.stride(1) == 1 else x.contiguous(memory_format=torch.channels_last)


class _RoIAlignFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, rois: Tensor, geometry: tuple) -> Tensor:
        scale, height, width, sampling, aligned = geometry
        memory_format = torch.channels_last if _channels_last(input) else torch.contiguous_format
        out = torch.empty(rois.shape[0], input.shape[1], height, width, dtype=input.dtype, memory_format=memory_format)
        ops = native.ops()
        ops.roi_align_forward(_channels_inner(input), rois, scale, height, width, sampling, aligned, out)
        ctx.ops = ops        # the backward runs the forward's kernels, whatever prefer_native says by then
        ctx.save_for_backward(rois)
        ctx.geometry, ctx.input_shape, ctx.input_dtype, ctx.memory_format = geometry, input.shape, input.dtype, memory_format
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        (rois,) = ctx.saved_tensors
        scale, height, width, sampling, aligned = ctx.geometry
        grad_input = torch.zeros(ctx.input_shape, dtype=torch.float32).contiguous(memory_format=torch.channels_last)
        if grad.dtype not in KERNEL_DTYPES:
            grad = grad.float()
        ctx.ops.roi_align_backward(grad, rois, scale, height, width, sampling, aligned, grad_input)
        return grad_input.to(dtype=ctx.input_dtype, memory_format=ctx.memory_format), None, None


def roi_align(input: Tensor, boxes: Boxes, output_size: Union[int, Sequence[int]], spatial_scale: float = 1.0,
              sampling_ratio: int = -1, aligned: bool = False) -> Tensor:
    """Pool each box of ``boxes`` from ``input`` into ``output_size`` bins (see the module doc)."""
    if not isinstance(input, Tensor) or input.dim() != 4:
        raise ValueError("roi_align: input must be an (N, C, H, W) tensor")
    if not input.dtype.is_floating_point:
        raise TypeError(f"roi_align: input must be a float tensor, not {input.dtype}")
    if input.device.type != "cpu":
        raise ValueError(f"roi_align: input is on {input.device}; xlaunch.nn runs on the CPU")
    rois = boxes_to_rois(boxes, torch.float64 if input.dtype == torch.float64 else torch.float32)
    geometry = _geometry(output_size, spatial_scale, sampling_ratio, aligned)
    _check_images(rois, input.shape[0])
    ops = native.ops()
    if ops is None or input.dtype == torch.float64:
        return roi_align_torch(input, rois, *geometry)
    if input.dtype not in KERNEL_DTYPES:
        return _RoIAlignFunction.apply(input.float(), rois, geometry).to(input.dtype)
    return _RoIAlignFunction.apply(input, rois, geometry)


class RoIAlign(nn.Module):
    """:func:`roi_align` as a module (torchvision's and ``ipex.nn``'s ``RoIAlign``)."""

    def __init__(self, output_size: Union[int, Sequence[int]], spatial_scale: float = 1.0, sampling_ratio: int = -1,
                 aligned: bool = False) -> None:
        super().__init__()
        _geometry(output_size, spatial_scale, sampling_ratio, aligned)     # refused here, not at the first call
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input: Tensor, rois: Boxes) -> Tensor:
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
                f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned}")
