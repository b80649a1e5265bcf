"""Graph rewrites before the PT2E routes quantize a float program, each value-identical, for
torchao's x86 inductor passes, which failed whole routes on the symbolic batch every compile here
has (docs/quantization.md, "What stays fp32"):

  * :func:`contiguous_linear_inputs`: a Linear on a non-contiguous input of 3+ dims (a
    ``batch_first`` LSTM/GRU's sequence) reads a contiguous copy;
  * :func:`full_rank_linear_adds`: a tensor of fewer dims added to a Linear's output (a bias-like
    buffer) is viewed to the output's rank; :func:`adds_other_shape` finds such adds, whose
    unbacked compile fails at every batch (``routes.unbacked_batch_fails``).
"""
from __future__ import annotations

from typing import Any

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

LINEAR_OPS = ("aten.linear.default",)


def _contiguous(value: torch.Tensor) -> bool:
    try:
        return bool(value.is_contiguous())
    except Exception:   # a size it cannot decide (symbolic): copy to be sure
        return False


def contiguous_linear_inputs(graph_module: nn.Module) -> int:
    """Give each Linear whose input is a non-contiguous tensor of 3+ dims (an LSTM/GRU's
    ``batch_first`` output, a transposed sequence) a contiguous copy of it; returns how many.

    Such a Linear decomposes to expand + bmm, and torchao's x86 inductor pass (0.18) compares that
    expand's sizes with ``torch.Size(...)``, which raises on the symbolic batch size that every
    compile here has (``TypeError: torch.Size() takes an iterable of 'int' (item 0 is 'Node')``):
    the whole route failed to build. After the copy the Linear is a view + addmm, which the pass
    lowers to oneDNN's int8 matmul. The copy is value-identical (its meta is the producer's)."""
    copies = 0
    for node in list(graph_module.graph.nodes):
        if not _is_linear(node) or not node.args:
            continue
        activation = node.args[0]
        value = getattr(activation, "meta", {}).get("val")
        if not isinstance(value, torch.Tensor) or value.dim() <= 2 or _contiguous(value):
            continue
        _feed_through(node, activation, torch.ops.aten.clone.default, (activation,),
                      {"memory_format": torch.contiguous_format}, value.clone(memory_format=torch.contiguous_format))
        copies += 1
    return _recompiled(graph_module, copies)


def _feed_through(node: Any, operand: Any, target: Any, args: tuple, kwargs: dict, value: torch.Tensor) -> None:
    """Give ``node`` ``target(*args, **kwargs)`` (a new node before it, its meta value ``value``) in place of
    its input ``operand``."""
    with node.graph.inserting_before(node):
        new = node.graph.call_function(target, args, kwargs)
    new.meta = {**operand.meta, "val": value}
    node.replace_input_with(operand, new)


def _recompiled(graph_module: nn.Module, changes: int) -> int:
    """``changes``, after checking and recompiling ``graph_module`` when there were any."""
    if changes:
        graph_module.graph.lint()
        graph_module.recompile()
    return changes


def _is_linear(node: Any) -> bool:
    return getattr(node, "op", None) == "call_function" and str(node.target) in LINEAR_OPS


def _linear_add(node: Any) -> tuple[Any, Any]:
    """(the Linear, the other operand) of an ``aten.add.Tensor`` of a Linear's output, else (None, None)."""
    if node.target is not torch.ops.aten.add.Tensor or len(node.args) < 2:
        return None, None
    first, second = node.args[:2]
    linear, other = (first, second) if _is_linear(first) else (second, first)
    return (linear, other) if _is_linear(linear) and hasattr(other, "meta") else (None, None)


def adds_other_shape(node: Any) -> bool:
    """An add of a Linear's output and a tensor of another shape (a bias-like buffer): torchao's
    qlinear + add fusion compares the two shapes, which asks the batch's value (``Eq(u0, 1)``)."""
    linear, other = _linear_add(node)
    shapes = [getattr(n.meta.get("val"), "shape", None) for n in (linear, other)] if linear is not None else [None]
    return None not in shapes and tuple(shapes[0]) != tuple(shapes[1])


def full_rank_linear_adds(graph_module: nn.Module) -> int:
    """View each tensor of fewer dimensions added to a Linear's output (``linear(x) + self.offset``,
    a bias-like buffer) with leading 1s to the output's rank; returns how many. Broadcasting is
    unchanged. torchao's qlinear + add fusion compares the two shapes as tuples: ``(B, 8)`` against
    ``(8,)`` compared the batch with 8, and where the batch of the compiling call was 8 the dynamic
    batch was specialized and the compile failed (``ConstraintViolationError``; a saved model's first
    call at that batch, too). Against ``(1, 8)`` the dynamic batch (>= 2) is known to differ."""
    views = 0
    for node in list(graph_module.graph.nodes):
        linear, other = _linear_add(node) if node.op == "call_function" else (None, None)
        out, value = (linear.meta.get("val"), other.meta.get("val")) if linear is not None else (None, None)
        if (not isinstance(out, torch.Tensor) or not isinstance(value, torch.Tensor) or value.dim() >= out.dim()
                or not all(isinstance(size, int) for size in value.shape)):
            continue
        shape = [1] * (out.dim() - value.dim()) + list(value.shape)
        _feed_through(node, other, torch.ops.aten.reshape.default, (other, shape), {}, value.reshape(shape))
        views += 1
    return _recompiled(graph_module, views)
