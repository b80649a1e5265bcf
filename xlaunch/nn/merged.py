"""Merged embedding bags: many ``nn.EmbeddingBag`` tables in one module and one weight storage.

    merged = MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=0.01)
    outputs = merged(indices, offsets)        # one (batch, dim) tensor per table
    loss(outputs).backward()                  # rows updated here; no .grad, no optimizer step

The names and signatures are ``ipex.nn``'s (``EmbeddingSpec``, ``from_embeddingbag_list``,
``to_bfloat16_train``), so a port is a rename. Beyond IPEX: tables may differ in dim, pooling mode
(sum, mean, max) and ``include_last_offset``; indices may be int32 or int64, 1-D with offsets or
2-D ``(batch, bag size)``; ``per_sample_weights`` work with sum pooling. Weights are fp64, fp32,
fp16 or bf16, one dtype for all tables (IPEX's rule); every index is checked against its own table
before anything is read or written (``IndexError`` naming the table, the position and the range).

* :class:`MergedEmbeddingBag`: dense weight gradient, for any torch optimizer.
* :class:`MergedEmbeddingBagWithSGD` / :class:`MergedEmbeddingBagWithAdaGrad`: the update runs
  inside backward on the rows the batch touched, equal to ``torch.optim.SGD`` / ``Adagrad`` on
  those rows. Rows the batch did not touch are left alone, so weight decay (SGD) applies to the
  touched rows only, as in IPEX and fbgemm (a dense SGD would decay every row).
  bf16 weights keep a split fp32 master: the bf16 weight is its high half, ``trail`` its low half.
* :class:`MergedEmbeddingBagWithCat`: the dense feature and all pooled tables in one
  ``(batch, dense_dim + sum of dims)`` matrix, written in place (no ``torch.cat``).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor, nn

from xlaunch.kernels.optim.splitbf16 import TRAIL_DTYPE, join, split
from xlaunch.nn.bag_ops import fast_pool, pool, pool_fused
from xlaunch.nn.bag_torch import ADAGRAD, SGD, compute_dtype
from xlaunch._errors import real_number
from xlaunch.nn.tables import BagInputs, EmbeddingSpec, TableLayout, checked_specs, normalize

__all__ = ["EmbeddingSpec", "MergedEmbeddingBag", "MergedEmbeddingBagWithCat", "MergedEmbeddingBagWithSGD",
           "MergedEmbeddingBagWithAdaGrad", "SGDArgs", "AdaGradArgs"]

WEIGHT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class SGDArgs(NamedTuple):
    """``ipex.nn``'s ``sgd_args``: per-table split-bf16 low halves (views; empty for other dtypes)."""

    bf16_trail: list
    weight_decay: float
    lr: float


class AdaGradArgs(NamedTuple):
    """``ipex.nn``'s ``adagrad_args``: per-table squared-gradient sums and split-bf16 low halves (views)."""

    hessian: list
    bf16_trail: list
    eps: float
    lr: float


def _spec_of(table: nn.EmbeddingBag, number: int) -> EmbeddingSpec:
    if not isinstance(table, nn.EmbeddingBag):
        raise TypeError(f"table {number} is a {type(table).__name__}, not an nn.EmbeddingBag")
    unsupported = [name for name, value in (("max_norm", table.max_norm), ("padding_idx", table.padding_idx))
                   if value is not None]
    if table.scale_grad_by_freq:
        unsupported.append("scale_grad_by_freq")
    if unsupported:
        raise ValueError(f"table {number} uses {', '.join(unsupported)}, which merged embedding bags do not support")
    rows, dim = table.weight.shape
    return EmbeddingSpec(rows, dim, table.mode, table.weight.dtype, table.weight.detach(), table.sparse,
                         table.include_last_offset)


class MergedEmbeddingBag(nn.Module):
    """Tables of ``nn.EmbeddingBag`` in one weight storage, pooled in one call.

    ``weight`` is the one flat parameter (its gradient is dense); ``weights[t]`` is table ``t``'s
    ``(rows, dim)`` view of it. ``forward(indices, offsets=None, per_sample_weights=None)`` takes
    one entry per table (as ``nn.EmbeddingBag.forward`` would) and returns one output per table.
    Gradients do not flow into ``per_sample_weights`` unless they require grad (then the table
    pooling goes through ``F.embedding_bag``).
    """

    def __init__(self, embedding_specs: Sequence[EmbeddingSpec]) -> None:
        super().__init__()
        specs = checked_specs(embedding_specs)
        self.layout = TableLayout(specs)
        for number, spec in enumerate(specs):   # IPEX: "expect all tables have same dtype"
            if spec.dtype not in WEIGHT_DTYPES:
                raise ValueError(f"table {number}: weight dtype {spec.dtype} is not one of "
                                 f"{', '.join(str(d) for d in WEIGHT_DTYPES)}")
            if spec.dtype != specs[0].dtype:
                raise ValueError(f"table {number} has weight dtype {spec.dtype}, table 0 {specs[0].dtype}: all tables "
                                 "need one weight dtype (as in IPEX); convert the tables to one dtype first")
        self._check_specs(specs)
        weight = torch.empty(self.layout.numel, dtype=specs[0].dtype)
        with torch.no_grad():
            for number, spec in enumerate(specs):
                block = self.layout.view(weight, number)
                if spec.weight is None:
                    block.normal_()   # nn.EmbeddingBag's initialization
                elif tuple(spec.weight.shape) != tuple(block.shape):
                    raise ValueError(f"table {number}: weight has shape {tuple(spec.weight.shape)}, "
                                     f"the spec says {tuple(block.shape)}")
                else:
                    block.copy_(spec.weight)
        self.weight = nn.Parameter(weight)
        self.n_tables = len(specs)

    def _check_specs(self, specs: list[EmbeddingSpec]) -> None:
        sparse = [number for number, spec in enumerate(specs) if spec.sparse]
        if sparse:
            raise ValueError(f"tables {sparse} have sparse=True: MergedEmbeddingBag gives a dense gradient; "
                             "use MergedEmbeddingBagWithSGD or MergedEmbeddingBagWithAdaGrad for sparse updates")

    @classmethod
    def from_embeddingbag_list(cls, tables: Sequence[nn.EmbeddingBag], *args: Any, **kwargs: Any) -> "MergedEmbeddingBag":
        """A merged module holding copies of ``tables``' weights (their modes and offsets forms)."""
        return cls([_spec_of(table, number) for number, table in enumerate(tables)], *args, **kwargs)

    @property
    def weights(self) -> tuple[Tensor, ...]:
        """Each table's ``(rows, dim)`` view of the storage (``ipex.nn``'s ``weights[i]``); after a
        backward, ``weights[i].grad`` is table ``i``'s block of ``weight.grad``."""
        flat, grad = self.weight.detach(), self.weight.grad
        views = tuple(self.layout.view(flat, number) for number in range(self.n_tables))
        if grad is not None and grad.layout == torch.strided and grad.shape == flat.shape:
            for number, view in enumerate(views):
                view.grad = self.layout.view(grad, number)
        return views

    def _pool_weight(self) -> Tensor:
        """The weight the forward reads: IPEX's autocast rule (bf16 or fp16 autocast without grad
        mode pools a copy of fp32 weights in that dtype; with grad mode, the weights' own dtype)."""
        weight = self.weight
        if weight.dtype == torch.float32 and not torch.is_grad_enabled() and torch.is_autocast_enabled("cpu"):
            low = torch.get_autocast_dtype("cpu")
            if low in (torch.bfloat16, torch.float16):
                return weight.to(low)
        return weight

    def _inputs(self, indices: Any, offsets: Any, per_sample_weights: Any) -> BagInputs:
        return normalize(self.layout, indices, offsets, per_sample_weights, self.weight.dtype)

    def forward(self, indices: Sequence[Tensor], offsets: Optional[Sequence[Tensor]] = None,
                per_sample_weights: Optional[Sequence[Optional[Tensor]]] = None) -> list[Tensor]:
        """One ``(batch, dim)`` output per table."""
        if per_sample_weights is None and not torch.is_grad_enabled():
            pooled = fast_pool(self.weight, self.layout, indices, offsets)
            if pooled is not None:
                return pooled
        return pool(self._pool_weight(), self.layout, self._inputs(indices, offsets, per_sample_weights))

    def _apply(self, fn: Any, recurse: bool = True) -> "MergedEmbeddingBag":
        """A cast or move drops the cached views of the old weight (the pure-torch path's blocks),
        which kept its whole storage alive."""
        super()._apply(fn, recurse)
        self.layout.cache.clear()
        return self

    def extra_repr(self) -> str:
        layout = self.layout
        tables = ", ".join(f"{layout.rows[t]}x{layout.dims[t]} {layout.modes[t]}" for t in range(self.n_tables))
        return f"{self.n_tables} tables ({tables}), {self.weight.dtype}"

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        if prefix + "weight" not in state_dict and any(key.startswith(prefix + "weights.") for key in state_dict):
            self._load_ipex_tables(state_dict, prefix, missing_keys, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _load_ipex_tables(self, state_dict: dict, prefix: str, missing_keys: list, error_msgs: list) -> None:
        """A checkpoint of ``ipex.nn``'s merged classes: one ``weights.N`` per table and nothing else
        (IPEX keeps Adagrad's sums and the split-bf16 low halves out of it): the tables it holds,
        with zero sums and low halves (the master is the loaded value), as a module built from them.
        A missing table is a missing key, a table of another shape a size mismatch (torch's words)."""
        flat = self.weight.detach().clone()
        for number in range(self.n_tables):
            key = f"{prefix}weights.{number}"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value, block = state_dict.pop(key), self.layout.view(flat, number)
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            if shape != tuple(block.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                                  f"the shape in current model is {tuple(block.shape)}.")
                continue
            block.copy_(value)
        state_dict[prefix + "weight"] = flat
        for name in ("trail", "state_sum"):
            buffer = getattr(self, name, None)
            if isinstance(buffer, torch.Tensor) and prefix + name not in state_dict:
                state_dict[prefix + name] = torch.zeros_like(buffer)


class MergedEmbeddingBagWithCat(MergedEmbeddingBag):
    """``torch.cat([dense_feature, *pooled], dim=1)`` computed in place: ``forward(indices,
    offsets, dense_feature)`` returns one ``(batch, dense_dim + sum of dims)`` matrix."""

    def forward(self, indices: Sequence[Tensor], offsets: Optional[Sequence[Tensor]] = None,  # type: ignore[override]
                dense_feature: Optional[Tensor] = None,
                per_sample_weights: Optional[Sequence[Optional[Tensor]]] = None) -> Tensor:
        inputs = self._inputs(indices, offsets, per_sample_weights)
        if not isinstance(dense_feature, Tensor) or dense_feature.dim() != 2 or dense_feature.shape[0] != inputs.batch:
            raise ValueError(f"dense_feature must be a (batch={inputs.batch}, dim) tensor")
        if not dense_feature.is_cpu:     # (a meta one gave garbage: the operator's fake kernel ran)
            raise ValueError(f"dense_feature is on {dense_feature.device}; xlaunch.nn runs on the CPU")
        weight = self._pool_weight()
        return pool(weight, self.layout, inputs, dense_feature.to(weight.dtype))


class _FusedUpdate(MergedEmbeddingBag):
    """Shared by the fused classes: no gradient, the rows are updated in backward."""

    kind = SGD

    def __init__(self, embedding_specs: Sequence[EmbeddingSpec]) -> None:
        super().__init__(embedding_specs)
        trail = torch.zeros_like(self.weight, dtype=TRAIL_DTYPE) if self.weight.dtype == torch.bfloat16 else None
        self.register_buffer("trail", trail)

    def _check_specs(self, specs: list[EmbeddingSpec]) -> None:
        pass   # sparse=True or not, the update only ever touches the looked-up rows

    def to_bfloat16_train(self) -> "_FusedUpdate":
        """bf16 weights with a split fp32 master (``ipex.nn``'s name): the forward reads the bf16
        high half, the update runs on the exact fp32 master (``weight`` joined with ``trail``)."""
        if self.weight.dtype != torch.bfloat16:   # IPEX splits fp64 tables' fp32 values too; fp16's are exact
            top, trail = split(self.weight.detach().float())
            self.weight = nn.Parameter(top)
            self.trail = trail
            self.layout.cache.clear()      # (its views of the old weight kept that storage alive)
            if getattr(self, "state_sum", None) is not None:
                self.state_sum = self.state_sum.float()
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "_FusedUpdate":
        """``.float()``, ``.bfloat16()``, ``.to(dtype)`` keep what the update needs: a cast to bf16
        splits the exact value into ``weight`` and ``trail`` (as :meth:`to_bfloat16_train`), a cast
        from split bf16 casts the fp32 master (the bf16 half alone lost the low bits, and the
        kept ``trail`` failed the next update), and Adagrad's sums stay in the update's dtype."""
        weight, trail, state = self.weight.detach(), self.trail, getattr(self, "state_sum", None)
        super()._apply(fn, recurse)
        if self.weight.dtype == weight.dtype:
            return self
        with torch.no_grad():
            value = join(weight, trail) if trail is not None else weight
            if self.weight.dtype == torch.bfloat16:
                top, self.trail = split(value.float())   # IPEX splits fp64 tables' fp32 values too
                self.weight.data = top
            else:
                self.weight.data, self.trail = fn(value), None
            if state is not None:
                self.state_sum = state.to(compute_dtype(self.weight.dtype))
        return self

    def master_weight(self) -> Tensor:
        """The fp32 weights the updates work on (a new tensor)."""
        weight = self.weight.detach()
        if self.trail is not None:
            return join(weight, self.trail)
        return weight.float().clone()

    def forward(self, indices: Sequence[Tensor], offsets: Optional[Sequence[Tensor]] = None,
                per_sample_weights: Optional[Sequence[Optional[Tensor]]] = None) -> list[Tensor]:
        """One ``(batch, dim)`` output per table; their backward updates the touched rows."""
        if not torch.is_grad_enabled():
            return MergedEmbeddingBag.forward(self, indices, offsets, per_sample_weights)
        inputs = self._inputs(indices, offsets, per_sample_weights)
        return pool_fused(self.weight, self.trail, self._state(), self.layout, inputs, self.kind, self.lr,
                          self._weight_decay(), self._eps())

    def _trails(self) -> list[Tensor]:
        """Each table's split-bf16 low half as IPEX holds it (a bf16 view of ``trail``'s bits)."""
        if self.trail is None:
            return [torch.empty(0, dtype=torch.bfloat16) for _ in range(self.n_tables)]
        return [self.layout.view(self.trail, number).view(torch.bfloat16) for number in range(self.n_tables)]

    def _state(self) -> Optional[Tensor]:
        return None

    def _weight_decay(self) -> float:
        return 0.0

    def _eps(self) -> float:
        return 0.0


def _non_negative(name: str, value: float) -> float:
    """A hyperparameter: a finite number >= 0 (one line naming it otherwise)."""
    return real_number(value, name, 0.0)


class MergedEmbeddingBagWithSGD(_FusedUpdate):
    """Merged tables trained by plain SGD fused into backward (``lr``, ``weight_decay``)."""

    def __init__(self, embedding_specs: Sequence[EmbeddingSpec], lr: float = 0.01, weight_decay: float = 0.0) -> None:
        super().__init__(embedding_specs)
        self.lr = _non_negative("lr", lr)
        self.weight_decay = _non_negative("weight_decay", weight_decay)

    def _weight_decay(self) -> float:
        return self.weight_decay

    @property
    def sgd_args(self) -> SGDArgs:
        """IPEX's accessor: ``(bf16_trail, weight_decay, lr)``."""
        return SGDArgs(self._trails(), self.weight_decay, self.lr)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lr={self.lr}, weight_decay={self.weight_decay}"


class MergedEmbeddingBagWithAdaGrad(_FusedUpdate):
    """Merged tables trained by Adagrad fused into backward (``lr``, ``eps``); the squared-gradient
    sums are the fp32 buffer ``state_sum`` (``torch.optim.Adagrad``'s ``state_sum``)."""

    kind = ADAGRAD

    def __init__(self, embedding_specs: Sequence[EmbeddingSpec], lr: float = 0.01, eps: float = 1e-10) -> None:
        super().__init__(embedding_specs)
        self.lr = _non_negative("lr", lr)
        self.eps = _non_negative("eps", eps)
        # fp64 tables keep fp64 sums (torch.optim.Adagrad's state is the parameter's dtype); others fp32
        self.register_buffer("state_sum", torch.zeros(self.layout.numel, dtype=compute_dtype(self.weight.dtype)))

    def _state(self) -> Optional[Tensor]:
        return self.state_sum

    def _eps(self) -> float:
        return self.eps

    @property
    def adagrad_args(self) -> AdaGradArgs:
        """IPEX's accessor: ``(hessian, bf16_trail, eps, lr)``, ``hessian[t]`` table ``t``'s view of ``state_sum``."""
        hessian = [self.layout.view(self.state_sum, number) for number in range(self.n_tables)]
        return AdaGradArgs(hessian, self._trails(), self.eps, self.lr)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lr={self.lr}, eps={self.eps}"
