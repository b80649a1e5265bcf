"""Eval-mode rewrites that keep results: Conv+BN and Linear+BN folding, Dropout -> Identity.

Finding what to fold is separate from folding it. Candidates come from an FX trace of the model
(so any ``forward`` that FX can trace is understood, not only ``nn.Sequential``); when the trace
fails, adjacent children of ``nn.Sequential`` containers are used instead and a note says so.
The fold itself mutates the original modules in place (new weight/bias parameters on the
producer, ``nn.Identity`` in place of the BN under every name it is registered as), so the model
keeps its class, attributes and ``forward``. Every fold can be undone (:func:`undo`).

A pair is only folded when it is safe: both modules in eval mode, the BN has running statistics
and as many features as the producer has outputs, the producer's output feeds only this BN, and
neither module is called anywhere else (shared modules are left alone); a Linear+BatchNorm1d only
when the BN's input is certainly ``(N, C)``, shown by a sample input or fixed by the graph
(:mod:`tensor_rank`: e.g. a ``Flatten`` before the Linear).

Frozen batch norms (``xlaunch.nn.FrozenBatchNorm2d``, torchvision's ``FrozenBatchNorm2d``) fold
like an eval-mode BN. They are recognized by what they hold (:func:`is_frozen_norm`), not by
class, so this module imports neither package; FX keeps them (and every ``xlaunch.nn`` module)
as leaves instead of tracing through their forward.

What folding does to parameters (as with ipex): the producer's ``weight``/``bias`` become the
folded values (a bias appears where there was none), the BN's parameters and statistics leave
the model (its ``state_dict`` has no BN entries). A checkpoint of the *un-optimized* model can
still be loaded into the folded one: :class:`FoldedCheckpointLoader` (a ``load_state_dict``
pre-hook) folds the checkpoint's BN entries into the producer's on the way in.
A removed Dropout becomes a :class:`RemovedDropout`, an ``nn.Identity`` that keeps ``p`` and
``inplace`` (ipex keeps ``p`` too), so code reading ``model.drop.p`` still works.

The rewritten model is for inference: put back in training mode it trains without its batch
norms and dropout. :class:`TrainWarning` (the model's ``train``) says so, once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize import tensor_rank

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass(frozen=True)
class Pair:
    """A producer (conv or linear) whose only consumer is a batch norm, by qualified name."""

    producer: str
    norm: str
    kind: str                       # "conv" | "linear"
    norm_input_rank: Optional[int] = None   # rank of the BN input: from a sample input, or fixed by the graph
    blocked: Optional[str] = None   # why the graph forbids folding (sharing, other users), if it does


@dataclass(frozen=True)
class FoldRecord:
    """What a later checkpoint needs to be folded the same way (names relative to the model)."""

    producer: str
    norm: str
    kind: str
    eps: float
    transposed: bool


class RemovedDropout(nn.Identity):
    """An eval-mode Dropout, removed: an identity that still says what it was."""

    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.p = float(getattr(dropout, "p", 0.0))
        self.inplace = bool(getattr(dropout, "inplace", False))
        self.replaced = type(dropout).__name__

    def extra_repr(self) -> str:
        return f"p={self.p}, replaces {self.replaced}"


class FoldedCheckpointLoader:
    """``load_state_dict`` pre-hook of a folded model: a checkpoint that still has the BN entries
    (saved from the un-optimized model) is folded into the producer's weight and bias first.
    A checkpoint of the folded model (no BN entries) loads as it is."""

    BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")

    def __init__(self, records: list[FoldRecord]) -> None:
        self.records = list(records)

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any,
                 strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        for record in self.records:
            norm = f"{prefix}{record.norm}."
            producer = f"{prefix}{record.producer}."
            if not any(norm + key in state_dict for key in self.BN_KEYS):
                continue
            mean, var = state_dict.get(norm + "running_mean"), state_dict.get(norm + "running_var")
            weight = state_dict.get(producer + "weight")
            if mean is None or var is None or weight is None:
                error_msgs.append(f"the checkpoint has entries of {record.norm}, folded into {record.producer} by "
                                  f"xlaunch.optimize, but not its running statistics and {record.producer}.weight")
                continue
            from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

            with torch.no_grad():
                args = (weight.float(), _float_or_none(state_dict.get(producer + "bias")), mean.float(),
                        var.float(), record.eps, _float_or_none(state_dict.get(norm + "weight")),
                        _float_or_none(state_dict.get(norm + "bias")))
                if record.kind == "conv":
                    new_weight, new_bias = fuse_conv_bn_weights(*args, transpose=record.transposed)
                else:
                    new_weight, new_bias = fuse_linear_bn_weights(*_linear_args(args))
            state_dict[producer + "weight"] = new_weight.detach()
            state_dict[producer + "bias"] = new_bias.detach()
            for key in self.BN_KEYS:
                state_dict.pop(norm + key, None)


def _float_or_none(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.float()


def _linear_args(args: tuple) -> tuple:
    """fuse_linear_bn_weights wants BN weight and bias tensors (no None for affine=False)."""
    weight, bias, mean, var, eps, bn_w, bn_b = args
    if bn_w is None:
        bn_w = torch.ones_like(mean)
    if bn_b is None:
        bn_b = torch.zeros_like(mean)
    return weight, bias, mean, var, eps, bn_w, bn_b


@dataclass
class FoldLog:
    """What was done and what was left alone, with reasons; also what :func:`undo` needs."""

    folded: list[Pair] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)   # (what, why)
    dropouts_removed: list[str] = field(default_factory=list)
    records: list[FoldRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _undo: list[Any] = field(default_factory=list, repr=False)


FROZEN_NORM_BUFFERS = ("weight", "bias", "running_mean", "running_var")


def is_frozen_norm(module: nn.Module) -> bool:
    """A frozen batch norm: a ``FrozenBatchNorm*`` class holding the four per-channel buffers
    (no parameters, no children) and a float ``eps`` (torchvision's and xlaunch.nn's classes)."""
    if not type(module).__name__.startswith("FrozenBatchNorm") or not isinstance(getattr(module, "eps", None), float):
        return False
    buffers = dict(module.named_buffers(recurse=False))
    tensors = [buffers.get(name) for name in FROZEN_NORM_BUFFERS]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() for t in tensors):
        return False
    return (len({t.numel() for t in tensors}) == 1 and not any(True for _ in module.parameters(recurse=False))
            and not any(True for _ in module.children()))


def is_norm(module: nn.Module) -> bool:
    """A batch norm that folds: ``nn.BatchNorm1d/2d/3d`` or a frozen batch norm."""
    return isinstance(module, BN_TYPES) or is_frozen_norm(module)


def _norm_features(norm: nn.Module) -> int:
    return int(norm.running_mean.numel()) if norm.running_mean is not None else int(norm.num_features)


def aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every qualified name each submodule is registered under (shared modules have several)."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return names


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def _producer_kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, CONV_TYPES):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    return None


def find_pairs(model: nn.Module, sample_input: Any = None) -> tuple[list[Pair], list[str]]:
    """Producer->BN pairs found by FX (with shapes when ``sample_input`` is given), else by
    walking ``nn.Sequential`` containers. Returns (pairs, notes)."""
    try:
        return _pairs_from_fx(model, sample_input), []
    except Exception as exc:  # FX cannot trace data-dependent control flow, many custom ops, ...
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
        note = f"FX could not trace the model ({reason[:160]}); folding only adjacent nn.Sequential children"
        return _pairs_from_sequentials(model), [note]


def _pairs_from_fx(model: nn.Module, sample_input: Any) -> list[Pair]:
    import warnings

    import torch.fx

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
            return (is_frozen_norm(module) or type(module).__module__.startswith("xlaunch.nn.")
                    or super().is_leaf_module(module, qualified_name))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracer = LeafTracer()
        graph_module = torch.fx.GraphModule(model, tracer.trace(model), type(model).__name__)
    if sample_input is not None:
        from torch.fx.passes.shape_prop import ShapeProp

        inputs = sample_input if isinstance(sample_input, tuple) else (sample_input,)
        with torch.no_grad():
            ShapeProp(graph_module).propagate(*inputs)
    graph = graph_module.graph
    calls: dict[str, int] = {}
    attr_users: set[str] = set()
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
        elif node.op == "get_attr":
            attr_users.add(str(node.target).rpartition(".")[0])
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not is_norm(graph_module.get_submodule(node.target)):
            continue
        if len(node.args) != 1 or node.kwargs:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or source.op != "call_module":
            continue
        kind = _producer_kind(graph_module.get_submodule(source.target))
        if kind is None:
            continue
        blocked = None
        if calls[source.target] != 1:
            blocked = f"the {kind} is shared (called at {calls[source.target]} places)"
        elif calls[node.target] != 1:
            blocked = f"the batch norm is shared (called at {calls[node.target]} places)"
        elif len(source.users) != 1:
            blocked = f"the {kind} output is also used outside the batch norm"
        elif source.target in attr_users or node.target in attr_users:
            blocked = "the forward reads these modules' tensors directly"
        meta = source.meta.get("tensor_meta")
        rank = len(meta.shape) if meta is not None and hasattr(meta, "shape") else None
        if rank is None and kind == "linear":   # no sample input: the rank the graph fixes, if any
            rank = tensor_rank.certain(tensor_rank.of_node(source, graph_module))
        pairs.append(Pair(source.target, node.target, kind, rank, blocked))
    return pairs


def _pairs_from_sequentials(model: nn.Module) -> list[Pair]:
    pairs = []
    seen: set[int] = set()
    for name, container in model.named_modules():
        if not isinstance(container, nn.Sequential) or id(container) in seen:
            continue
        seen.add(id(container))
        children = list(container.named_children())
        for index, ((first_name, first), (second_name, second)) in enumerate(zip(children, children[1:])):
            kind = _producer_kind(first)
            if kind is not None and is_norm(second):
                prefix = f"{name}." if name else ""
                rank = tensor_rank.certain(tensor_rank.through_modules(m for _, m in children[:index + 1]))
                pairs.append(Pair(prefix + first_name, prefix + second_name, kind, rank if kind == "linear" else None))
    return pairs


def why_not(pair: Pair, producer: nn.Module, norm: nn.Module, names: dict[int, list[str]],
            linear_needs_shape: bool = True) -> Optional[str]:
    """The reason this pair must not be folded, or None when folding keeps the results."""
    if pair.blocked:
        return pair.blocked
    if producer.training or norm.training:
        return "a module is in training mode (folding is for eval only)"
    if not getattr(norm, "track_running_stats", True) or norm.running_mean is None or norm.running_var is None:
        return "the batch norm has no running statistics (track_running_stats=False)"
    outputs = producer.out_channels if pair.kind == "conv" else producer.out_features
    if _norm_features(norm) != outputs:
        return f"the batch norm has {_norm_features(norm)} features but the {pair.kind} has {outputs} outputs"
    if not producer.weight.is_floating_point():
        return f"the {pair.kind} weight is {producer.weight.dtype}, not floating point"
    if pair.kind == "conv" and producer.transposed and producer.groups != 1:
        return "grouped transposed convolution is not folded"
    if pair.kind == "linear":
        if pair.norm_input_rank is None and linear_needs_shape:
            return ("nothing before the linear fixes the rank of its input (e.g. a Flatten), so the batch norm "
                    "may see (N, L, C) and folding could change results; a sample_input would show (N, C)")
        if pair.norm_input_rank is not None and pair.norm_input_rank != 2:
            return f"the batch norm input has rank {pair.norm_input_rank}; it normalizes a dim the linear does not produce"
    if len(names.get(id(producer), ())) > 1:
        return f"the {pair.kind} is shared (registered as {', '.join(names[id(producer)])})"
    if len(names.get(id(norm), ())) > 1:
        return f"the batch norm is shared (registered as {', '.join(names[id(norm)])})"
    return None


def _folded_params(producer: nn.Module, norm: nn.Module, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

    with torch.no_grad():
        if kind == "conv":
            weight, bias = fuse_conv_bn_weights(
                producer.weight, producer.bias, norm.running_mean, norm.running_var,
                norm.eps, norm.weight, norm.bias, transpose=producer.transposed,
            )
        else:
            weight, bias = fuse_linear_bn_weights(
                producer.weight, producer.bias, norm.running_mean, norm.running_var,
                norm.eps, norm.weight, norm.bias,
            )
    return weight.detach(), bias.detach()


def fold_pairs(model: nn.Module, pairs: list[Pair], log: FoldLog, kinds: set[str],
               linear_needs_shape: bool = True) -> None:
    """Fold each pair of an enabled kind that is safe to fold; record the rest with a reason."""
    names = aliases(model)
    for pair in pairs:
        if pair.kind not in kinds:
            continue
        producer, norm = model.get_submodule(pair.producer), model.get_submodule(pair.norm)
        reason = why_not(pair, producer, norm, names, linear_needs_shape)
        if reason is None:
            try:
                weight, bias = _folded_params(producer, norm, pair.kind)
            except Exception as exc:  # keep the module as it was, and say why
                reason = f"fold failed: {type(exc).__name__}: {exc}"
        if reason is not None:
            log.skipped.append((f"{pair.producer}+{pair.norm}", reason))
            continue
        log._undo.append(("params", producer, producer.weight, producer.bias))
        producer.weight = nn.Parameter(weight, requires_grad=producer.weight.requires_grad)
        producer.bias = nn.Parameter(bias, requires_grad=producer.weight.requires_grad)
        for name in names[id(norm)]:
            log._undo.append(("module", name, norm))
            _replace(model, name, nn.Identity())
        log.folded.append(pair)
        log.records.append(FoldRecord(pair.producer, pair.norm, pair.kind, float(norm.eps),
                                      bool(pair.kind == "conv" and producer.transposed)))


def remove_dropout(model: nn.Module, log: FoldLog) -> None:
    """Replace eval-mode dropout modules (identities in eval) by one :class:`RemovedDropout` each."""
    for module_id, module_names in aliases(model).items():
        module = model.get_submodule(module_names[0]) if module_names[0] else model
        if not isinstance(module, DROPOUT_TYPES) or module.training or module is model:
            continue
        for name in module_names:
            log._undo.append(("module", name, module))
        replacement = RemovedDropout(module)
        for name in module_names:
            _replace(model, name, replacement)
        log.dropouts_removed.append(module_names[0])


def undo(model: nn.Module, log: FoldLog) -> None:
    """Put every folded or removed module back exactly as it was."""
    for entry in reversed(log._undo):
        if entry[0] == "params":
            _, producer, weight, bias = entry
            producer.weight = weight
            if bias is None:
                producer.register_parameter("bias", None)
            else:
                producer.bias = bias
        else:
            _, name, module = entry
            _replace(model, name, module)
    log._undo.clear()
    log.notes.append(f"undone: {len(log.folded)} folds, {len(log.dropouts_removed)} dropouts")
    log.skipped.extend((f"{p.producer}+{p.norm}", "undone after verification") for p in log.folded)
    log.folded.clear()
    log.records.clear()
    log.dropouts_removed.clear()


class TrainWarning:
    """The folded model's ``train``: ``model.train()`` warns once that the model runs without the
    batch norms and dropout folded away for inference, then runs the class's own ``train``."""

    def __init__(self, module: nn.Module, folded: int, dropouts: int) -> None:
        self.module, self.folded, self.dropouts, self.warned = module, folded, dropouts, False

    def __call__(self, mode: bool = True) -> nn.Module:
        if mode and not self.warned:
            self.warned = True
            from xlaunch.kernels.optimize.notes import warn

            removed = [f"{count} {what} {how}" for count, what, how in (
                (self.folded, "batch norm(s)", "folded into the layers before them"),
                (self.dropouts, "dropout(s)", "removed")) if count]
            warn(f"{type(self.module).__name__}.train(): this model was optimized for inference ({' and '.join(removed)}); "
                 "in training mode it runs without them, unlike the model given to optimize: to train, optimize that "
                 "model in training mode (model.train(), with its optimizer)")
        return type(self.module).train(self.module, mode)


def warn_on_train(model: nn.Module, folded: int, dropouts: int) -> None:
    """Make ``model.train()`` warn (:class:`TrainWarning`) when something was folded or removed;
    an instance ``train`` of the user's own is left alone."""
    current = model.__dict__.get("train")
    if (folded or dropouts) and (current is None or isinstance(current, TrainWarning)):
        model.__dict__["train"] = TrainWarning(model, folded, dropouts)
