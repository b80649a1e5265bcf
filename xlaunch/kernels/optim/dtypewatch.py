"""A process-wide generation number that changes whenever a watched module's parameters may have
changed dtype, so that :class:`~xlaunch.kernels.optim.splitstate.LowWeights` tests one number per
forward instead of scanning every parameter.

What bumps it: ``_apply`` of a watched module or any module under it (``.float()``, ``.to()``,
``.half()``, ``.bfloat16()``, ``.double()``, ``.type()``: each module gets an :class:`ApplyWatch` as
its instance ``_apply``), and torch's global registration hooks for parameters and modules (a
parameter or module assigned, ``load_state_dict(assign=True)``). Not seen: a tensor's ``.data``
replaced by hand with another dtype (``p.data = p.data.bfloat16()``).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    from torch import nn
    from torch.nn.modules import module as _module

_COUNTER = itertools.count(1)
generation = 0   # read as ``dtypewatch.generation``; compared for equality only
_hooked = False
_hook_lock = threading.Lock()


def bump(*_: Any) -> None:
    """A new generation (also torch's registration-hook signature; returns None: nothing replaced)."""
    global generation
    generation = next(_COUNTER)


class ApplyWatch:
    """A module's instance ``_apply``: its class's ``_apply`` (or the one set before), then :func:`bump`.
    Copies and pickles of the module carry it (it refers to the module it is set on)."""

    def __init__(self, module: nn.Module, inner: Any = None) -> None:
        self.module = module
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            return type(self.module)._apply(self.module, *args, **kwargs)
        finally:
            bump()


def watch(model: nn.Module) -> None:
    """Watch ``model`` and every module under it (idempotent; modules assigned since are added)."""
    global _hooked
    if not _hooked:
        with _hook_lock:
            if not _hooked:
                _module.register_module_parameter_registration_hook(bump)
                _module.register_module_module_registration_hook(bump)
                _hooked = True
    for module in model.modules():
        current = module.__dict__.get("_apply")
        if not isinstance(current, ApplyWatch) or current.module is not module:
            inner = current if current is not None and not isinstance(current, ApplyWatch) else None
            module.__dict__["_apply"] = ApplyWatch(module, inner)
