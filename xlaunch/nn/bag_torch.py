"""The pure-torch path of the merged bags: pooling, gradients and the fused updates.

:func:`torch_pool` pools in the weights' own dtype: a run of small tables sharing a dim and mode in
one ``torch.embedding_bag`` on the run's block (indices checked against their own tables with one
reduction), other tables one call each (torch checks their indices); :func:`_torch_grad` is the
dense weight gradient (max pooling and per-sample-weight gradients included); :func:`update_rows`
applies SGD or Adagrad to the touched rows (the compiled kernel when it is built and takes the
dtype, else torch ops in :func:`compute_dtype`: for a small step one gradient row per lookup, for a
large one each row's gradient summed by a sorted embedding bag). Small calls are dominated by the
count of torch calls, so the call-shape tensors are cached on the layout and nothing syncs but the
bounds check. The registered operators live in :mod:`xlaunch.nn.bag_ops`.
"""
from __future__ import annotations

from typing import Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.nn.functional as F
    from torch import Tensor

from xlaunch.kernels.optim.splitbf16 import join_into, split_into
from xlaunch.nn import native
from xlaunch.nn.tables import MODES, BagInputs, TableLayout

WRITE_GRAD, SGD, ADAGRAD = 0, 1, 2   # update kinds (xlaunch/nn/csrc/bag_common.h, enum Kind)
NATIVE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_NONE = torch.empty(0)   # the ops' spelling of "no tensor" in a list (jit.trace cannot record Tensor?[])
# A step of at most this many lookups (all tables) updates from per-lookup gradient rows (few torch
# calls); larger ones sum each row's gradient with one sorted embedding bag (no row per lookup).
SMALL_STEP_LOOKUPS = 32768


def _ops_for(weight: Tensor) -> Optional[object]:
    """The compiled kernels when they are wanted, built, and take ``weight``'s dtype."""
    return native.ops() if weight.dtype in NATIVE_WEIGHT_DTYPES else None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and updates run in: fp64 for fp64 weights, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _places(layout: TableLayout, batch: int, dense_dim: Optional[int]) -> tuple[list[int], list[int]]:
    if dense_dim is None:
        return [0] * len(layout), list(layout.dims)
    offsets, strides, _ = layout.cat_places(batch, dense_dim)
    return offsets, strides


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


def _used(inputs: BagInputs, t: int) -> tuple[int, Tensor, Optional[Tensor]]:
    """Table ``t``'s lookups in a bag: (count, indices, per-sample weights), sliced only when needed."""
    idx, psw = inputs.indices[t], inputs.per_sample_weights[t]
    used = inputs.lookups(t)
    if used != idx.numel():
        idx = idx[:used]
        psw = None if psw is None else psw[:used]
    return used, idx, psw


def _run_shape(layout: TableLayout, first: int, stop: int, batch: int, used: tuple, dtype: torch.dtype) -> tuple:
    """Cached for a run of tables and a call shape, in the indices' dtype: each lookup's row base in
    the run's block, its valid range (zeros, last rows), each bag's offset shift, the lookups'
    count, the run's block place."""
    key = (first, stop, batch, used, dtype)
    found = layout.cache.get(key)
    if found is None:
        counts = torch.tensor(used)
        bases = torch.tensor([layout.row_bases[t] - layout.row_bases[first] for t in range(first, stop)], dtype=dtype)
        last = torch.tensor([layout.rows[t] - 1 for t in range(first, stop)], dtype=dtype)
        starts = torch.tensor([0, *used[:-1]], dtype=dtype).cumsum(0, dtype=dtype)
        rows = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
        found = (bases.repeat_interleave(counts), torch.zeros(sum(used), dtype=dtype), last.repeat_interleave(counts),
                 starts.repeat_interleave(batch), torch.tensor([sum(used)], dtype=dtype),
                 (layout.weight_offsets[first], rows))
        if len(layout.cache) > 64:
            layout.cache.clear()
        layout.cache[key] = found
    return found


def _runs(layout: TableLayout) -> list:
    found = layout.cache.get("runs")
    if found is None:
        found = layout.cache["runs"] = layout.runs()
    return found


def _arange(layout: TableLayout, count: int) -> Tensor:
    found = layout.cache.get(("arange", count))
    if found is None:
        found = layout.cache[("arange", count)] = torch.arange(count)
    return found


def _pool_run(weight: Tensor, layout: TableLayout, inputs: BagInputs, first: int, stop: int,
              aux: Optional[dict]) -> Optional[Tensor]:
    """A run of small tables in one ``torch.embedding_bag`` on the run's block (``(tables * batch,
    dim)``), its indices checked against their own tables first; None when an index is out of range."""
    batch, dim = inputs.batch, layout.dims[first]
    picked = [_used(inputs, t) for t in range(first, stop)]
    flat = torch.cat([p[1] for p in picked])
    bases, zeros, last, shifts, total, (start, rows) = _run_shape(layout, first, stop, batch,
                                                                  tuple(p[0] for p in picked), flat.dtype)
    if not torch.equal(torch.clamp(flat, zeros, last), flat):      # an index outside its own table
        return None
    shifted = flat.add(bases)
    offsets = torch.cat([o if o.numel() == batch else o[:batch] for o in inputs.offsets[first:stop]]).add_(shifts)
    # Sum pooling, then a division for mean: torch's mean pooling costs 4x its sum at this size.
    out = torch.embedding_bag(weight.narrow(0, start, rows * dim).view(rows, dim), shifted, offsets, False, 0, False,
                              None, False)[0]
    sizes = None
    if layout.modes[first] == "mean" or aux is not None:
        sizes = torch.diff(offsets, append=total)
        if layout.modes[first] == "mean":
            out.div_(sizes.clamp(min=1).unsqueeze(1))
    if aux is not None:
        aux[(first, stop)] = (shifted, None, sizes, offsets)
    return out.view(stop - first, batch, dim)


def torch_pool(weight: Tensor, layout: TableLayout, inputs: BagInputs, dense: Optional[Tensor] = None,
               aux: Optional[dict] = None) -> list[Tensor]:
    """The pure-torch forward (differentiable in ``weight`` and the per-sample weights): a run of
    tables with one dim and mode and few lookups in one ``torch.embedding_bag`` on the run's block
    (:func:`_pool_run`), other tables one call each on their own block, as the loop it replaces. The
    list of per-table outputs, or ``[cat matrix]`` with ``dense``. Torch checks each index against
    its block's rows; when an index is refused, :func:`check_bounds` names the table and position.
    ``aux`` gets the (lookup-to-bag map, bag sizes) of each table or run for :func:`update_rows`."""
    outputs: list[Tensor] = []
    batch = inputs.batch
    try:
        psw_free = not any(p is not None for p in inputs.per_sample_weights)
        for first, stop in _runs(layout):
            if (stop - first > 1 and layout.modes[first] != "max"
                    and (psw_free or all(inputs.per_sample_weights[t] is None for t in range(first, stop)))
                    and sum(inputs.lookups(t) for t in range(first, stop)) <= SMALL_STEP_LOOKUPS):
                pooled = _pool_run(weight, layout, inputs, first, stop, aux)
                if pooled is None:
                    check_bounds(layout, inputs)
                outputs.extend(pooled.unbind(0))
                continue
            for t in range(first, stop):
                _, idx, psw = _used(inputs, t)
                offsets = inputs.offsets[t]
                if offsets.numel() != batch:
                    offsets = offsets[:batch]
                out, bags, sizes, _ = torch.embedding_bag(layout.view(weight, t), idx, offsets, False,
                                                          MODES[layout.modes[t]], False, psw, False)
                outputs.append(out)
                if aux is not None:
                    aux[t] = (bags, sizes)
    except RuntimeError:
        check_bounds(layout, inputs)
        raise
    if dense is None:
        return outputs
    return [torch.cat([dense.to(weight.dtype), *outputs], dim=1)]


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
    compute = compute_dtype(weight.dtype)
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
    return [grad.to(weight.dtype), *(psw_gradients(weight, grads, layout, inputs, places) if psw_grads else [])]


def psw_gradients(weight: Tensor, grads: list, layout: TableLayout, inputs: BagInputs, places: tuple) -> list[Tensor]:
    """Each table's per-sample-weight gradient (``_NONE`` without them): every lookup's row, as the
    forward read it (so before an update), dotted with its bag's upstream gradient."""
    compute, batch, found = compute_dtype(weight.dtype), inputs.batch, []
    for t, psw in enumerate(inputs.per_sample_weights):
        if psw is None:
            found.append(_NONE)
            continue
        used, dim, offsets = inputs.lookups(t), layout.dims[t], inputs.offsets[t][:batch].long()
        bags = torch.repeat_interleave(torch.arange(batch), torch.diff(offsets, append=torch.tensor([used])),
                                       output_size=used)
        rows = layout.view(weight.detach(), t).index_select(0, inputs.indices[t][:used].long()).to(compute)
        dots = (_upstream(grads, places, t, batch, dim).to(compute).index_select(0, bags) * rows).sum(1)
        found.append(torch.cat([dots, torch.zeros(psw.numel() - used, dtype=compute)]).to(psw.dtype))
    return found


def update_rows(kind: int, layout: TableLayout, inputs: BagInputs, grads: list[Tensor], weight: Tensor,
                trail: Optional[Tensor], state: Optional[Tensor], lr: float, weight_decay: float = 0.0,
                eps: float = 0.0, dense_dim: Optional[int] = None, aux: Optional[dict] = None) -> None:
    """Apply one SGD or Adagrad step to the rows the inputs touched, from the per-table upstream
    gradients ``grads`` (the kernel's, or torch ops when it is not built or lacks the dtype;
    ``aux``: :func:`torch_pool`'s per-table bag maps, when the forward ran it)."""
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
        if "max" not in layout.modes and sum(inputs.lookups(t) for t in range(len(layout))) <= SMALL_STEP_LOOKUPS:
            _small_step(kind, layout, inputs, grads, places, weight, trail, state, lr, weight_decay, eps, aux)
            return
        for first, stop in layout.runs():
            if layout.modes[first] == "max":
                rows, values = _max_row_gradients(weight, layout, inputs, grads, places, first, stop, compute)
            else:
                rows, values = _row_gradients(layout, inputs, grads, places, first, stop, compute)
            _apply(kind, layout, first, stop, rows, values, weight, trail, state, lr, weight_decay, eps)


def _lookup_gradients(layout: TableLayout, inputs: BagInputs, grads: list, places: tuple, t: int,
                      aux: Optional[dict], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Table ``t``'s looked-up indices and each lookup's gradient row (``(lookups, dim)``, in ``dtype``)."""
    batch, dim = inputs.batch, layout.dims[t]
    used, idx, psw = _used(inputs, t)
    if places[0][t] == 0 and places[1][t] == dim:
        upstream = grads[t].view(batch, dim)
    else:
        upstream = _upstream(grads, places, t, batch, dim)
    bags, sizes = aux.get(t, (None, None)) if aux is not None else (None, None)
    if bags is None or bags.numel() != used:     # sum pooling's forward leaves the map empty
        offsets = inputs.offsets[t][:batch]
        lengths = torch.diff(offsets, append=offsets.new_full((1,), used))
        bags = torch.repeat_interleave(torch.arange(batch), lengths, output_size=used)
        sizes = lengths
    upstream = upstream.to(dtype)
    if layout.modes[t] == "mean":
        upstream = upstream / sizes.clamp(min=1).to(dtype)[:, None]
    rows = upstream.index_select(0, bags)
    if psw is not None:
        rows = rows * psw.to(dtype)[:, None]
    return idx, rows


def _small_step(kind: int, layout: TableLayout, inputs: BagInputs, grads: list, places: tuple, weight: Tensor,
                trail: Optional[Tensor], state: Optional[Tensor], lr: float, weight_decay: float, eps: float,
                aux: Optional[dict]) -> None:
    """The update of a step with few lookups: plain SGD adds each lookup's row into its table (as
    the sparse loop does); otherwise each run's rows are made unique and their gradients summed."""
    compute = compute_dtype(weight.dtype)
    direct = kind == SGD and not weight_decay and trail is None and weight.dtype == compute
    for first, stop in layout.runs():
        dim = layout.dims[first]
        if aux is not None and (first, stop) in aux:     # pooled as one run: one row per lookup, one add
            lookups, bags, sizes, offsets = aux[(first, stop)]
            if all(places[0][t] == 0 and places[1][t] == dim for t in range(first, stop)):
                upstream = torch.cat(grads[first:stop])
            else:
                upstream = torch.cat([_upstream(grads, places, t, inputs.batch, dim) for t in range(first, stop)])
            if upstream.dtype != compute:
                upstream = upstream.to(compute)
            bags = torch.repeat_interleave(_arange(layout, len(offsets)), sizes, output_size=lookups.numel())
            if layout.modes[first] == "mean":
                upstream = upstream / sizes.clamp(min=1).unsqueeze(1)
            if direct:     # index_add_ with alpha costs 3x without it
                upstream = upstream.mul_(-lr)                # (a new tensor: cat's or the division's)
            values = upstream.index_select(0, bags)
        else:
            found, parts = [], []
            for t in range(first, stop):
                idx, rows = _lookup_gradients(layout, inputs, grads, places, t, aux, compute)
                base = layout.row_bases[t] - layout.row_bases[first]
                found.append(idx.long() + base if base else idx.long())
                parts.append(rows)
            lookups = torch.cat(found) if len(found) > 1 else found[0]
            values = torch.cat(parts) if len(parts) > 1 else parts[0]
        if direct:
            if aux is None or (first, stop) not in aux:
                values = values.mul_(-lr)
            start = layout.weight_offsets[first]
            count = layout.row_bases[stop - 1] + layout.rows[stop - 1] - layout.row_bases[first]
            weight.narrow(0, start, count * dim).view(count, dim).index_add_(0, lookups, values)
            continue
        touched, inverse = torch.unique(lookups.long(), return_inverse=True)
        summed = torch.zeros(len(touched), dim, dtype=compute)
        summed.index_add_(0, inverse, values)
        _apply(kind, layout, first, stop, touched, summed, weight, trail, state, lr, weight_decay, eps)


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
        w.index_add_(0, rows, grad.mul_(-lr))     # (index_add_ with alpha costs 3x without it)
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
