"""The rank a tensor must have, read from the model's structure alone (no sample input).

Linear+BatchNorm1d folding needs it: BatchNorm1d normalizes dim 1 and takes ``(N, C)`` or
``(N, C, L)``, a Linear acts on the last dim, so the fold is right only when the BN sees ``(N, C)``.
On ``(N, L, C)`` with ``L == C`` both modules run and a fold would silently change the results.
So the rank is followed back through the FX graph (or the ``nn.Sequential`` children before the
Linear) to an operation that fixes it: ``Flatten``/``flatten(x, 1)``, ``view``/``reshape`` to two
sizes, ``EmbeddingBag``, a reduction over named dims of a convolution's output, ... Rank-keeping
steps in between (activations, dropout, Linear, BatchNorm1d, LayerNorm) are followed; anything
else (the model's own input, an op not listed here) means "unknown", and the fold is left to a
sample input. Each step gives the set of ranks its output can have when the forward runs without
error; a certain rank is a set of one.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.nn.functional as F
    from torch import nn

Ranks = Optional[frozenset]   # None: unknown
MAX_STEPS = 64                # how far back a rank is followed

KEEP_RANK_MODULES = (
    nn.Linear, nn.Identity, nn.Dropout, nn.AlphaDropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU,
    nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh,
    nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.LayerNorm,
)
KEEP_RANK_FUNCTIONS = {
    torch.relu, torch.tanh, torch.sigmoid, F.relu, F.relu6, F.leaky_relu, F.elu, F.gelu, F.silu,
    F.mish, F.hardswish, F.hardsigmoid, F.softplus, F.dropout, F.layer_norm, F.linear,
}
KEEP_RANK_METHODS = {"relu", "tanh", "sigmoid", "contiguous", "float", "clone", "detach", "to"}
REDUCTIONS = {"mean", "sum", "amax", "amin"}
REDUCTION_FUNCTIONS = {torch.mean, torch.sum, torch.amax, torch.amin}
# (module types, the ranks their input and output may have)
FIXED_RANKS = (
    ((nn.BatchNorm1d,), frozenset({2, 3})),
    ((nn.BatchNorm2d,), frozenset({4})),
    ((nn.BatchNorm3d,), frozenset({5})),
    ((nn.Conv1d, nn.ConvTranspose1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d), frozenset({2, 3})),
    ((nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d), frozenset({3, 4})),
    ((nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveAvgPool3d), frozenset({4, 5})),
)


def certain(ranks: Ranks) -> Optional[int]:
    """The rank when exactly one is possible, else None."""
    return next(iter(ranks)) if ranks is not None and len(ranks) == 1 else None


def _meet(ranks: Ranks, allowed: frozenset) -> frozenset:
    return allowed if ranks is None else ranks & allowed


def _acts_as(module: nn.Module, classes: tuple) -> bool:
    """``module`` is one of ``classes`` and runs that class's own forward (a subclass may not)."""
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in classes)


def through_module(module: nn.Module, ranks: Ranks) -> Ranks:
    """The ranks of ``module``'s output, given the ranks of its input."""
    if _acts_as(module, (nn.Flatten,)):
        return _flattened(module.start_dim, module.end_dim, ranks)
    if _acts_as(module, (nn.EmbeddingBag,)):
        return frozenset({2})
    for types, allowed in FIXED_RANKS:
        if _acts_as(module, types):
            return _meet(ranks, allowed)
    if _acts_as(module, (nn.Sequential,)):
        return through_modules(module, ranks)
    return ranks if _acts_as(module, KEEP_RANK_MODULES) else None   # e.g. RemovedDropout is an Identity


def through_modules(modules: Iterable[nn.Module], ranks: Ranks = None) -> Ranks:
    """The ranks after running ``modules`` one after another on an input of ``ranks``."""
    for module in modules:
        ranks = through_module(module, ranks)
    return ranks


def _flattened(start: Any, end: Any, ranks: Ranks) -> Ranks:
    if end != -1 or not isinstance(start, int) or start < 0:
        return None
    return frozenset({start + 1})


def _reduced(ranks: Ranks, dims: Any, keepdim: Any) -> Ranks:
    if keepdim is True:
        return ranks
    if keepdim not in (False, None) or ranks is None:
        return None
    dims = (dims,) if isinstance(dims, int) else dims
    if not isinstance(dims, (tuple, list)) or not dims or not all(isinstance(d, int) for d in dims):
        return None
    return frozenset(r - len(dims) for r in ranks if all(-r <= d < r for d in dims))


def of_node(node: Any, graph_module: nn.Module, steps: int = MAX_STEPS) -> Ranks:
    """The ranks the value of FX ``node`` can have (None: unknown)."""
    if steps <= 0 or not isinstance(node, torch.fx.Node) or not node.args:
        return None
    source, op, target = node.args[0], node.op, node.target
    if op == "call_module":
        return through_module(graph_module.get_submodule(target), of_node(source, graph_module, steps - 1))
    if (op, target) in (("call_function", torch.flatten), ("call_method", "flatten")):
        return _flattened(_arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1), None)
    if (op == "call_method" and target in ("view", "reshape")) or (op, target) == ("call_function", torch.reshape):
        return _reshaped(node.args[1:] if op == "call_method" else node.args[1:2])
    if (op == "call_method" and target in REDUCTIONS) or (op == "call_function" and target in REDUCTION_FUNCTIONS):
        return _reduced(of_node(source, graph_module, steps - 1), _arg(node, 1, "dim", None),
                        _arg(node, 2, "keepdim", False))
    if (op == "call_function" and target in KEEP_RANK_FUNCTIONS) or (op == "call_method" and target in KEEP_RANK_METHODS):
        return of_node(source, graph_module, steps - 1)
    return None


def _reshaped(sizes: tuple) -> Ranks:
    """``view``/``reshape`` to ``sizes``: one int per dim, or one tuple/list of them."""
    if len(sizes) == 1 and not isinstance(sizes[0], int):
        sizes = sizes[0] if isinstance(sizes[0], (tuple, list)) else ()
    return frozenset({len(sizes)}) if sizes else None


def _arg(node: Any, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)
