"""``quantize``'s inputs checked before anything is built: ``example_inputs`` (a tensor or a tuple)
and ``calibration``, whose batches are matched against the example's structure.

The rule for calibration batches (docs/quantization.md): each batch is the model's inputs, as
``example_inputs`` holds them. A batch that is one tensor is one input. A batch holding more items
than ``example_inputs`` (a DataLoader's ``(x, label)`` pair) is taken as its first
``len(example_inputs)`` items, and the report says so: the saved program takes exactly the
example's inputs, so the rest could never reach the model. Each tensor must have the dtype and,
apart from the batch dimension, the shape of the example's tensor at that position; anything else
(fewer items, a label where an input should be) is one error naming the batch, before any work.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch


def as_args(inputs: Any, what: str) -> tuple:
    """A tensor as a 1-tuple, a non-empty tuple or list as a tuple; else one TypeError naming ``what``."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and inputs:
        return tuple(inputs)
    raise TypeError(f"quantize: {what} must be a tensor or a non-empty tuple of inputs, not {type(inputs).__name__}")


def signature(value: Any) -> str:
    """``float32[N,16]`` for a tensor (``N``: the batch), else the type's name."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    dims = ["N", *map(str, value.shape[1:])] if value.dim() else []
    return f"{str(value.dtype).removeprefix('torch.')}[{','.join(dims)}]"


def _matches(item: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return (isinstance(item, torch.Tensor) and item.dtype == expected.dtype and item.dim() == expected.dim()
                and item.shape[1:] == expected.shape[1:])
    return not isinstance(item, torch.Tensor)


def calibration_batches(calibration: Optional[Iterable[Any]], example: tuple) -> tuple[Optional[list[tuple]], str]:
    """The calibration batches as input tuples matching ``example``, and a note for the report
    (empty unless items were left out of each batch)."""
    if calibration is None:
        return None, ""
    if isinstance(calibration, (torch.Tensor, str, bytes, dict)) or not hasattr(calibration, "__iter__"):
        raise TypeError("quantize: calibration must be an iterable of input tuples (e.g. [(x1,), (x2,)]), "
                        f"not {'one tensor' if isinstance(calibration, torch.Tensor) else type(calibration).__name__}")
    batches, extra = [], 0
    for index, item in enumerate(calibration):
        batch = as_args(item, "each calibration item")
        if len(batch) < len(example):
            raise ValueError(f"quantize: calibration batch {index} holds {len(batch)} item(s), example_inputs "
                             f"{len(example)}: each batch is the model's inputs, as example_inputs")
        extra = max(extra, len(batch) - len(example))
        batch = batch[:len(example)]
        for position, (value, expected) in enumerate(zip(batch, example)):
            if not _matches(value, expected):
                raise ValueError(f"quantize: calibration batch {index}, input {position}: {signature(value)} where "
                                 f"example_inputs has {signature(expected)} (each batch is the model's inputs, "
                                 "as example_inputs; a label after them is left out)")
        batches.append(batch)
    if not batches:
        raise ValueError("quantize: calibration is empty")
    if not extra:
        return batches, ""
    return batches, (f"calibration: batches hold up to {len(example) + extra} items and example_inputs "
                     f"{len(example)}: the first {len(example)} of each were the inputs, the rest (labels) left out")
