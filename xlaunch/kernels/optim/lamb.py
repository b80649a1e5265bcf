"""``FusedLamb``: LAMB on ``torch._foreach_*`` ops (no torch counterpart), split-bf16 capable."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.kernels.optim.base import _adam_moments, _FusedBase, _StepTensors


def _check_number(name: str, value: Any, rule: str, ok: Callable[[float], bool]) -> None:
    """One line naming ``name`` unless ``value`` is a real number (not a tensor) that is ``ok``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):   # numpy scalars too, not tensors
        raise TypeError(f"FusedLamb: {name} must be a float, not {type(value).__name__}")
    if not ok(value):   # NaN too
        raise ValueError(f"FusedLamb: {name} {rule}, got {value}")


class FusedLamb(_FusedBase, torch.optim.Optimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

    Per parameter: Adam moments with optional bias correction, update
    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``, layer-wise trust ratio
    ``||w|| / ||u||`` (1 when either norm is 0, clipped to ``max_trust_ratio`` if given), then
    ``w -= lr * trust * u``.
    """

    _kernels_pair_memory = False   # foreach ops pair tensors element by element: a strided slice is fine

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        max_trust_ratio: float | None = None,
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            _check_number(name, value, "must be >= 0", lambda v: v >= 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"FusedLamb: betas must be a pair of floats, not {betas!r}")
        for value in betas:
            _check_number("betas", value, "must be in [0, 1)", lambda v: 0.0 <= v < 1.0)
        if not isinstance(bias_correction, bool):
            raise TypeError(f"FusedLamb: bias_correction must be True or False, not {bias_correction!r}")
        if max_trust_ratio is not None:
            _check_number("max_trust_ratio", max_trust_ratio, "must be > 0 (or None)", lambda v: v > 0.0)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    def _group_step(self, group: dict, tensors: _StepTensors) -> None:
        beta1, beta2 = group["betas"]
        for entries in tensors.by_dtype.values():
            masters, grads, avgs, avg_sqs, step_counts = [], [], [], [], []
            for param, master, grad in entries:
                state = self.state[param]
                _adam_moments(state, param, master)
                state["step"] += 1
                masters.append(master)
                grads.append(grad)
                avgs.append(state["exp_avg"])
                avg_sqs.append(state["exp_avg_sq"])
                step_counts.append(int(state["step"].item()))
            torch._foreach_lerp_(avgs, grads, 1.0 - beta1)
            torch._foreach_mul_(avg_sqs, beta2)
            torch._foreach_addcmul_(avg_sqs, grads, grads, value=1.0 - beta2)
            if group["bias_correction"]:
                corr1 = [1.0 - beta1**n for n in step_counts]
                corr2 = [math.sqrt(1.0 - beta2**n) for n in step_counts]
            else:
                corr1 = corr2 = [1.0] * len(step_counts)
            denoms = torch._foreach_sqrt(avg_sqs)
            torch._foreach_div_(denoms, corr2)
            torch._foreach_add_(denoms, group["eps"])
            updates = torch._foreach_div(avgs, corr1)
            torch._foreach_div_(updates, denoms)
            if group["weight_decay"] != 0:
                torch._foreach_add_(updates, masters, alpha=group["weight_decay"])
            weight_norms = torch._foreach_norm(masters)
            update_norms = torch._foreach_norm(updates)
            scales = []
            for w_norm, u_norm in zip(weight_norms, update_norms):
                w, u = float(w_norm), float(u_norm)
                trust = w / u if w > 0.0 and u > 0.0 else 1.0
                if group["max_trust_ratio"] is not None:
                    trust = min(trust, group["max_trust_ratio"])
                scales.append(-group["lr"] * trust)
            torch._foreach_mul_(updates, scales)
            torch._foreach_add_(masters, updates)

    def _fallback_group_step(self, group: dict) -> None:
        raise RuntimeError("FusedLamb: a tensor lr, sparse or complex gradients and tensors off the CPU are not "
                           "supported (dense CPU tensors with a float lr only)")
