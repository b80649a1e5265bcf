"""Checkpoints of a split-bf16 trained model hold fp32 masters (as ipex's do).

After ``optimize(model, optimizer, dtype=torch.bfloat16)`` a trained parameter is the bf16 high
half of its fp32 master; the low half lives in the optimizer state (:mod:`splitbf16`). These
hooks, registered on the model, make ``model.state_dict()`` give the joined fp32 master and make
``model.load_state_dict`` of an fp32 checkpoint set both halves, so saving and loading round-trip
bit for bit and a checkpoint from (or for) the plain fp32 model works. The optimizer is held by
a weak reference: once it is gone, the model saves and loads its bf16 tensors as they are.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optim.splitbf16 import join, split


class SplitMasters:
    """``state_dict`` hook and ``load_state_dict`` pre-hook for split-bf16 parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.names = [name for name, _ in model.named_parameters()]

    def _split_params(self, module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter, dict]]:
        optimizer: Optional[torch.optim.Optimizer] = self._optimizer()
        if optimizer is None:
            return []
        from xlaunch.kernels.optim.fused import TRAIL_KEY

        found = []
        for name in self.names:
            try:
                param = module.get_parameter(name)
            except AttributeError:
                continue
            state = optimizer.state.get(param)
            if state is not None and TRAIL_KEY in state:
                found.append((prefix + name, param, state))
        return found

    def save(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        from xlaunch.kernels.optim.fused import TRAIL_KEY

        for key, param, state in self._split_params(module, prefix):
            if key in state_dict:
                state_dict[key] = join(param.detach(), state[TRAIL_KEY])

    def load(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
             missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        from xlaunch.kernels.optim.fused import TRAIL_KEY

        for key, param, state in self._split_params(module, prefix):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.shape == param.shape:
                top, trail = split(value.detach().contiguous())
                state[TRAIL_KEY].copy_(trail)
                state_dict[key] = top

    def __getstate__(self) -> dict:
        return {"names": self.names, "_optimizer": None}

    def __setstate__(self, state: dict) -> None:
        self.names = state["names"]
        self._optimizer = lambda: None


def register(model: nn.Module, optimizer: torch.optim.Optimizer) -> SplitMasters:
    hooks = SplitMasters(model, optimizer)
    model._register_state_dict_hook(hooks.save)
    model.register_load_state_dict_pre_hook(hooks.load)
    return hooks
