"""What a module's forward changes in the module itself (``--auto-optimize`` watches its first call).

An optimized copy runs on the copy's state: a forward that updates its own module (a call counter,
a running state buffer, a cache it keeps) would update the copy, or nothing once a graph is frozen
with the value it had, and the program would read stale state or get wrong numbers. The hooks run
such a model as it is. No torch import here: tensors are told by their ``_version`` counter.
"""
from __future__ import annotations

from typing import Any, Hashable

from xlaunch._torch import tensor_version

_SCALARS = (int, float, complex, str, bytes, bool, type(None))
# the module tree and its tensors are compared entry by entry, not as the dicts holding them
_TREE = ("_parameters", "_buffers", "_modules")


def _token(value: Any) -> Hashable:
    """Equal tokens before and after a call: the value was left alone (as far as can be told
    cheaply: scalars by value, tensors by identity and version, other objects by identity and size)."""
    if isinstance(value, _SCALARS):
        return ("value", value)
    if isinstance(value, tuple) and all(isinstance(item, _SCALARS) for item in value):
        return ("value", value)
    version = tensor_version(value) if hasattr(value, "data_ptr") and hasattr(type(value), "_version") else None
    try:
        size = len(value) if not hasattr(value, "data_ptr") else None
    except Exception:
        size = None
    return ("object", id(value), version, size)


def snapshot(module: Any) -> dict[tuple[str, str, str], Hashable]:
    """``{(submodule path, group, attribute): token}`` over the whole module tree: its parameters,
    buffers and submodules (group ``_parameters``...), and every other attribute of each (group "")."""
    state: dict[tuple[str, str, str], Hashable] = {}
    for path, sub in module.named_modules(remove_duplicate=True):
        attributes = vars(sub)
        for name, value in attributes.items():
            if name not in _TREE:
                state[(path, "", name)] = _token(value)
        for group in _TREE:
            for name, value in (attributes.get(group) or {}).items():
                state[(path, group, name)] = _token(value)
    return state


def changed(module: Any, before: dict[tuple[str, str, str], Hashable]) -> list[str]:
    """The attributes (``path.name``, buffers and parameters by name) that differ from ``before``
    (added, removed, rebound or changed in place), in order, at most three."""
    after = snapshot(module)
    names = []
    for key in [*before, *(key for key in after if key not in before)]:
        if before.get(key) != after.get(key):
            path, _, name = key
            names.append(f"{path}.{name}" if path else name)
            if len(names) == 3:
                break
    return names
