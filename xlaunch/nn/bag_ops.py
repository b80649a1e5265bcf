"""Pooling and row updates of merged embedding bags: the compiled kernels, or pure torch.

Both run behind operators registered with ``torch.library`` (``xlaunch::merged_bag``,
``xlaunch::merged_bag_fused``; ``xlaunch::merged_bag_grad``, ``xlaunch::merged_bag_update`` for
the backward), each with a fake kernel and ``register_autograd``,
so ``torch.jit.trace`` records them and ``torch.compile(fullgraph=True)`` keeps them in its graph.
Inside, the compiled kernels run when they are built and take the weights' dtype (fp32, bf16);
otherwise (fp64, fp16, ``XLAUNCH_NN_NATIVE=0``, no build) the pure-torch path runs in the
weights' own dtype: ``F.embedding_bag`` pools each run of tables sharing a dim and mode, and the
fused update sums each touched row's gradient with torch ops. Every index is checked against its
own table before anything is read or written.

``merged_bag``'s backward is a dense weight gradient (the kernel's, or torch's own embedding-bag
backward on a recomputed forward: max pooling and per-sample-weight gradients included);
``merged_bag_fused``'s backward updates the touched rows in place (SGD, Adagrad) and returns no
weight gradient.
"""
from __future__ import annotations

import functools
from typing import Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.nn.functional as F
    from torch import Tensor

from xlaunch.kernels.optim.splitbf16 import join_into, split_into
from xlaunch.nn import native
from xlaunch.nn.tables import MODES, BagInputs, EmbeddingSpec, TableLayout

WRITE_GRAD, SGD, ADAGRAD = 0, 1, 2   # update kinds (xlaunch/nn/csrc/bag_common.h, enum Kind)
NATIVE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_MODE_NAMES = {code: name for name, code in MODES.items()}
_NONE = torch.empty(0)
# The pure-torch forward pools a run of tables in one F.embedding_bag (fewer calls for small
# tables) unless they average this many lookups: then one call per table (no cat of the indices).
PER_TABLE_LOOKUPS = 4096   # the ops' spelling of "no tensor" in a list (jit.trace cannot record Tensor?[])


@functools.lru_cache(maxsize=64)
def layout_of(rows: tuple, dims: tuple, modes: tuple) -> TableLayout:
    """The layout of tables ``(rows, dims, mode codes)`` (the ops carry it as three int lists)."""
    return TableLayout([EmbeddingSpec(r, d, _MODE_NAMES[m]) for r, d, m in zip(rows, dims, modes)])


def _ops_for(weight: Tensor) -> Optional[object]:
    """The compiled kernels when they are wanted, built, and take ``weight``'s dtype."""
    return native.ops() if weight.dtype in NATIVE_WEIGHT_DTYPES else None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and updates run in: fp64 for fp64 weights, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_bounds(layout: TableLayout, inputs: BagInputs) -> None:
    """Raise ``IndexError`` naming the table, the position and the table's range when an index
    that falls in a bag is negative or past the table's rows (before anything is read)."""
    for t, idx in enumerate(inputs.indices):
        used = inputs.lookups(t)
        if used == 0:
            continue
        idx = idx[:used]
        rows = layout.rows[t]
        low, high = torch.aminmax(idx)
        if int(low) < 0 or int(high) >= rows:
            position = int(torch.nonzero((idx < 0) | (idx >= rows))[0, 0])
            raise IndexError(f"index {int(idx[position])} at position {position} of table {t} is out of range "
                             f"[0, {rows})")


def _inputs(indices: list, offsets: list, psw: list, batch: int) -> BagInputs:
    return BagInputs(list(indices), list(offsets), [None if p.numel() == 0 else p for p in psw], batch)


def _places(layout: TableLayout, batch: int, dense_dim: Optional[int]) -> tuple[list[int], list[int]]:
    if dense_dim is None:
        return [0] * len(layout), list(layout.dims)
    offsets, strides, _ = layout.cat_places(batch, dense_dim)
    return offsets, strides


def _native_pool(ops: object, weight: Tensor, layout: TableLayout, inputs: BagInputs,
                 dense: Optional[Tensor]) -> list[Tensor]:
    if dense is None:
        targets = outs = [torch.empty(inputs.batch, dim, dtype=weight.dtype) for dim in layout.dims]
    else:
        matrix = torch.empty(inputs.batch, dense.shape[1] + sum(layout.dims), dtype=weight.dtype)
        matrix[:, :dense.shape[1]] = dense
        targets, outs = [matrix] * len(layout), [matrix]
    offsets, strides = _places(layout, inputs.batch, None if dense is None else dense.shape[1])
    ops.bag_forward(weight.contiguous(), inputs.indices, inputs.offsets, inputs.per_sample_weights,
                    layout.meta(offsets, strides), inputs.batch, targets)
    return outs


def _run_inputs(layout: TableLayout, inputs: BagInputs, first: int, stop: int,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Tables ``[first, stop)`` as one bag input of their run's block: (indices, offsets with the
    last, per-sample weights or None)."""
    batch = inputs.batch
    indices, offsets, weights, at = [], [], [], 0
    any_weights = any(inputs.per_sample_weights[t] is not None for t in range(first, stop))
    for t in range(first, stop):
        used = inputs.lookups(t)
        indices.append(inputs.indices[t][:used].long() + (layout.row_bases[t] - layout.row_bases[first]))
        offsets.append(inputs.offsets[t][:batch].long() + at)
        if any_weights:
            psw = inputs.per_sample_weights[t]
            weights.append(psw[:used] if psw is not None else torch.ones(used, dtype=dtype))
        at += used
    offsets.append(torch.tensor([at], dtype=torch.long))
    return torch.cat(indices), torch.cat(offsets), torch.cat(weights) if any_weights else None


def torch_pool(weight: Tensor, layout: TableLayout, inputs: BagInputs, dense: Optional[Tensor] = None) -> list[Tensor]:
    """The pure-torch forward: one ``F.embedding_bag`` per run of tables with one dim and mode
    (differentiable in ``weight`` and the per-sample weights, as ``nn.EmbeddingBag``); the list of
    per-table outputs, or ``[cat matrix]`` with ``dense``."""
    outputs: list[Tensor] = []
    batch = inputs.batch
    for first, stop in layout.runs():
        dim = layout.dims[first]
        if sum(inputs.lookups(t) for t in range(first, stop)) >= PER_TABLE_LOOKUPS * (stop - first):
            for t in range(first, stop):   # big bags: one call per table, as the loop it replaces
                used = inputs.lookups(t)
                psw = inputs.per_sample_weights[t]
                outputs.append(F.embedding_bag(inputs.indices[t][:used], layout.view(weight, t),
                                               inputs.offsets[t][:batch], mode=layout.modes[t],
                                               per_sample_weights=None if psw is None else psw[:used]))
            continue
        start = layout.weight_offsets[first]
        rows = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
        block = weight[start:start + rows * dim].view(rows, dim)
        indices, offsets, weights = _run_inputs(layout, inputs, first, stop, weight.dtype)
        pooled = F.embedding_bag(indices, block, offsets, mode=layout.modes[first], per_sample_weights=weights,
                                 include_last_offset=True)
        outputs.extend(pooled.view(stop - first, batch, dim).unbind(0))
    if dense is None:
        return outputs
    return [torch.cat([dense.to(weight.dtype), *outputs], dim=1)]


def _forward(weight: Tensor, dense: Optional[Tensor], indices: list, offsets: list, psw: list, rows: list,
             dims: list, modes: list, batch: int) -> list[Tensor]:
    return _forward_with(weight, dense, layout_of(tuple(rows), tuple(dims), tuple(modes)),
                         _inputs(indices, offsets, psw, batch))


def _forward_with(weight: Tensor, dense: Optional[Tensor], layout: TableLayout, inputs: BagInputs) -> list[Tensor]:
    check_bounds(layout, inputs)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        ops = _ops_for(weight)
        if ops is not None:
            return _native_pool(ops, weight.detach(), layout, inputs, dense)
        return [out.clone() if out._base is not None else out
                for out in torch_pool(weight.detach(), layout, inputs, dense)]


def _fake_outputs(weight: Tensor, dense: Optional[Tensor], dims: list, batch: int) -> list[Tensor]:
    if dense is None:
        return [weight.new_empty(batch, dim) for dim in dims]
    return [weight.new_empty(batch, dense.shape[1] + sum(dims))]


def _merged_bag_impl(weight: Tensor, dense: Optional[Tensor], indices: list[Tensor], offsets: list[Tensor],
               per_sample_weights: list[Tensor], rows: list[int], dims: list[int], modes: list[int],
               batch: int) -> list[Tensor]:
    """Every table's ``(batch, dim)`` pooled output (with ``dense``: one cat matrix). An empty
    ``per_sample_weights`` entry means none."""
    return _forward(weight, dense, indices, offsets, per_sample_weights, rows, dims, modes, batch)


def _merged_bag_fake(weight, dense, indices, offsets, per_sample_weights, rows, dims, modes, batch):
    return _fake_outputs(weight, dense, dims, batch)


def _table_grads(grads: list, layout: TableLayout, batch: int, dtype: torch.dtype, cat: bool) -> list[Tensor]:
    """Upstream gradients as the kernels read them: contiguous, in the weights' dtype, zeros for
    outputs that got none."""
    if cat:
        return [grads[0].to(dtype).contiguous()] * len(layout)
    return [torch.zeros(batch, dim, dtype=dtype) if g is None else g.to(dtype).contiguous()
            for g, dim in zip(grads, layout.dims)]


def _merged_bag_grad_impl(weight: Tensor, dense_dim: int, grads: list[Tensor], indices: list[Tensor], offsets: list[Tensor],
                    per_sample_weights: list[Tensor], rows: list[int], dims: list[int], modes: list[int], batch: int,
                    psw_grads: bool) -> list[Tensor]:
    """``[weight gradient, per-sample-weight gradients...]`` (the latter when ``psw_grads``)."""
    layout = layout_of(tuple(rows), tuple(dims), tuple(modes))
    inputs = _inputs(indices, offsets, per_sample_weights, batch)
    cat = dense_dim >= 0
    ops = _ops_for(weight)
    with torch.autocast("cpu", enabled=False):
        if ops is not None and not psw_grads and MODES["max"] not in modes:
            table_grads = _table_grads(grads, layout, batch, weight.dtype, cat)
            weight_grad = torch.zeros(weight.numel(), dtype=weight.dtype)
            places = _places(layout, batch, dense_dim if cat else None)
            ops.bag_backward(table_grads, inputs.indices, inputs.offsets, inputs.per_sample_weights,
                             layout.meta(*places), batch, WRITE_GRAD, weight_grad, _NONE.to(torch.int16), weight_grad, 0.0, 0.0, 0.0)
            return [weight_grad]
        return _torch_grad(weight, _table_grads(grads, layout, batch, weight.dtype, cat), layout, inputs,
                           _places(layout, batch, dense_dim if cat else None), psw_grads)


def _upstream(grads: list, places: tuple, t: int, batch: int, dim: int) -> Tensor:
    """Table ``t``'s ``(batch, dim)`` upstream gradient (a strided view into its tensor)."""
    return grads[t].reshape(-1)[places[0][t]:].as_strided((batch, dim), (places[1][t], 1))


def _max_winners(weight: Tensor, layout: TableLayout, inputs: BagInputs, grads: list, places: tuple, first: int,
                 stop: int, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    """For a run of max-pooled tables: the row (counted from the run's first) that won each
    element of each non-empty bag, and that element's upstream gradient, both ``(bags, dim)``."""
    dim = layout.dims[first]
    start = layout.weight_offsets[first]
    count = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
    indices, offsets, _ = _run_inputs(layout, inputs, first, stop, weight.dtype)
    block = weight.detach()[start:start + count * dim].view(count, dim)
    _, _, sizes, winners = torch.embedding_bag(block, indices, offsets, False, 2, False, None, True)
    upstream = torch.cat([_upstream(grads, places, t, inputs.batch, dim) for t in range(first, stop)]).to(compute)
    filled = sizes > 0
    return winners[filled], upstream[filled]


def _torch_grad(weight: Tensor, grads: list, layout: TableLayout, inputs: BagInputs, places: tuple,
                psw_grads: bool) -> list[Tensor]:
    """The dense weight gradient (and per-sample-weight gradients) with torch ops, summed in the
    compute dtype: every lookup's scaled upstream row added into its row; for max pooling, each
    element's upstream value added into the row that won it."""
    compute, batch = compute_dtype(weight.dtype), inputs.batch
    grad = torch.zeros(weight.numel(), dtype=compute)
    for first, stop in layout.runs():
        dim = layout.dims[first]
        start = layout.weight_offsets[first]
        count = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
        block = grad[start:start + count * dim].view(count, dim)
        if layout.modes[first] == "max":
            winners, upstream = _max_winners(weight, layout, inputs, grads, places, first, stop, compute)
            block.view(-1).index_add_(0, (winners * dim + torch.arange(dim)).reshape(-1), upstream.reshape(-1))
        else:
            lookups, values = _row_gradients(layout, inputs, grads, places, first, stop, compute)
            block.index_add_(0, lookups, values)
    found = [grad.to(weight.dtype)]
    if psw_grads:
        for t, psw in enumerate(inputs.per_sample_weights):
            if psw is None:
                found.append(_NONE)
                continue
            used, dim = inputs.lookups(t), layout.dims[t]
            offsets = inputs.offsets[t][:batch].long()
            bags = torch.repeat_interleave(torch.arange(batch), torch.diff(offsets, append=torch.tensor([used])),
                                           output_size=used)
            rows = layout.view(weight.detach(), t).index_select(0, inputs.indices[t][:used].long()).to(compute)
            dots = (_upstream(grads, places, t, batch, dim).to(compute).index_select(0, bags) * rows).sum(1)
            found.append(torch.cat([dots, torch.zeros(psw.numel() - used, dtype=compute)]).to(psw.dtype))
    return found


def _merged_bag_grad_fake(weight, dense_dim, grads, indices, offsets, per_sample_weights, rows, dims, modes, batch,
                          psw_grads):
    extra = [p.new_empty(p.shape) for p in per_sample_weights] if psw_grads else []
    return [weight.new_empty(weight.shape)] + extra


def _setup(ctx, inputs, output) -> None:
    weight, dense, indices, offsets, psw, rows, dims, modes, batch = inputs
    ctx.save_for_backward(weight, *indices, *offsets, *psw)
    ctx.shape = (list(rows), list(dims), list(modes), batch, len(indices))
    ctx.dense_dim = -1 if dense is None else dense.shape[1]
    ctx.dense_dtype = None if dense is None else dense.dtype
    ctx.psw_grads = any(p.requires_grad for p in psw)


def _backward(ctx, grads):
    rows, dims, modes, batch, count = ctx.shape
    weight, *rest = ctx.saved_tensors
    indices, offsets, psw = rest[:count], rest[count:2 * count], rest[2 * count:]
    dense_grad = None
    if ctx.dense_dim >= 0 and ctx.needs_input_grad[1]:
        dense_grad = grads[0][:, :ctx.dense_dim].to(ctx.dense_dtype)
    weight_grad, psw_grad = None, [None] * count
    if ctx.needs_input_grad[0] or ctx.psw_grads:
        found = merged_bag_grad(weight, ctx.dense_dim, list(grads), list(indices), list(offsets), list(psw),
                                rows, dims, modes, batch, ctx.psw_grads)
        weight_grad = found[0] if ctx.needs_input_grad[0] else None
        if ctx.psw_grads:
            psw_grad = [g if p.requires_grad else None for g, p in zip(found[1:], psw)]
    return weight_grad, dense_grad, [None] * count, [None] * count, psw_grad, None, None, None, None





def _merged_bag_fused_impl(weight: Tensor, trail: Tensor, state: Tensor, dense: Optional[Tensor], indices: list[Tensor],
                     offsets: list[Tensor], per_sample_weights: list[Tensor], rows: list[int], dims: list[int],
                     modes: list[int], batch: int, kind: int, lr: float, weight_decay: float,
                     eps: float) -> list[Tensor]:
    """:func:`merged_bag`'s outputs; its backward updates the looked-up rows of ``weight`` (with
    ``trail``, the split-bf16 low halves, and ``state``, Adagrad's sums; empty when unused)."""
    return _forward(weight, dense, indices, offsets, per_sample_weights, rows, dims, modes, batch)


def _merged_bag_fused_fake(weight, trail, state, dense, indices, offsets, per_sample_weights, rows, dims, modes, batch,
                           kind, lr, weight_decay, eps):
    return _fake_outputs(weight, dense, dims, batch)


def _merged_bag_update_impl(weight: Tensor, trail: Tensor, state: Tensor, dense_dim: int, grads: list[Tensor],
                      indices: list[Tensor], offsets: list[Tensor], per_sample_weights: list[Tensor], rows: list[int],
                      dims: list[int], modes: list[int], batch: int, kind: int, lr: float, weight_decay: float,
                      eps: float) -> None:
    """One SGD or Adagrad step on the rows the inputs looked up, from the upstream gradients."""
    layout = layout_of(tuple(rows), tuple(dims), tuple(modes))
    inputs = _inputs(indices, offsets, per_sample_weights, batch)
    cat = dense_dim >= 0
    table_grads = _table_grads(grads, layout, batch, weight.dtype, cat)
    update_rows(kind, layout, inputs, table_grads, weight, trail if trail.numel() else None,
                state if state.numel() else None, lr, weight_decay, eps, dense_dim if cat else None)


def _merged_bag_update_fake(*args) -> None:
    return None


def _setup_fused(ctx, inputs, output) -> None:
    weight, trail, state, dense, indices, offsets, psw, rows, dims, modes, batch, kind, lr, wd, eps = inputs
    # The weight is held, not saved: the update changes it in place before a later backward.
    ctx.targets = (weight, trail, state)
    ctx.save_for_backward(*indices, *offsets, *psw)
    ctx.shape = (list(rows), list(dims), list(modes), batch, len(indices))
    ctx.hyper = (kind, lr, wd, eps)
    ctx.dense_dim = -1 if dense is None else dense.shape[1]
    ctx.dense_dtype = None if dense is None else dense.dtype


def _backward_fused(ctx, grads):
    rows, dims, modes, batch, count = ctx.shape
    saved = ctx.saved_tensors
    indices, offsets, psw = saved[:count], saved[count:2 * count], saved[2 * count:]
    weight, trail, state = ctx.targets
    merged_bag_update(weight, trail, state, ctx.dense_dim, list(grads), list(indices), list(offsets), list(psw),
                      rows, dims, modes, batch, *ctx.hyper)
    dense_grad = None
    if ctx.dense_dim >= 0 and ctx.needs_input_grad[3]:
        dense_grad = grads[0][:, :ctx.dense_dim].to(ctx.dense_dtype)
    return (None, None, None, dense_grad, [None] * count, [None] * count, [None] * count, None, None, None, None,
            None, None, None, None)





# The operators, defined with torch.library.Library (not torch.library.custom_op, whose kernel
# wrapper imports torch._dynamo on the first call: seconds in every process that pools once).
_SCHEMAS = {
    "merged_bag": "merged_bag(Tensor weight, Tensor? dense, Tensor[] indices, Tensor[] offsets, "
                  "Tensor[] per_sample_weights, int[] rows, int[] dims, int[] modes, int batch) -> Tensor[]",
    "merged_bag_grad": "merged_bag_grad(Tensor weight, int dense_dim, Tensor[] grads, Tensor[] indices, "
                       "Tensor[] offsets, Tensor[] per_sample_weights, int[] rows, int[] dims, int[] modes, int batch, "
                       "bool psw_grads) -> Tensor[]",
    "merged_bag_fused": "merged_bag_fused(Tensor weight, Tensor trail, Tensor state, Tensor? dense, Tensor[] indices, "
                        "Tensor[] offsets, Tensor[] per_sample_weights, int[] rows, int[] dims, int[] modes, int batch, "
                        "int kind, float lr, float weight_decay, float eps) -> Tensor[]",
    "merged_bag_update": "merged_bag_update(Tensor(a!) weight, Tensor(b!) trail, Tensor(c!) state, int dense_dim, "
                         "Tensor[] grads, Tensor[] indices, Tensor[] offsets, Tensor[] per_sample_weights, int[] rows, "
                         "int[] dims, int[] modes, int batch, int kind, float lr, float weight_decay, float eps) -> ()",
}
_LIBRARY = torch.library.Library("xlaunch", "DEF")
for _name, _schema in _SCHEMAS.items():
    _LIBRARY.define(_schema)
    _LIBRARY.impl(_name, globals()[f"_{_name}_impl"], "CPU")
    torch.library.register_fake(f"xlaunch::{_name}", globals()[f"_{_name}_fake"], lib=_LIBRARY)
torch.library.register_autograd("xlaunch::merged_bag", _backward, setup_context=_setup, lib=_LIBRARY)
torch.library.register_autograd("xlaunch::merged_bag_fused", _backward_fused, setup_context=_setup_fused,
                                lib=_LIBRARY)
merged_bag = torch.ops.xlaunch.merged_bag
merged_bag_grad = torch.ops.xlaunch.merged_bag_grad
merged_bag_fused = torch.ops.xlaunch.merged_bag_fused
merged_bag_update = torch.ops.xlaunch.merged_bag_update


def op_args(layout: TableLayout, inputs: BagInputs) -> tuple:
    """(indices, offsets, per_sample_weights, rows, dims, modes, batch) as the ops take them."""
    psw = [_NONE if p is None else p for p in inputs.per_sample_weights]
    return (inputs.indices, inputs.offsets, psw, layout.rows, layout.dims, [MODES[m] for m in layout.modes],
            inputs.batch)


def _recorded() -> bool:
    """Whether torch.jit.trace or torch.compile is recording (they need the registered ops)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def pool(weight: Tensor, layout: TableLayout, inputs: BagInputs, dense: Optional[Tensor] = None):
    """Pool every table's bags: the per-table list, or the cat matrix with ``dense``."""
    if not torch.is_grad_enabled() and not _recorded():     # eager inference: the kernel, no dispatch
        out = _forward_with(weight, dense, layout, inputs)
    else:
        out = merged_bag(weight, dense, *op_args(layout, inputs))
    return out if dense is None else out[0]


class _EagerFused(torch.autograd.Function):
    """Eager training of the fused classes: what ``xlaunch::merged_bag_fused`` and its registered
    backward do, without the dispatcher's per-call argument handling (a third of a small step)."""

    @staticmethod
    def forward(ctx, weight: Tensor, dense: Optional[Tensor], layout: TableLayout, inputs: BagInputs,
                targets: tuple, hyper: tuple) -> tuple:
        ctx.layout, ctx.inputs, ctx.targets, ctx.hyper = layout, inputs, targets, hyper
        ctx.dense_dim = -1 if dense is None else dense.shape[1]
        ctx.dense_dtype = None if dense is None else dense.dtype
        return tuple(_forward_with(weight, dense, layout, inputs))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        layout, inputs, cat = ctx.layout, ctx.inputs, ctx.dense_dim >= 0
        weight, trail, state = ctx.targets
        table_grads = _table_grads(list(grads), layout, inputs.batch, weight.dtype, cat)
        update_rows(ctx.hyper[0], layout, inputs, table_grads, weight.detach(), trail, state, *ctx.hyper[1:],
                    dense_dim=ctx.dense_dim if cat else None)
        dense_grad = None
        if cat and ctx.needs_input_grad[1]:
            dense_grad = grads[0][:, :ctx.dense_dim].to(ctx.dense_dtype)
        return None, dense_grad, None, None, None, None


def pool_fused(weight: Tensor, trail: Optional[Tensor], state: Optional[Tensor], layout: TableLayout,
               inputs: BagInputs, kind: int, lr: float, weight_decay: float = 0.0, eps: float = 0.0,
               dense: Optional[Tensor] = None):
    """:func:`pool` whose backward updates the looked-up rows (no weight gradient)."""
    hyper = (kind, float(lr), float(weight_decay), float(eps))
    if not _recorded():
        out = list(_EagerFused.apply(weight, dense, layout, inputs, (weight, trail, state), hyper))
    else:
        out = merged_bag_fused(weight, _NONE if trail is None else trail, _NONE if state is None else state, dense,
                               *op_args(layout, inputs), *hyper)
    return out if dense is None else out[0]


def update_rows(kind: int, layout: TableLayout, inputs: BagInputs, grads: list[Tensor], weight: Tensor,
                trail: Optional[Tensor], state: Optional[Tensor], lr: float, weight_decay: float = 0.0,
                eps: float = 0.0, dense_dim: Optional[int] = None) -> None:
    """Apply one SGD or Adagrad step to the rows the inputs touched, from the per-table upstream
    gradients ``grads`` (the kernel's, or torch ops when it is not built or lacks the dtype)."""
    places = _places(layout, inputs.batch, dense_dim)
    ops = _ops_for(weight)
    if ops is not None and ((state is not None and state.dtype != torch.float32) or "max" in layout.modes):
        ops = None   # the kernel updates sum and mean tables with fp32 sums
    with torch.no_grad():
        if ops is not None:
            ops.bag_backward(grads, inputs.indices, inputs.offsets, inputs.per_sample_weights,
                             layout.meta(*places), inputs.batch, kind, weight,
                             _NONE.to(torch.int16) if trail is None else trail, _NONE if state is None else state,
                             float(lr), float(weight_decay), float(eps))
            return
        compute = compute_dtype(weight.dtype)
        for first, stop in layout.runs():
            if layout.modes[first] == "max":
                rows, values = _max_row_gradients(weight, layout, inputs, grads, places, first, stop, compute)
            else:
                rows, values = _row_gradients(layout, inputs, grads, places, first, stop, compute)
            _apply(kind, layout, first, stop, rows, values, weight, trail, state, lr, weight_decay, eps)


def _max_row_gradients(weight: Tensor, layout: TableLayout, inputs: BagInputs, grads: list, places: tuple,
                       first: int, stop: int, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    """Max-pooled tables: every looked-up row once, with its gradient (each element's upstream
    value on the row that won it; zero where a looked-up row won nothing)."""
    dim = layout.dims[first]
    count = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
    looked_up = torch.cat([inputs.indices[t][:inputs.lookups(t)].long() + (layout.row_bases[t] - layout.row_bases[first])
                           for t in range(first, stop)])
    present = torch.zeros(count, dtype=torch.bool)
    present[looked_up] = True
    rows = present.nonzero().squeeze(1)
    position = torch.empty(count, dtype=torch.long)
    position[rows] = torch.arange(len(rows))
    winners, upstream = _max_winners(weight, layout, inputs, grads, places, first, stop, compute)
    values = torch.zeros(len(rows) * dim, dtype=compute)
    values.index_add_(0, (position[winners] * dim + torch.arange(dim)).reshape(-1), upstream.reshape(-1))
    return rows, values.view(len(rows), dim)


def _row_gradients(layout: TableLayout, inputs: BagInputs, grads: list[Tensor], places: tuple[list, list],
                   first: int, stop: int, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    """The touched rows of tables ``[first, stop)`` (each once, counted from the run's first row)
    and their summed gradients, in ``compute``.

    A transposed embedding bag: the lookups sorted by row are bags of upstream-gradient rows, so
    one ``F.embedding_bag`` (sum, per-sample weights for the lookups' scales) sums them, without
    materializing a gradient row per lookup."""
    dim, batch = layout.dims[first], inputs.batch
    all_rows, all_bags, all_scales, upstreams = [], [], [], []
    scaled = any(inputs.per_sample_weights[t] is not None for t in range(first, stop))
    for t in range(first, stop):
        used = inputs.lookups(t)
        offsets = inputs.offsets[t][:batch].long()
        lengths = torch.diff(offsets, append=torch.tensor([used]))
        upstream = _upstream(grads, places, t, batch, dim).to(compute)
        if layout.modes[t] == "mean":
            upstream = upstream / lengths.clamp(min=1).to(compute)[:, None]
        upstreams.append(upstream)
        if used == 0:
            continue
        all_bags.append(torch.repeat_interleave(torch.arange((t - first) * batch, (t - first + 1) * batch), lengths,
                                                output_size=used))
        all_rows.append(inputs.indices[t][:used].long() + (layout.row_bases[t] - layout.row_bases[first]))
        if scaled:
            psw = inputs.per_sample_weights[t]
            all_scales.append(torch.ones(used, dtype=compute) if psw is None else psw[:used].to(compute))
    if not all_rows:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dim, dtype=compute)
    lookups = torch.cat(all_rows)
    lookups, order = torch.sort(lookups)
    rows, counts = torch.unique_consecutive(lookups, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    summed = F.embedding_bag(torch.cat(all_bags).index_select(0, order), torch.cat(upstreams), starts, mode="sum",
                             per_sample_weights=torch.cat(all_scales).index_select(0, order) if scaled else None)
    return rows, summed


def _apply(kind: int, layout: TableLayout, first: int, stop: int, rows: Tensor, grad: Tensor, weight: Tensor,
           trail: Optional[Tensor], state: Optional[Tensor], lr: float, weight_decay: float, eps: float) -> None:
    """The update of the touched ``rows`` (each once) of tables ``[first, stop)`` from their
    summed gradients ``grad``."""
    if rows.numel() == 0:
        return
    dim = layout.dims[first]
    start = layout.weight_offsets[first]
    count = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]

    def block(flat: Tensor) -> Tensor:
        return flat[start:start + count * dim].view(count, dim)

    w = block(weight)
    compute = grad.dtype
    if kind == SGD and not weight_decay and trail is None and w.dtype == compute:
        w.index_add_(0, rows, grad, alpha=-lr)
        return
    if trail is not None:
        master = torch.empty(len(rows), dim)
        join_into(w.index_select(0, rows), block(trail).index_select(0, rows), master)
    else:
        master = w.index_select(0, rows).to(compute)
    if kind == SGD:
        step = grad + weight_decay * master if weight_decay else grad
        master = master - lr * step
    else:
        sums = block(state)
        total = sums.index_select(0, rows).to(compute) + grad * grad
        sums.index_copy_(0, rows, total.to(sums.dtype))
        master = master - lr * (grad / (total.sqrt() + eps))
    if trail is not None:
        top = torch.empty(len(rows), dim, dtype=torch.bfloat16)
        low = torch.empty(len(rows), dim, dtype=trail.dtype)
        split_into(master, top, low)
        w.index_copy_(0, rows, top)
        block(trail).index_copy_(0, rows, low)
    else:
        w.index_copy_(0, rows, master.to(w.dtype))
