"""Pooling and row updates of merged embedding bags: the compiled kernels, or pure torch.

Both run behind operators registered with ``torch.library`` (``xlaunch::merged_bag``,
``xlaunch::merged_bag_fused``; ``xlaunch::merged_bag_grad``, ``xlaunch::merged_bag_update`` for
the backward), each with a fake kernel and ``register_autograd``,
so ``torch.jit.trace`` records them and ``torch.compile(fullgraph=True)`` keeps them in its graph.
Inside, the compiled kernels run when they are built and take the weights' dtype (fp32, bf16);
otherwise (fp64, fp16, ``XLAUNCH_NN_NATIVE=0``, no build) the pure-torch path of
:mod:`xlaunch.nn.bag_torch` runs in the weights' own dtype. Every index is checked against its
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
    from torch import Tensor

from xlaunch.nn.bag_torch import (SMALL_STEP_LOOKUPS, WRITE_GRAD, _NONE, _ops_for, _places, _run_shape,
                                  _torch_grad, check_bounds, psw_gradients, torch_pool, update_rows)
from xlaunch.nn.tables import (MODES, BagInputs, EmbeddingSpec, TableLayout, call_plan, check_offsets, normalize,
                               offset_ranges, offsets_valid)

_MODE_NAMES = {code: name for name, code in MODES.items()}


@functools.lru_cache(maxsize=64)
def layout_of(rows: tuple, dims: tuple, modes: tuple) -> TableLayout:
    """The layout of tables ``(rows, dims, mode codes)`` (the ops carry it as three int lists)."""
    return TableLayout([EmbeddingSpec(r, d, _MODE_NAMES[m]) for r, d, m in zip(rows, dims, modes)])


def _inputs(indices: list, offsets: list, psw: list, batch: int) -> BagInputs:
    return BagInputs(list(indices), list(offsets), [None if p.numel() == 0 else p for p in psw], batch)


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


def _forward(weight: Tensor, dense: Optional[Tensor], indices: list, offsets: list, psw: list, rows: list,
             dims: list, modes: list, batch: int) -> list[Tensor]:
    layout = layout_of(tuple(rows), tuple(dims), tuple(modes))
    # The operators' own check too: a traced or compiled graph calls them without the classes' checks.
    check_offsets(offsets, [idx.numel() for idx in indices], batch, layout.cache)
    outs = _forward_with(weight, dense, layout, _inputs(indices, offsets, psw, batch))
    return [out.clone() if out._base is not None else out for out in outs]   # an op's outputs never alias


def _forward_with(weight: Tensor, dense: Optional[Tensor], layout: TableLayout, inputs: BagInputs,
                  aux: Optional[dict] = None) -> list[Tensor]:
    """The outputs (``aux``: the pure-torch path's bag maps, for its update; views of one buffer
    when it pooled a run of tables in one call)."""
    ops = _ops_for(weight)
    if ops is not None:
        check_bounds(layout, inputs)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return _native_pool(ops, weight.detach(), layout, inputs, dense)
    if torch.is_autocast_enabled("cpu"):
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return torch_pool(weight.detach(), layout, inputs, dense, aux)
    if not torch.is_grad_enabled():
        return torch_pool(weight, layout, inputs, dense, aux)
    with torch.no_grad():
        return torch_pool(weight.detach(), layout, inputs, dense, aux)   # checks the bounds as it reads


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
    return [torch.zeros(batch, dim, dtype=dtype) if g is None else
            g if g.dtype == dtype and g.is_contiguous() else g.to(dtype).contiguous()
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
    ctx.psw_wanted = [p.requires_grad for p in psw]


def _psw_grads(weight: Tensor, grads: list, layout: TableLayout, inputs: BagInputs, dense_dim: int,
               wanted: list) -> list:
    """The per-sample-weight gradients a fused backward owes (``wanted[t]``: table ``t``'s requires
    grad), from the weights the forward read: taken before the update changes them."""
    found = psw_gradients(weight.detach(), _table_grads(grads, layout, inputs.batch, weight.dtype, dense_dim >= 0),
                          layout, inputs, _places(layout, inputs.batch, dense_dim if dense_dim >= 0 else None))
    return [g if want else None for g, want in zip(found, wanted)]


def _backward_fused(ctx, grads):
    rows, dims, modes, batch, count = ctx.shape
    saved = ctx.saved_tensors
    indices, offsets, psw = saved[:count], saved[count:2 * count], saved[2 * count:]
    weight, trail, state = ctx.targets
    psw_grad = [None] * count
    if any(ctx.psw_wanted):
        psw_grad = _psw_grads(weight, list(grads), layout_of(tuple(rows), tuple(dims), tuple(modes)),
                              _inputs(indices, offsets, psw, batch), ctx.dense_dim, ctx.psw_wanted)
    if ctx.needs_input_grad[0]:     # a frozen weight (requires_grad=False) is not updated
        merged_bag_update(weight, trail, state, ctx.dense_dim, list(grads), list(indices), list(offsets), list(psw),
                          rows, dims, modes, batch, *ctx.hyper)
    dense_grad = None
    if ctx.dense_dim >= 0 and ctx.needs_input_grad[3]:
        dense_grad = grads[0][:, :ctx.dense_dim].to(ctx.dense_dtype)
    return (None, None, None, dense_grad, [None] * count, [None] * count, psw_grad, None, None, None, None,
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


def _block(weight: Tensor, layout: TableLayout, first: int, place: tuple[int, int]) -> Tensor:
    """The detached ``(rows, dim)`` block of the run starting at table ``first`` (cached while
    ``weight`` is the same tensor on the same storage)."""
    key = ("block", first)
    found = layout.cache.get(key)
    pointer = weight.data_ptr()
    if found is None or found[0] is not weight or found[1] != pointer:
        start, rows = place
        dim = layout.dims[first]
        found = layout.cache[key] = (weight, pointer, weight.detach().narrow(0, start, rows * dim).view(rows, dim))
    return found[2]


def _call_shape(layout: TableLayout, batch: int, used: tuple, dtype: torch.dtype) -> tuple:
    """How :func:`fast_pool` pools a call shape (cached): (the tables pooled one call each, and per
    run of tables ``(first, stop, checks)``, ``checks`` None for a run pooled table by table, else
    for the run's indices and offsets concatenated (with the end appended, as a table of one offset
    and no indices): (their shift into the run's rows and lookups, each value's valid range once
    shifted, the lookups' count, the run's block place, a zero for the end))."""
    key = ("call shape", batch, used, dtype)
    found = layout.cache.get(key)
    if found is None:
        alone, runs = [], []
        for first, stop in layout.runs():
            if stop - first == 1 or layout.modes[first] == "max" or sum(used[first:stop]) > SMALL_STEP_LOOKUPS:
                alone.extend(range(first, stop))
                runs.append((first, stop, None))
                continue
            bases, _, last, _, _, place = _run_shape(layout, first, stop, batch, used[first:stop], dtype)
            shift, low, high = offset_ranges((batch,) * (stop - first) + (1,), (*used[first:stop], 0), batch, dtype,
                                             layout.cache)
            runs.append((first, stop, (torch.cat([bases, shift]), torch.cat([bases, low]),
                                       torch.cat([last + bases, high]), sum(used[first:stop]), place,
                                       torch.zeros(1, dtype=dtype))))
        found = (alone, runs)
        if len(layout.cache) > 64:
            layout.cache.clear()
        layout.cache[key] = found
    return found


def fast_pool(weight: Tensor, layout: TableLayout, indices: object, offsets: object) -> Optional[list[Tensor]]:
    """Eager inference on the pure-torch path, without per-sample weights, from the raw inputs:
    what :func:`pool` gives, or None where it does not apply (the kernels, autocast, tracing, a form
    or dtype mix the cached :func:`~xlaunch.nn.tables.call_plan` leaves to the general path).

    A call whose signature was seen before skips the shape and dtype checks (they depend on nothing
    else) but checks every table's offsets (:func:`~xlaunch.nn.tables.offsets_valid`, one pass over
    all tables), then runs, per run of tables sharing a dim and mode: one ``cat`` of the indices, the
    bounds check (``clamp`` + ``equal`` against each lookup's table range, cached per call shape),
    one ``add`` of the tables' row bases, one ``cat`` + ``add_`` of the offsets, one
    ``embedding_bag``. A bad offset raises from :func:`~xlaunch.nn.tables.normalize`, an index
    outside its table from :func:`check_bounds`, before anything is read."""
    if _ops_for(weight) is not None or torch.is_autocast_enabled("cpu") or _recorded():
        return None
    plan = call_plan(layout, indices, offsets)
    if plan is None:
        return None
    batch, forms = plan.batch, plan.forms
    used = [idx.numel() for idx in indices]
    flat_idx = [idx.reshape(-1) if form == 2 else idx for idx, form in zip(indices, forms)]
    flat_off = [plan.arange[t] if form == 2 else offsets[t][:batch] if form == 1 else offsets[t]
                for t, form in enumerate(forms)]
    alone, runs = _call_shape(layout, batch, tuple(used), flat_idx[0].dtype)
    # Every table's offsets and every run's indices are checked before anything is read: the
    # tables pooled one call each in one pass, a run's offsets as they are placed for its
    # embedding_bag (ranges, then cummax: never decreasing), an include_last_offset table's last
    # offset against its indices.
    valid = not alone or offsets_valid([offsets[t] if forms[t] == 1 else flat_off[t] for t in alone],
                                       [used[t] for t in alone], batch, layout.cache)
    if valid and 1 in forms:
        valid = all(int(offsets[t][batch]) == used[t] for t, form in enumerate(forms) if form == 1 and t not in alone)
    placed_runs = []
    for first, stop, checks in runs:
        if checks is None:
            continue
        shift, low, high, lookups, place, zero = checks
        placed = torch.cat([*flat_idx[first:stop], *flat_off[first:stop], zero]) + shift
        run_off = placed[lookups:]
        valid = (valid and torch.equal(torch.clamp(placed, low, high), placed)
                 and torch.equal(torch.cummax(run_off, 0).values, run_off))
        placed_runs.append((placed[:lookups], run_off))
    if not valid:       # raises, naming the table and position
        check_bounds(layout, normalize(layout, indices, offsets, None, weight.dtype))
    outputs: list[Tensor] = []
    placed_runs.reverse()
    try:
        for first, stop, checks in runs:
            mode = MODES[layout.modes[first]]
            if checks is None:
                for t in range(first, stop):
                    outputs.append(torch.embedding_bag(layout.view(weight.detach(), t), flat_idx[t], flat_off[t], False,
                                                       mode, False, None, False)[0])
                continue
            run_idx, run_off = placed_runs.pop()
            # Sum pooling (then a division for mean: torch's mean costs ~4x its sum here) on a
            # detached block (a weight that requires grad makes torch build the backward's maps).
            out = torch.embedding_bag(_block(weight, layout, first, checks[4]), run_idx, run_off, False, 0, False, None,
                                      True)[0]
            if mode == MODES["mean"]:
                out.div_(torch.sub(run_off[1:], run_off[:-1]).clamp_(min=1).unsqueeze_(1))
            outputs.extend(out.view(stop - first, batch, layout.dims[first]).unbind(0))
    except RuntimeError:      # torch refused an index of a table pooled on its own: name it
        check_bounds(layout, normalize(layout, indices, offsets, None, weight.dtype))
        raise
    return outputs


class _EagerFused(torch.autograd.Function):
    """Eager training of the fused classes: what ``xlaunch::merged_bag_fused`` and its registered
    backward do, without the dispatcher's per-call argument handling (a third of a small step)."""

    @staticmethod
    def forward(ctx, weight: Tensor, dense: Optional[Tensor], layout: TableLayout, inputs: BagInputs,
                targets: tuple, hyper: tuple, *psw: Optional[Tensor]) -> tuple:    # psw: inputs' own, for their grads
        ctx.layout, ctx.inputs, ctx.targets, ctx.hyper = layout, inputs, targets, hyper
        ctx.dense_dim = -1 if dense is None else dense.shape[1]
        ctx.dense_dtype = None if dense is None else dense.dtype
        ctx.aux = {}
        return tuple(out.clone() if out._base is not None else out
                     for out in _forward_with(weight, dense, layout, inputs, ctx.aux))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        layout, inputs, cat = ctx.layout, ctx.inputs, ctx.dense_dim >= 0
        weight, trail, state = ctx.targets
        wanted = list(ctx.needs_input_grad[6:])
        psw_grad = _psw_grads(weight, list(grads), layout, inputs, ctx.dense_dim, wanted) if any(wanted) else []
        if ctx.needs_input_grad[0]:     # a frozen weight (requires_grad=False) is not updated
            table_grads = _table_grads(list(grads), layout, inputs.batch, weight.dtype, cat)
            update_rows(ctx.hyper[0], layout, inputs, table_grads, weight.detach(), trail, state, *ctx.hyper[1:],
                        dense_dim=ctx.dense_dim if cat else None, aux=ctx.aux or None)
        dense_grad = None
        if cat and ctx.needs_input_grad[1]:
            dense_grad = grads[0][:, :ctx.dense_dim].to(ctx.dense_dtype)
        return (None, dense_grad, None, None, None, None, *(psw_grad or [None] * len(wanted)))


def pool_fused(weight: Tensor, trail: Optional[Tensor], state: Optional[Tensor], layout: TableLayout,
               inputs: BagInputs, kind: int, lr: float, weight_decay: float = 0.0, eps: float = 0.0,
               dense: Optional[Tensor] = None):
    """:func:`pool` whose backward updates the looked-up rows (no weight gradient)."""
    hyper = (kind, float(lr), float(weight_decay), float(eps))
    if not _recorded():
        out = list(_EagerFused.apply(weight, dense, layout, inputs, (weight, trail, state), hyper,
                                     *inputs.per_sample_weights))
    else:
        out = merged_bag_fused(weight, _NONE if trail is None else trail, _NONE if state is None else state, dense,
                               *op_args(layout, inputs), *hyper)
    return out if dense is None else out[0]


