"""Pooling and row updates of merged embedding bags: the compiled kernels, or pure torch.

``pool`` returns each table's ``(batch, dim)`` output (or one ``(batch, width)`` matrix with a
dense feature first). With the compiled kernels, training runs through an autograd function
whose backward is the kernel's (a dense gradient for ``MergedEmbeddingBag``; for the fused
classes, an update of the touched rows and no gradient at all). Without them, ``F.embedding_bag``
pools each run of tables sharing a dim and mode, and :func:`update_rows` sums each touched row's
gradient with torch ops and applies the same update: same results, slower.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.nn.functional as F
    from torch import Tensor

from xlaunch.kernels.optim.splitbf16 import join_into, split_into
from xlaunch.nn import native
from xlaunch.nn.tables import BagInputs, TableLayout

WRITE_GRAD, SGD, ADAGRAD = 0, 1, 2   # update kinds (xlaunch/nn/csrc/bag_common.h, enum Kind)
Outputs = Union[list, Tensor]
# Called by the fused classes' backward with (per-table upstream gradients, inputs).
UpdateHook = Callable[[list, BagInputs], None]


def _places(layout: TableLayout, batch: int, dense: Optional[Tensor]) -> tuple[list[int], list[int]]:
    if dense is None:
        return [0] * len(layout), list(layout.dims)
    offsets, strides, _ = layout.cat_places(batch, dense.shape[1])
    return offsets, strides


def _allocate(layout: TableLayout, inputs: BagInputs, dense: Optional[Tensor], dtype: torch.dtype) -> tuple[list, Outputs]:
    """Per-table kernel targets and what the caller gets back (the list, or the cat matrix)."""
    if dense is None:
        outs = [torch.empty(inputs.batch, dim, dtype=dtype) for dim in layout.dims]
        return outs, outs
    matrix = torch.empty(inputs.batch, dense.shape[1] + sum(layout.dims), dtype=dtype)
    matrix[:, :dense.shape[1]] = dense
    return [matrix] * len(layout), matrix


def _native_pool(ops: object, weight: Tensor, layout: TableLayout, inputs: BagInputs,
                 dense: Optional[Tensor]) -> Outputs:
    targets, result = _allocate(layout, inputs, dense, weight.dtype)
    offsets, strides = _places(layout, inputs.batch, dense)
    ops.bag_forward(weight, inputs.indices, inputs.offsets, inputs.per_sample_weights,
                    layout.meta(offsets, strides), inputs.batch, targets)
    return result


def torch_pool(weight: Tensor, layout: TableLayout, inputs: BagInputs, dense: Optional[Tensor] = None) -> Outputs:
    """The pure-torch forward: one ``F.embedding_bag`` per run of tables with one dim and mode
    (differentiable in ``weight`` and the per-sample weights, as ``nn.EmbeddingBag``)."""
    outputs: list[Tensor] = []
    batch = inputs.batch
    for first, stop in layout.runs():
        dim, mode = layout.dims[first], layout.modes[first]
        start = layout.weight_offsets[first]
        rows = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
        block = weight[start:start + rows * dim].view(rows, dim)
        indices, offsets, weights, at = [], [], [], 0
        any_weights = any(inputs.per_sample_weights[t] is not None for t in range(first, stop))
        for t in range(first, stop):
            used = inputs.lookups(t)
            indices.append(inputs.indices[t][:used].long() + (layout.row_bases[t] - layout.row_bases[first]))
            offsets.append(inputs.offsets[t][:batch].long() + at)
            if any_weights:
                psw = inputs.per_sample_weights[t]
                weights.append(psw[:used] if psw is not None else torch.ones(used, dtype=weight.dtype))
            at += used
        offsets.append(torch.tensor([at], dtype=torch.long))
        pooled = F.embedding_bag(torch.cat(indices), block, torch.cat(offsets), mode=mode,
                                 per_sample_weights=torch.cat(weights) if any_weights else None,
                                 include_last_offset=True)
        outputs.extend(pooled.view(stop - first, batch, dim).unbind(0))
    if dense is None:
        return outputs
    return torch.cat([dense.to(weight.dtype), *outputs], dim=1)


def _grads_for_kernel(grads: tuple, layout: TableLayout, inputs: BagInputs, dtype: torch.dtype,
                      dense: Optional[Tensor]) -> list[Tensor]:
    """Upstream gradients as the kernel reads them: contiguous, in the weights' dtype, zeros for
    outputs that got none."""
    if dense is not None:
        matrix = grads[0].to(dtype).contiguous()
        return [matrix] * len(layout)
    return [torch.zeros(inputs.batch, dim, dtype=dtype) if g is None else g.to(dtype).contiguous()
            for g, dim in zip(grads, layout.dims)]


class _NativePool(torch.autograd.Function):
    """The kernel's forward; backward: a dense weight gradient (or, with ``update``, the fused
    update of the touched rows and no gradient)."""

    @staticmethod
    def forward(ctx, weight: Tensor, dense: Optional[Tensor], layout: TableLayout, inputs: BagInputs,
                update: Optional[UpdateHook]) -> Union[Tensor, tuple]:
        ctx.layout, ctx.inputs, ctx.update, ctx.has_dense = layout, inputs, update, dense is not None
        # Nothing is saved: the fused update changes the weight in place before a later backward.
        ctx.weight_dtype, ctx.weight_numel = weight.dtype, weight.numel()
        ctx.dense_dim = 0 if dense is None else dense.shape[1]
        result = _native_pool(native.ops(), weight.detach(), layout, inputs, dense)
        return result if dense is not None else tuple(result)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        layout, inputs = ctx.layout, ctx.inputs
        dense = torch.empty(0, ctx.dense_dim) if ctx.has_dense else None
        table_grads = _grads_for_kernel(grads, layout, inputs, ctx.weight_dtype, dense)
        dense_grad = grads[0][:, :ctx.dense_dim] if ctx.has_dense and ctx.needs_input_grad[1] else None
        if ctx.update is not None:
            ctx.update(table_grads, inputs)
            return None, dense_grad, None, None, None
        weight_grad = None
        if ctx.needs_input_grad[0]:
            weight_grad = torch.zeros(ctx.weight_numel, dtype=ctx.weight_dtype)
            empty = torch.empty(0, dtype=torch.int16)
            offsets, strides = _places(layout, inputs.batch, dense)
            native.ops().bag_backward(table_grads, inputs.indices, inputs.offsets, inputs.per_sample_weights,
                                      layout.meta(offsets, strides), inputs.batch, WRITE_GRAD, weight_grad, empty,
                                      weight_grad, 0.0, 0.0, 0.0)
        return weight_grad, dense_grad, None, None, None


class _TorchFusedPool(torch.autograd.Function):
    """The pure-torch forward of the fused classes; backward: the update, no gradient."""

    @staticmethod
    def forward(ctx, weight: Tensor, dense: Optional[Tensor], layout: TableLayout, inputs: BagInputs,
                update: UpdateHook) -> Union[Tensor, tuple]:
        ctx.layout, ctx.inputs, ctx.update, ctx.has_dense = layout, inputs, update, dense is not None
        ctx.weight_dtype, ctx.dense_dim = weight.dtype, 0 if dense is None else dense.shape[1]
        with torch.no_grad():
            result = torch_pool(weight, layout, inputs, dense)
        return result if dense is not None else tuple(result)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        dense = torch.empty(0, ctx.dense_dim) if ctx.has_dense else None
        table_grads = _grads_for_kernel(grads, ctx.layout, ctx.inputs, ctx.weight_dtype, dense)
        ctx.update(table_grads, ctx.inputs)
        dense_grad = grads[0][:, :ctx.dense_dim] if ctx.has_dense and ctx.needs_input_grad[1] else None
        return None, dense_grad, None, None, None


def pool(weight: Tensor, layout: TableLayout, inputs: BagInputs, dense: Optional[Tensor] = None,
         update: Optional[UpdateHook] = None) -> Outputs:
    """Pool every table's bags. ``update`` (the fused classes): called in backward instead of
    producing a weight gradient. Returns the per-table list, or the cat matrix with ``dense``."""
    training = torch.is_grad_enabled() and (weight.requires_grad or (dense is not None and dense.requires_grad))
    ops = native.ops()
    if not training:
        with torch.no_grad():
            if ops is not None:
                return _native_pool(ops, weight, layout, inputs, dense)
            return torch_pool(weight, layout, inputs, dense)
    if update is not None:
        if ops is not None:
            result = _NativePool.apply(weight, dense, layout, inputs, update)
        else:
            result = _TorchFusedPool.apply(weight, dense, layout, inputs, update)
    elif ops is not None and "max" not in layout.modes and not any(
            p is not None and p.requires_grad for p in inputs.per_sample_weights):
        result = _NativePool.apply(weight, dense, layout, inputs, None)
    else:   # max pooling and per-sample-weight gradients train through torch's own backward
        return torch_pool(weight, layout, inputs, dense)
    return result if dense is not None else list(result)


def update_rows(kind: int, layout: TableLayout, inputs: BagInputs, grads: list[Tensor], weight: Tensor,
                trail: Optional[Tensor], state: Optional[Tensor], lr: float, weight_decay: float = 0.0,
                eps: float = 0.0) -> None:
    """Apply one SGD or Adagrad step to the rows the inputs touched, from the per-table upstream
    gradients ``grads`` (the kernel's, or torch ops when it is not built)."""
    ops = native.ops()
    places = _places(layout, inputs.batch, None)
    with torch.no_grad():
        if ops is not None:
            empty = torch.empty(0, dtype=torch.int16)
            ops.bag_backward(grads, inputs.indices, inputs.offsets, inputs.per_sample_weights,
                             layout.meta(*places), inputs.batch, kind, weight,
                             empty if trail is None else trail, empty if state is None else state,
                             float(lr), float(weight_decay), float(eps))
            return
        for first, stop in layout.runs():
            rows, values = _row_gradients(layout, inputs, grads, places, first, stop)
            _apply(kind, layout, first, stop, rows, values, weight, trail, state, lr, weight_decay, eps)


def _row_gradients(layout: TableLayout, inputs: BagInputs, grads: list[Tensor], places: tuple[list, list],
                   first: int, stop: int) -> tuple[Tensor, Tensor]:
    """The summed fp32 gradient of every touched row of tables ``[first, stop)`` (rows counted
    from the run's first row), with torch ops."""
    dim, batch = layout.dims[first], inputs.batch
    all_rows, all_values = [], []
    for t in range(first, stop):
        used = inputs.lookups(t)
        offsets = inputs.offsets[t][:batch].long()
        ends = torch.cat([offsets[1:], torch.tensor([used])])
        lengths = ends - offsets
        bags = torch.repeat_interleave(torch.arange(batch), lengths)
        offset, stride = places[0][t], places[1][t]
        upstream = grads[t].reshape(-1)[offset:].as_strided((batch, dim), (stride, 1)).float()
        scale = torch.ones(used)
        if layout.modes[t] == "mean":
            scale = 1.0 / lengths.clamp(min=1).float()[bags]
        psw = inputs.per_sample_weights[t]
        if psw is not None:
            scale = scale * psw[:used].float()
        all_values.append(upstream[bags] * scale[:, None])
        all_rows.append(inputs.indices[t][:used].long() + (layout.row_bases[t] - layout.row_bases[first]))
    rows, inverse = torch.unique(torch.cat(all_rows), return_inverse=True)
    return rows, torch.zeros(len(rows), dim).index_add_(0, inverse, torch.cat(all_values))


def _apply(kind: int, layout: TableLayout, first: int, stop: int, rows: Tensor, grad: Tensor, weight: Tensor,
           trail: Optional[Tensor], state: Optional[Tensor], lr: float, weight_decay: float, eps: float) -> None:
    dim = layout.dims[first]
    start = layout.weight_offsets[first]
    count = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]

    def block(flat: Tensor) -> Tensor:
        return flat[start:start + count * dim].view(count, dim)

    w = block(weight)
    if trail is not None:
        master = torch.empty(len(rows), dim)
        join_into(w[rows], block(trail)[rows], master)
    else:
        master = w[rows].float()
    if kind == SGD:
        step = grad + weight_decay * master if weight_decay else grad
        master = master - lr * step
    else:
        sums = block(state)
        total = sums[rows] + grad * grad
        sums[rows] = total
        master = master - lr * (grad / (total.sqrt() + eps))
    if trail is not None:
        top = torch.empty(len(rows), dim, dtype=torch.bfloat16)
        low = torch.empty(len(rows), dim, dtype=trail.dtype)
        split_into(master, top, low)
        w[rows] = top
        block(trail)[rows] = low
    else:
        w[rows] = master.to(w.dtype)
