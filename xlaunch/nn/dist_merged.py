"""``DistMergeEmbeddingBagWithAdaGrad``: merged tables whose rows are sharded over the ranks of a
``torch.distributed`` process group, trained by Adagrad fused into backward (``ipex.nn``'s class).

IPEX's semantics: every rank passes the same *global* batch (one indices and offsets tensor per
table); the rows of all tables, concatenated, are dealt round-robin (global row ``g`` lives on rank
``g % world_size``, at local row ``g // world_size``); the forward returns this rank's share of the
batch, samples ``[rank * B/world, (rank + 1) * B/world)``, as one ``(local batch, tables, dim)``
tensor. Tables are sum-pooled and share one dim and one dtype (fp32 or fp64).

How: each rank pools every bag over the rows it holds (a partial sum), and one
``all_to_all_single`` sends each rank the partial sums of its samples, which it adds up. The
backward gathers every rank's upstream gradient (``all_gather``) and each rank updates the rows it
holds, each row once with its summed gradient, as ``torch.optim.Adagrad`` would. Collectives are
the process group's own (gloo on CPU; tested with 2 ranks).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import Tensor, nn

from xlaunch.nn.bag_ops import check_bounds
from xlaunch.nn.bag_torch import ADAGRAD, _apply, compute_dtype
from xlaunch.nn.merged import AdaGradArgs, _non_negative, _spec_of
from xlaunch.nn.tables import BagInputs, EmbeddingSpec, TableLayout, checked_specs, normalize

__all__ = ["DistMergeEmbeddingBagWithAdaGrad"]


class _DistPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, module: "DistMergeEmbeddingBagWithAdaGrad", inputs: BagInputs) -> Tensor:
        ctx.module, ctx.inputs = module, inputs
        with torch.no_grad():
            return module._pool(inputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        ctx.module._update(ctx.inputs, grad)
        return None, None, None


class DistMergeEmbeddingBagWithAdaGrad(nn.Module):
    """Row-sharded merged tables with Adagrad in backward (see the module doc).

    ``weight`` is this rank's ``(local rows, dim)`` shard; ``state_sum`` its Adagrad sums.
    """

    def __init__(self, embedding_specs: Sequence[EmbeddingSpec], lr: float = 0.01, eps: float = 1e-10,
                 group: Optional[Any] = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistMergeEmbeddingBagWithAdaGrad needs an initialized torch.distributed process group")
        specs = checked_specs(embedding_specs)
        self.layout = TableLayout(specs)
        for number, spec in enumerate(specs):
            if spec.pooling_mode != "sum":
                raise ValueError(f"table {number}: DistMergeEmbeddingBagWithAdaGrad pools with sum (as IPEX), "
                                 f"not {spec.pooling_mode!r}")
            if spec.embedding_dim != specs[0].embedding_dim or spec.dtype != specs[0].dtype:
                raise ValueError(f"table {number}: every table needs table 0's dim and dtype "
                                 f"({specs[0].embedding_dim}, {specs[0].dtype})")
            if spec.include_last_offset != specs[0].include_last_offset:
                raise ValueError(f"table {number}: every table needs table 0's include_last_offset")
        if specs[0].dtype not in (torch.float32, torch.float64):
            raise ValueError(f"DistMergeEmbeddingBagWithAdaGrad takes fp32 or fp64 tables, not {specs[0].dtype}")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.dim, self.n_tables = specs[0].embedding_dim, len(specs)
        self.lr, self.eps = _non_negative("lr", lr), _non_negative("eps", eps)
        full = []
        for spec in specs:
            rows = spec.weight.detach() if spec.weight is not None else torch.randn(spec.num_embeddings, self.dim)
            full.append(rows.to(spec.dtype))
        shard = torch.cat(full)[self.rank::self.world_size].clone()
        self.weight = nn.Parameter(shard)
        self.register_buffer("state_sum", torch.zeros_like(shard, dtype=compute_dtype(shard.dtype)))
        self._shard = TableLayout([EmbeddingSpec(shard.shape[0], self.dim, "sum")])

    @classmethod
    def from_embeddingbag_list(cls, tables: Sequence[nn.EmbeddingBag], lr: float = 0.01, eps: float = 1e-10,
                               group: Optional[Any] = None) -> "DistMergeEmbeddingBagWithAdaGrad":
        return cls([_spec_of(table, number) for number, table in enumerate(tables)], lr, eps, group)

    def forward(self, indices: Sequence[Tensor], offsets: Optional[Sequence[Tensor]] = None) -> Tensor:
        """This rank's ``(global batch / world size, tables, dim)`` share of the pooled outputs."""
        inputs = normalize(self.layout, indices, offsets, None, self.weight.dtype)
        check_bounds(self.layout, inputs)            # the same on every rank: all raise, none waits
        if inputs.batch % self.world_size:
            raise ValueError(f"the global batch ({inputs.batch}) must divide by the world size ({self.world_size})")
        return _DistPool.apply(self.weight, self, inputs)

    def _owned(self, inputs: BagInputs, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """Table ``t``'s lookups: (this rank holds the row, its local row or 0, the lookup's bag)."""
        used = inputs.lookups(t)
        rows = inputs.indices[t][:used].long() + self.layout.row_bases[t]
        mine = rows % self.world_size == self.rank
        offsets = inputs.offsets[t][:inputs.batch].long()
        bags = torch.repeat_interleave(torch.arange(inputs.batch),
                                       torch.diff(offsets, append=torch.tensor([used])), output_size=used)
        return mine, torch.where(mine, rows // self.world_size, 0), bags

    def _pool(self, inputs: BagInputs) -> Tensor:
        batch, local = inputs.batch, inputs.batch // self.world_size
        partial = torch.empty(batch, self.n_tables, self.dim, dtype=self.weight.dtype)
        for t in range(self.n_tables):
            mine, rows, _ = self._owned(inputs, t)
            partial[:, t] = F.embedding_bag(rows, self.weight.detach(), inputs.offsets[t][:batch].long(), mode="sum",
                                            per_sample_weights=mine.to(self.weight.dtype))
        received = torch.empty_like(partial)
        dist.all_to_all_single(received, partial, group=self.group)     # rank r gets samples of rank r
        return received.view(self.world_size, local, self.n_tables, self.dim).sum(0)

    def _update(self, inputs: BagInputs, grad: Tensor) -> None:
        compute = compute_dtype(self.weight.dtype)
        gathered = [torch.empty_like(grad, dtype=compute) for _ in range(self.world_size)]
        dist.all_gather(gathered, grad.to(compute).contiguous(), group=self.group)
        upstream = torch.cat(gathered).transpose(0, 1).reshape(-1, self.dim)    # (tables * batch, dim)
        rows, bags = [], []
        for t in range(self.n_tables):
            mine, local_rows, bag = self._owned(inputs, t)
            rows.append(local_rows[mine])
            bags.append(bag[mine] + t * inputs.batch)
        lookups, order = torch.sort(torch.cat(rows))
        if lookups.numel() == 0:
            return
        unique, counts = torch.unique_consecutive(lookups, return_counts=True)
        summed = F.embedding_bag(torch.cat(bags).index_select(0, order), upstream, torch.cumsum(counts, 0) - counts,
                                 mode="sum")
        with torch.no_grad():
            _apply(ADAGRAD, self._shard, 0, 1, unique, summed, self.weight.data.view(-1), None,
                   self.state_sum.view(-1), self.lr, 0.0, self.eps)

    @property
    def weights(self) -> tuple[Tensor]:
        """IPEX's spelling of this rank's shard: ``weights[0]`` is ``weight``."""
        return (self.weight,)

    @property
    def adagrad_args(self) -> AdaGradArgs:
        """IPEX's accessor: ``hessian[0]`` is ``state_sum`` (no split-bf16 tables here)."""
        return AdaGradArgs([self.state_sum], [torch.empty(0, dtype=torch.bfloat16)], self.eps, self.lr)

    def extra_repr(self) -> str:
        return (f"{self.n_tables} tables, dim {self.dim}, rank {self.rank} of {self.world_size}, "
                f"{self.weight.shape[0]} local rows, lr={self.lr}, eps={self.eps}")
