"""Pure helpers for :class:`MultiStreamModule`: how many streams, split inputs into per-stream
slices, join outputs.

A *hint* mirrors the structure of the value it describes. A leaf hint is an ``int`` (the batch
dimension of every tensor below it) or ``None`` (do not split: every stream gets the whole
value; for outputs: take stream 0's value). A tuple, list or dict hint gives one hint per item;
a dict key the hint leaves out gets dimension 0. An output dataclass is joined field by field
(a dict hint by field name). Non-tensor leaves are never split.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from xlaunch._errors import as_index

Hint = Any  # int | None | tuple/list of Hint | dict[str, Hint]


class StreamHint:
    """How to split a call's positional and keyword arguments: ``StreamHint(0, None, mask=1)``.

    Also IPEX's ``MultiStreamModuleHint`` (the same class under that name). As an output hint,
    ``StreamHint(h)`` describes the whole output with ``h`` and ``StreamHint(key=h, ...)`` a
    dict output, key by key (see :func:`output_hint`).
    """

    def __init__(self, *args: Hint, **kwargs: Hint) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        items = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"StreamHint({', '.join(items)})"


MultiStreamModuleHint = StreamHint


def get_default_num_streams(cpu_pool: Any = None) -> int:
    """IPEX's name: the streams ``num_streams="auto"`` gives for ``cpu_pool``, one per CPU (one
    core per stream usually gives the best throughput). ``cpu_pool`` defaults to ``CPUPool()``, one
    CPU per allowed physical core."""
    from xlaunch.runtime_ext.pool import CPUPool

    if cpu_pool is None:
        cpu_pool = CPUPool()
    if not isinstance(cpu_pool, CPUPool):
        raise TypeError(f"cpu_pool must be a CPUPool, got {type(cpu_pool).__name__}")
    return len(cpu_pool)


def output_hint(hint: Any) -> Hint:
    """The structural hint for outputs: a plain hint as given, or one taken from a StreamHint."""
    if not isinstance(hint, StreamHint):
        return hint
    if hint.args and hint.kwargs:
        raise ValueError("an output hint describes one output: give StreamHint(h) or StreamHint(key=h, ...), not both")
    if len(hint.args) > 1:
        raise ValueError(f"an output hint describes one output, got {len(hint.args)} positional hints")
    if hint.kwargs:
        return dict(hint.kwargs)
    return hint.args[0] if hint.args else 0


def checked_hint(hint: Hint, name: str) -> Hint:
    """``hint`` with every leaf checked and made a plain ``int`` (numpy's and one-element integer
    tensors too) or ``None``; a StreamHint's args and kwargs the same. ``TypeError`` naming
    ``name`` for any other leaf (a float such as 1.5, a bool, a string)."""
    if isinstance(hint, StreamHint):
        return StreamHint(*[checked_hint(h, name) for h in hint.args],
                          **{key: checked_hint(h, name) for key, h in hint.kwargs.items()})
    if hint is None:
        return None
    if isinstance(hint, (tuple, list)):
        return type(hint)(checked_hint(h, name) for h in hint)
    if isinstance(hint, dict):
        return {key: checked_hint(h, name) for key, h in hint.items()}
    index = as_index(hint)
    if index is not None:
        return index
    raise TypeError(f"{name}: a hint is an int dimension, None, or a tuple, list or dict of hints, not {hint!r}")


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(like: Any, items: list) -> Any:
    if _is_namedtuple(like):
        return type(like)(*items)
    return type(like)(items)


def _child_hints(value: Any, hint: Hint) -> list:
    """One hint per child of ``value`` (a tuple/list), checking the hint's shape."""
    if isinstance(hint, (tuple, list)):
        if len(hint) != len(value):
            raise ValueError(f"hint {hint!r} has {len(hint)} items but the value has {len(value)}")
        return list(hint)
    return [hint] * len(value)


def _dict_hint(hint: Hint, key: Any) -> Hint:
    if isinstance(hint, dict):
        return hint.get(key, 0)
    return hint


def _check_dim(tensor: Any, dim: Any, hint_name: str) -> None:
    """ValueError naming ``hint_name`` when ``dim`` is not an int dimension of ``tensor``."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{hint_name}: a tensor needs an int or None hint, got {dim!r}")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{hint_name}: dimension {dim} of a {tensor.dim()}-dimensional tensor")


def batch_sizes(value: Any, hint: Hint, found: Optional[list] = None) -> list:
    """Sizes along the split dimension of every tensor that ``hint`` splits."""
    found = [] if found is None else found
    if hint is None:
        return found
    if _is_tensor(value):
        if not isinstance(hint, int) or isinstance(hint, bool):
            raise ValueError(f"a tensor needs an int or None hint, got {hint!r}")
        if value.dim() == 0:
            raise ValueError("cannot split a 0-dimensional tensor; give it a None hint")
        _check_dim(value, hint, "input_split_hint")
        found.append(int(value.shape[hint]))
    elif isinstance(value, (tuple, list)):
        for item, item_hint in zip(value, _child_hints(value, hint)):
            batch_sizes(item, item_hint, found)
    elif isinstance(value, dict):
        for key, item in value.items():
            batch_sizes(item, _dict_hint(hint, key), found)
    return found


def common_batch(args: tuple, kwargs: dict, hint: StreamHint) -> int:
    """The one batch size of all split tensors; ValueError when they disagree or there is none."""
    sizes = batch_sizes(list(args), list(hint.args) if hint.args else 0)
    for key, value in kwargs.items():
        batch_sizes(value, hint.kwargs.get(key, 0), sizes)
    if not sizes:
        raise ValueError("no tensor to split across streams (check input_split_hint)")
    if len(set(sizes)) != 1:
        raise ValueError(f"tensors split across streams disagree on the batch size: {sorted(set(sizes))}")
    return sizes[0]


def slice_sizes(batch: int, streams: int) -> list[int]:
    """``batch`` split over at most ``streams`` non-empty slices, the first ones one larger."""
    used = max(1, min(streams, batch))
    size, extra = divmod(batch, used)
    return [size + (1 if i < extra else 0) for i in range(used)]


def split_value(value: Any, hint: Hint, sizes: Sequence[int]) -> list:
    """``value`` cut into ``len(sizes)`` per-stream values (views, no copies)."""
    parts = len(sizes)
    if hint is None:
        return [value] * parts
    if _is_tensor(value):
        return list(value.split(list(sizes), dim=hint))
    if isinstance(value, (tuple, list)):
        columns = [split_value(item, h, sizes) for item, h in zip(value, _child_hints(value, hint))]
        return [_rebuild(value, [column[i] for column in columns]) for i in range(parts)]
    if isinstance(value, dict):
        columns = {key: split_value(item, _dict_hint(hint, key), sizes) for key, item in value.items()}
        return [type(value)((key, column[i]) for key, column in columns.items()) for i in range(parts)]
    return [value] * parts


def split_call(args: tuple, kwargs: dict, hint: StreamHint, sizes: Sequence[int]) -> list[tuple[tuple, dict]]:
    """Per-stream ``(args, kwargs)``."""
    arg_parts = split_value(list(args), list(hint.args) if hint.args else 0, sizes)
    kwarg_parts = {key: split_value(value, hint.kwargs.get(key, 0), sizes) for key, value in kwargs.items()}
    return [(tuple(arg_parts[i]), {k: v[i] for k, v in kwarg_parts.items()}) for i in range(len(sizes))]


def join_outputs(outputs: Sequence[Any], hint: Hint = 0) -> Any:
    """Per-stream outputs joined into one: tensors concatenated along ``hint``, structure kept."""
    first = outputs[0]
    if hint is None or len(outputs) == 1:
        return first
    if _is_tensor(first):
        import torch

        if first.dim() == 0:
            raise ValueError("output_concat_hint: a 0-dimensional output cannot be concatenated; "
                             "give it a None hint (stream 0's value is kept)")
        _check_dim(first, hint, "output_concat_hint")
        return torch.cat(list(outputs), dim=hint)
    if isinstance(first, (tuple, list)):
        hints = _child_hints(first, hint)
        return _rebuild(first, [join_outputs([o[i] for o in outputs], hints[i]) for i in range(len(first))])
    if isinstance(first, dict):
        return type(first)((key, join_outputs([o[key] for o in outputs], _dict_hint(hint, key))) for key in first)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):  # field by field, a dict hint by name
        return dataclasses.replace(first, **{field.name: join_outputs([getattr(o, field.name) for o in outputs],
                                                                      _dict_hint(hint, field.name))
                                             for field in dataclasses.fields(first) if field.init})
    if all(_same(first, other) for other in outputs[1:]):
        return first
    return list(outputs)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False
