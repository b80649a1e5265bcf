"""Where each table of a merged embedding bag lives, and the per-call inputs, checked once.

Every table's rows live in one flat weight storage, table after table (table ``t`` starts at
element ``weight_offsets[t]`` and is a ``(rows, dim)`` block); tables may differ in dim, pooling
mode and ``include_last_offset``. The outputs of one call are one flat buffer too: as a list
(table ``t``'s ``(batch, dim)`` block after the previous tables'), or as one ``(batch, width)``
matrix with a dense feature first (``MergedEmbeddingBagWithCat``). The compiled kernels read a
small int64 table (``meta``) describing both; the pure-torch paths read the same record.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor

from xlaunch._errors import flag, whole_number

MODES = {"sum": 0, "mean": 1, "max": 2}
# Columns of the kernels' meta table (xlaunch/nn/csrc/bag_common.h, enum Col).
WEIGHT_OFFSET, ROWS, DIM, MODE, OUT_OFFSET, OUT_STRIDE, ROW_BASE = range(7)


class EmbeddingSpec(NamedTuple):
    """One table, as ``ipex.nn.modules.merged_embeddingbag.EmbeddingSpec`` spells it."""

    num_embeddings: int
    embedding_dim: int
    pooling_mode: str = "mean"
    dtype: torch.dtype = torch.float32
    weight: Optional[Tensor] = None
    sparse: bool = False
    include_last_offset: bool = False


def checked_specs(embedding_specs: object) -> list[EmbeddingSpec]:
    """The tables' specs, each field checked (one line naming the table and the field) and
    normalized: integer rows and dims (numpy's too; a float such as 3.5 is refused, not truncated),
    a known pooling mode, a torch dtype, a tensor or no weight, bool flags."""
    if isinstance(embedding_specs, EmbeddingSpec) or not isinstance(embedding_specs, (list, tuple)):
        raise TypeError(f"embedding_specs must be a list of EmbeddingSpec (one per table), "
                        f"not {type(embedding_specs).__name__}")
    if not embedding_specs:
        raise ValueError("a merged embedding bag needs at least one table")
    specs = []
    for number, spec in enumerate(embedding_specs):
        if not isinstance(spec, tuple) or not 2 <= len(spec) <= len(EmbeddingSpec._fields):
            raise TypeError(f"table {number}: expected an EmbeddingSpec, not {type(spec).__name__}")
        spec = EmbeddingSpec(*spec)
        where = f"table {number}: "
        if not isinstance(spec.pooling_mode, str) or spec.pooling_mode not in MODES:
            raise ValueError(f"{where}pooling_mode must be one of {', '.join(MODES)}, not {spec.pooling_mode!r}")
        if not isinstance(spec.dtype, torch.dtype):
            raise TypeError(f"{where}dtype must be a torch.dtype, not {spec.dtype!r}")
        if spec.weight is not None and not isinstance(spec.weight, Tensor):
            raise TypeError(f"{where}weight must be a tensor or None, not {type(spec.weight).__name__}")
        specs.append(spec._replace(num_embeddings=whole_number(spec.num_embeddings, where + "num_embeddings"),
                                   embedding_dim=whole_number(spec.embedding_dim, where + "embedding_dim", 1),
                                   sparse=flag(spec.sparse, where + "sparse"),
                                   include_last_offset=flag(spec.include_last_offset, where + "include_last_offset")))
    return specs


class TableLayout:
    """The tables' places in the flat weight storage (fixed at construction); ``specs`` as
    :func:`checked_specs` returns them."""

    def __init__(self, specs: Sequence[EmbeddingSpec]) -> None:
        if not specs:
            raise ValueError("a merged embedding bag needs at least one table")
        self.rows: list[int] = []
        self.dims: list[int] = []
        self.modes: list[str] = []
        self.include_last: list[bool] = []
        self.weight_offsets: list[int] = []
        self.row_bases: list[int] = []
        numel = total_rows = 0
        for number, spec in enumerate(specs):
            rows, dim = int(spec.num_embeddings), int(spec.embedding_dim)
            self.rows.append(rows)
            self.dims.append(dim)
            self.modes.append(spec.pooling_mode)
            self.include_last.append(bool(spec.include_last_offset))
            self.weight_offsets.append(numel)
            self.row_bases.append(total_rows)
            numel += rows * dim
            total_rows += rows
        self.numel, self.total_rows = numel, total_rows
        self._meta: dict[tuple, Tensor] = {}
        self.cache: dict = {}   # the pure-torch path's tensors per call shape (xlaunch.nn.bag_torch)

    def __len__(self) -> int:
        return len(self.rows)

    def view(self, flat: Tensor, table: int) -> Tensor:
        """Table ``table``'s ``(rows, dim)`` block of a flat storage (a view)."""
        start = self.weight_offsets[table]
        return flat[start:start + self.rows[table] * self.dims[table]].view(self.rows[table], self.dims[table])

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs ``[first, stop)`` of consecutive tables with one dim and one pooling mode
        (the pure-torch path pools each run with one ``F.embedding_bag``)."""
        runs, first = [], 0
        for table in range(1, len(self) + 1):
            if table == len(self) or (self.dims[table], self.modes[table]) != (self.dims[first], self.modes[first]):
                runs.append((first, table))
                first = table
        return runs

    def list_places(self, batch: int) -> tuple[list[int], list[int], int]:
        """(offsets, strides, numel) of the outputs as one flat buffer of per-table blocks."""
        offsets, at = [], 0
        for dim in self.dims:
            offsets.append(at)
            at += batch * dim
        return offsets, list(self.dims), at

    def cat_places(self, batch: int, dense_dim: int) -> tuple[list[int], list[int], int]:
        """(offsets, strides, numel) of the outputs as columns of one ``(batch, width)`` matrix
        whose first ``dense_dim`` columns hold the dense feature."""
        width = dense_dim + sum(self.dims)
        offsets, at = [], dense_dim
        for dim in self.dims:
            offsets.append(at)
            at += dim
        return offsets, [width] * len(self), batch * width

    def meta(self, out_offsets: list[int], out_strides: list[int]) -> Tensor:
        """The kernels' int64 ``(tables, 7)`` description for these output places (cached)."""
        key = (tuple(out_offsets), tuple(out_strides))
        found = self._meta.get(key)
        if found is None:
            found = torch.tensor([[self.weight_offsets[t], self.rows[t], self.dims[t], MODES[self.modes[t]],
                                   out_offsets[t], out_strides[t], self.row_bases[t]] for t in range(len(self))],
                                 dtype=torch.int64)
            if len(self._meta) > 16:
                self._meta.clear()
            self._meta[key] = found
        return found


class BagInputs(NamedTuple):
    """One call's inputs, normalized: contiguous 1-D indices and offsets of one integer dtype,
    ``batch`` bags per table, per-sample weights (or None) in the weights' dtype."""

    indices: list[Tensor]
    offsets: list[Tensor]
    per_sample_weights: list[Optional[Tensor]]
    batch: int

    def lookups(self, table: int) -> int:
        """How many of table ``table``'s indices fall in a bag."""
        offsets = self.offsets[table]
        return int(offsets[self.batch]) if offsets.numel() > self.batch else self.indices[table].numel()


def _as_list(value: object, name: str, count: int) -> list:
    if isinstance(value, Tensor) and count == 1:
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {count} tensors (one per table), not {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} tables")
    return list(value)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _as(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` in ``dtype``, contiguous (itself when it already is: no call per table)."""
    return tensor if tensor.dtype == dtype and tensor.is_contiguous() else tensor.to(dtype).contiguous()


def normalize(layout: TableLayout, indices: object, offsets: object, per_sample_weights: object,
              weight_dtype: torch.dtype) -> BagInputs:
    """Check and normalize one call's inputs (the forms ``nn.EmbeddingBag`` accepts, per table)."""
    count = len(layout)
    indices = _as_list(indices, "indices", count)
    offsets = [None] * count if offsets is None else _as_list(offsets, "offsets", count)
    weights = [None] * count if per_sample_weights is None else _as_list(per_sample_weights, "per_sample_weights", count)
    wide = any(not isinstance(i, Tensor) or i.dtype != torch.int32 for i in indices)
    dtype = torch.int64 if wide else torch.int32
    out_indices, out_offsets, out_weights, batch = [], [], [], None
    for t in range(count):
        idx, off, psw = indices[t], offsets[t], weights[t]
        if not isinstance(idx, Tensor) or idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices of table {t} must be an int32 or int64 tensor")
        if isinstance(off, Tensor) and off.dtype not in _INDEX_DTYPES and (
                off.is_floating_point() or off.is_complex() or off.dtype == torch.bool):
            raise TypeError(f"offsets of table {t} must be an integer tensor, not {off.dtype}")
        if not idx.is_cpu or (isinstance(off, Tensor) and not off.is_cpu):
            where = idx.device if not idx.is_cpu else off.device
            raise ValueError(f"{'indices' if not idx.is_cpu else 'offsets'} of table {t} are on {where}; "
                             "xlaunch.nn runs on the CPU")
        if idx.dim() == 2:
            if off is not None:
                raise ValueError(f"table {t}: offsets must be None when indices are 2-D (batch, bag size)")
            bags, size = idx.shape
            off = torch.arange(bags, dtype=dtype) * size    # bags of size 0 too (arange's step may not be 0)
            idx = idx.reshape(-1)
            table_batch = bags
        elif idx.dim() == 1:
            if not isinstance(off, Tensor) or off.dim() != 1:
                raise ValueError(f"table {t}: 1-D indices need 1-D offsets")
            table_batch = off.numel() - (1 if layout.include_last[t] else 0)
            if table_batch < 0:
                raise ValueError(f"table {t}: include_last_offset needs at least one offset")
        else:
            raise ValueError(f"indices of table {t} must be 1-D (with offsets) or 2-D, not {idx.dim()}-D")
        if batch is None:
            batch = table_batch
        elif table_batch != batch:
            raise ValueError(f"every table needs the same number of bags: table 0 has {batch}, table {t} has {table_batch}")
        if psw is not None:
            if not isinstance(psw, Tensor) or psw.is_complex() or psw.dtype == torch.bool:
                raise TypeError(f"per_sample_weights of table {t} must be a real tensor or None, "
                                f"not {psw.dtype if isinstance(psw, Tensor) else type(psw).__name__}")
            if not psw.is_cpu:     # (a meta one pooled garbage: its fake kernel ran)
                raise ValueError(f"per_sample_weights of table {t} are on {psw.device}; xlaunch.nn runs on the CPU")
            if layout.modes[t] != "sum":
                raise ValueError(f"table {t}: per_sample_weights need pooling_mode 'sum', not {layout.modes[t]!r}")
            psw = psw.reshape(-1)
            if psw.numel() != idx.numel():
                raise ValueError(f"table {t}: per_sample_weights must have one weight per index")
            psw = psw.to(weight_dtype).contiguous()
        out_indices.append(_as(idx, dtype))
        out_offsets.append(_as(off, dtype))
        out_weights.append(psw)
    batch = int(batch or 0)
    if not torch.compiler.is_compiling():     # a compiled graph's operators check them as they run
        check_offsets(out_offsets, [idx.numel() for idx in out_indices], batch, layout.cache)
    return BagInputs(out_indices, out_offsets, out_weights, batch)


def offset_ranges(lengths: tuple, counts: tuple, batch: int, dtype: torch.dtype,
                   cache: dict) -> tuple[Tensor, Tensor, Tensor]:
    """For the tables' offsets concatenated (cached per call shape): each offset's shift, its
    table's first lookup among all tables' lookups, and its valid range once shifted, ``[lo, hi]``:
    ``[base, base + count]``, narrowed to ``base`` for a table's first offset and to ``base + count``
    for an ``include_last_offset`` table's last one."""
    key = ("offset ranges", lengths, counts, batch, dtype)
    found = cache.get(key)
    if found is None:
        wide = torch.int64 if sum(counts) >= 2 ** 31 else dtype
        sizes = torch.tensor(lengths)
        bases = torch.tensor([0, *counts[:-1]], dtype=torch.int64).cumsum(0)
        shift = bases.repeat_interleave(sizes)
        lo, hi = shift.clone(), (bases + torch.tensor(counts)).repeat_interleave(sizes)
        start = 0
        for base, count, size in zip(bases.tolist(), counts, lengths):
            if size:
                hi[start] = base                    # offsets[0] == 0
            if size == batch + 1 and batch:
                lo[start + batch] = base + count    # include_last_offset: the last offset ends the indices
            start += size
        found = (shift.to(wide), lo.to(wide), hi.to(wide))
        if len(cache) > 64:
            cache.clear()
        cache[key] = found
    return found


def offsets_valid(offsets: Sequence[Tensor], counts: Sequence[int], batch: int, cache: dict) -> bool:
    """Whether every table's offsets (``batch`` of them, or ``batch + 1`` with the last) start at
    0, never decrease, stay within ``[0, count]`` (``count``: the table's indices) and, with the
    last, end at ``count``: one pass over all tables (one ``cat``, a shift into one index space where
    the tables follow each other, then ``clamp`` to the ranges, ``cummax``, one ``equal``)."""
    if not offsets:
        return True
    flat = torch.cat(list(offsets)) if len(offsets) > 1 else offsets[0]
    if flat.numel() == 0:
        return True
    shift, lo, hi = offset_ranges(tuple([o.numel() for o in offsets]), tuple(counts), batch, flat.dtype, cache)
    return placed_offsets_valid(flat + shift, lo, hi)


def placed_offsets_valid(placed: Tensor, lo: Tensor, hi: Tensor) -> bool:
    """Whether offsets shifted into one index space (:func:`offset_ranges`) are valid: exactly when
    the ranges clamp nothing and the clamped offsets never decrease (a value above its range is
    clamped below it, and ``hi`` never decreases along the tables, so no earlier value lifts the
    running maximum back to it; one below its range is lifted above it)."""
    return torch.equal(torch.cummax(torch.clamp(placed, lo, hi), 0)[0], placed)


def offsets_problem(offsets: Sequence[Tensor], counts: Sequence[int], batch: int) -> Optional[str]:
    """What is wrong with the first bad offset (table by table), or None."""
    for t, (off, count) in enumerate(zip(offsets, counts)):
        if off.numel() == 0:
            continue
        off = off.long()
        before = torch.cat([off.new_zeros(1), off[:-1]])
        bad = (off < 0) | (off > count) | (off < before)
        bad[0] |= bool(off[0] != 0)
        if off.numel() == batch + 1 and batch:
            bad[batch] |= bool(off[batch] != count)
        if not bool(bad.any()):
            continue
        position = int(torch.nonzero(bad)[0, 0])
        value = int(off[position])
        where = f"offset {value} at position {position} of table {t}"
        if not 0 <= value <= count:
            return f"{where} is out of range [0, {count}] (the table has {count} indices)"
        if position == 0:
            return f"{where} is not 0: the first bag starts at the table's first index"
        if value < int(before[position]):
            return f"{where} is less than the offset before it ({int(before[position])}): offsets must not decrease"
        return (f"{where} is not the table's number of indices ({count}): with include_last_offset, the last "
                f"offset ends the last bag at the end of the indices")
    return None


def check_offsets(offsets: Sequence[Tensor], counts: Sequence[int], batch: int, cache: dict) -> None:
    """Raise ``ValueError`` naming the table, the position and the problem when an offset is wrong
    (see :func:`offsets_valid`), before anything is read."""
    if not offsets_valid(offsets, counts, batch, cache):
        raise ValueError(offsets_problem(offsets, counts, batch) or "invalid offsets")


class CallPlan(NamedTuple):
    """What :func:`normalize` found for one call signature (each table's indices and offsets dtype
    and shape), so that a later call of the same signature skips it: the inputs' dtypes, dims and
    shapes are all it checks, apart from an ``include_last_offset`` table's last offset (read per
    call). ``forms[t]``: 0 for 1-D indices and ``batch`` offsets, 1 for 1-D with ``batch + 1``
    offsets (include_last_offset), 2 for 2-D indices (``arange[t]`` their offsets)."""

    batch: int
    forms: tuple
    arange: tuple


def signature(indices: object, offsets: object) -> Optional[tuple]:
    """The key of a call's :class:`CallPlan` (None: a form only :func:`normalize` takes)."""
    if not isinstance(indices, (list, tuple)):
        return None
    try:
        if offsets is None:
            return tuple([(i.dtype, i.shape) for i in indices])
        if not isinstance(offsets, (list, tuple)) or len(offsets) != len(indices):
            return None
        return tuple([(i.dtype, i.shape, None if o is None else (o.dtype, o.shape)) for i, o in zip(indices, offsets)])
    except AttributeError:
        return None


def call_plan(layout: TableLayout, indices: object, offsets: object) -> Optional[CallPlan]:
    """The cached :class:`CallPlan` of this call's signature, checking the inputs with
    :func:`normalize` (which raises what it raises) the first time; None for a form it leaves to
    the general path (per-sample weights aside, which the caller excludes)."""
    key = signature(indices, offsets)
    if key is None:
        return None
    plans = layout.cache.setdefault("plans", {})
    found = plans.get(key, False)
    if found is False:
        inputs = normalize(layout, indices, offsets, None, torch.float32)
        forms, arange = [], []
        for t, idx in enumerate(indices):
            two_d = idx.dim() == 2
            forms.append(2 if two_d else (1 if layout.include_last[t] else 0))
            arange.append(inputs.offsets[t] if two_d else None)
        dtypes = {idx.dtype for idx in indices} | {o.dtype for o in (offsets or []) if o is not None}
        found = CallPlan(inputs.batch, tuple(forms), tuple(arange)) if len(dtypes) == 1 and inputs.batch else None
        if len(plans) > 16:
            plans.clear()
        plans[key] = found
    return found
