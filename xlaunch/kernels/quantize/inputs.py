"""``quantize``'s inputs checked before anything is built: ``example_inputs`` (a tensor or a tuple)
and ``calibration``, whose batches are matched against the example's structure.

The rule for calibration batches (docs/quantization.md): each batch is the model's inputs, as
``example_inputs`` holds them. A batch that is one tensor is one input. A batch holding more items
than ``example_inputs`` (a DataLoader's ``(x, label)`` pair) is taken as its first
``len(example_inputs)`` items, and the report says so: the saved program takes exactly the
example's inputs, so the rest could never reach the model. Each tensor must have the dtype and,
apart from the batch dimension, the shape of the example's tensor at that position; anything else
(fewer items, a label where an input should be) is one error naming the batch, before any work.

Calibration is bounded: at most :data:`MAX_BATCHES` batches and :data:`MAX_BYTES` of input tensors
are read (a whole DataLoader over a data set would be held in memory, and every route runs each
batch); the rest is never drawn, and the report says so.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch


# What quantize reads of ``calibration`` at most (docs/quantization.md): the first batches, in order.
MAX_BATCHES = 64
MAX_BYTES = 1 << 30
_END = object()


def as_args(inputs: Any, what: str) -> tuple:
    """A tensor as a 1-tuple, a non-empty tuple or list as a tuple; else one TypeError naming ``what``."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and inputs:
        return tuple(inputs)
    kind = f"an empty {type(inputs).__name__}" if isinstance(inputs, (tuple, list)) else type(inputs).__name__
    raise TypeError(f"quantize: {what} must be a tensor or a non-empty tuple of inputs, not {kind}")


def check_rows(batch: tuple, what: str) -> tuple:
    """``batch`` unless one of its tensors holds no rows (a batch of 0: nothing to calibrate on,
    measure or time; the error measure failed on it with ``max(): Expected reduction dim``)."""
    for position, value in enumerate(batch):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 0:
            dims = ",".join(map(str, value.shape))
            raise ValueError(f"quantize: {what}, input {position}: {str(value.dtype).removeprefix('torch.')}"
                             f"[{dims}] holds no rows (a batch of 0)")
    return batch


def plain(batch: tuple) -> tuple:
    """``batch`` with each inference tensor (made under ``torch.inference_mode``) copied to a plain one,
    as the routes need: autograd-tracked code and torch.export refuse inference tensors. Call it
    outside inference mode."""
    return tuple(t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t for t in batch)


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


def calibration_batches(calibration: Optional[Iterable[Any]], example: tuple) -> tuple[Optional[list[tuple]], list[str]]:
    """The calibration batches as input tuples matching ``example`` (the first :data:`MAX_BATCHES`,
    within :data:`MAX_BYTES`), and notes for the report (items left out of each batch, batches
    left unread)."""
    if calibration is None:
        return None, []
    if isinstance(calibration, (torch.Tensor, str, bytes, dict)) or not hasattr(calibration, "__iter__"):
        raise TypeError("quantize: calibration must be an iterable of input tuples (e.g. [(x1,), (x2,)]), "
                        f"not {'one tensor' if isinstance(calibration, torch.Tensor) else type(calibration).__name__}")
    batches: list[tuple] = []
    extra, size, cut = 0, 0, ""
    items = iter(calibration)
    for index, item in enumerate(items):
        batch = as_args(item, "each calibration item")
        if len(batch) < len(example):
            raise ValueError(f"quantize: calibration batch {index} holds {len(batch)} item(s), example_inputs "
                             f"{len(example)}: each batch is the model's inputs, as example_inputs")
        extra = max(extra, len(batch) - len(example))
        batch = check_rows(batch[:len(example)], f"calibration batch {index}")
        for position, (value, expected) in enumerate(zip(batch, example)):
            if not _matches(value, expected):
                raise ValueError(f"quantize: calibration batch {index}, input {position}: {signature(value)} where "
                                 f"example_inputs has {signature(expected)} (each batch is the model's inputs, "
                                 "as example_inputs; a label after them is left out)")
        size += sum(t.numel() * t.element_size() for t in batch if isinstance(t, torch.Tensor))
        if batches and size > MAX_BYTES:
            cut = f"their inputs would pass {MAX_BYTES >> 20} MiB"
            break
        batches.append(batch)
        if len(batches) == MAX_BATCHES:
            if next(items, _END) is not _END:   # one more: was anything left?
                cut = f"quantize reads at most {MAX_BATCHES} batches"
            break
    del items   # a DataLoader's iterator: its worker processes end now
    if not batches:
        raise ValueError("quantize: calibration is empty")
    notes = []
    if extra:
        notes.append(f"calibration: batches hold up to {len(example) + extra} items and example_inputs "
                     f"{len(example)}: the first {len(example)} of each were the inputs, the rest (labels) left out")
    if cut:
        notes.append(f"calibration: the first {len(batches)} batches were used ({cut}); the rest was not read "
                     "(pass fewer batches, or a DataLoader over a subset, to choose them)")
    return batches, notes
