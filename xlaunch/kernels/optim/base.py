"""The step machinery the fused optimizers share (:class:`_FusedBase`): the fp32 view of a param
group (split-bf16 parameters joined into their masters and split again), the fast-path test, the
fallback onto torch's own ``step``, and ``state_dict``/``load_state_dict`` for split storage."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor

from xlaunch.kernels.optim import splitstate
from xlaunch.kernels.optim.splitbf16 import _dense, join_into, split_into
from xlaunch.kernels.optim.splitstate import TRAIL_KEY

Closure = Callable[[], Any]


class _StepTensors:
    """The fp32 view of one param group for one step, grouped by dtype.

    Plain parameters are used as they are; split-bf16 parameters are joined into fp32 temporaries
    (with fp32 gradients) and written back by :meth:`write_back`.
    """

    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, list[tuple[Tensor, Tensor, Tensor]]] = {}
        self._split: list[tuple[Tensor, Tensor, Tensor]] = []

    def add(self, param: Tensor, state: dict) -> None:
        if param.dim() > 2:   # made channels-last (or back) since its state was created
            splitstate.match_layout(param, state)
        trail, grad = state.get(TRAIL_KEY), param.grad
        if trail is None:
            master = param
        else:
            master = torch.empty_like(param, dtype=torch.float32)
            join_into(param, trail, master)
            self._split.append((param, trail, master))
            for key, value in state.items():   # made for the bf16 parameter (Adagrad's eager "sum")
                if key != TRAIL_KEY and isinstance(value, Tensor) and value.dtype == param.dtype:
                    state[key] = value.float()
        if trail is not None or grad.stride() != master.stride():
            # torch's kernels pair a parameter and its gradient in memory order: a gradient set by
            # hand in another layout (a transposed copy) takes its parameter's
            grad = torch.empty_like(master, dtype=master.dtype if trail is not None else grad.dtype).copy_(grad)
        self.by_dtype.setdefault(master.dtype, []).append((param, master, grad))

    def write_back(self) -> None:
        for param, trail, master in self._split:
            split_into(master, param, trail)


def _fast_path_ok(group: dict, params: Iterable[Tensor], memory_order: bool = True) -> bool:
    """Whether torch's fused kernels serve ``group``. ``memory_order``: they walk each parameter and its
    state in memory order, wrong for a parameter with gaps (a slice ``w[:, :k]``, ``w[:, ::2]``: torch's
    own ``fused=True`` updates the wrong elements there), which takes torch's ``step`` instead."""
    if group.get("differentiable") or group.get("capturable") or isinstance(group["lr"], Tensor):
        return False
    for p in params:
        if p.grad is not None and (p.grad.is_sparse or p.is_complex() or p.device.type != "cpu"
                                   or (memory_order and not p.is_contiguous() and not _dense(p))):
            return False
    return True


class _FusedBase:
    """Shared step machinery; mixed into subclasses of torch optimizers."""

    state: Any
    param_groups: list

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """False, even with ``fused=True`` (where torch sets it): ``GradScaler`` then unscales the
        gradients and skips a step with inf/NaN itself; ours reads no ``grad_scale``/``found_inf``."""
        return False

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        pass   # torch's constructor sets True for fused=True

    _kernels_pair_memory = True   # torch's fused kernels (see _fast_path_ok); not Lamb's foreach ops

    def _group_step(self, group: dict, tensors: _StepTensors) -> None:  # pragma: no cover
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:
        """Perform one optimization step (see the class docstring of the torch original)."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        splitstate.unsplit_widened(self)   # model.float() since: those train on as fp32 masters
        for group in self.param_groups:
            params = group["params"]
            if not _fast_path_ok(group, params, self._kernels_pair_memory):
                self._fallback_group_step(group)
                continue
            tensors = _StepTensors()
            for p in params:
                if p.grad is not None:
                    tensors.add(p, self.state[p])
            if tensors.by_dtype:
                self._group_step(group, tensors)
                tensors.write_back()
        return loss

    def add_param_group(self, param_group: dict) -> None:
        """torch's; a parameter split-bf16 made bf16 while frozen takes back its fp32 master."""
        super().add_param_group(param_group)  # type: ignore[misc]
        splitstate.adopt_frozen(self, self.param_groups[-1]["params"])

    def _fallback_group_step(self, group: dict) -> None:
        """Run torch's own ``step`` for ``group`` with split parameters swapped to fp32."""
        swapped = []
        for p in group["params"]:
            if p.grad is not None and TRAIL_KEY in self.state.get(p, {}):
                bf16_data, bf16_grad = p.data, p.grad
                trail = self.state[p].pop(TRAIL_KEY)   # torch's step sees its own state only
                master = torch.empty_like(bf16_data, dtype=torch.float32)
                join_into(bf16_data, trail, master)
                p.data, p.grad = master, bf16_grad.float()
                swapped.append((p, trail, bf16_data, bf16_grad))
        saved_groups = self.param_groups
        try:
            self.param_groups = [group]
            torch_step = super().step  # type: ignore[misc]
            if getattr(torch_step, "hooked", False):   # torch's wrapper that runs the step hooks: ours ran them
                torch_step.__wrapped__(self)
            else:
                torch_step()
        finally:
            self.param_groups = saved_groups
            for p, trail, bf16_data, bf16_grad in swapped:
                split_into(p.data, bf16_data, trail)
                p.data, p.grad = bf16_data, bf16_grad
                self.state[p][TRAIL_KEY] = trail

    def state_dict(self) -> dict:
        """torch's, less the entries holding only a low half (:func:`splitstate.without_bare_trails`)."""
        splitstate.unsplit_widened(self)
        return splitstate.without_bare_trails(super().state_dict())  # type: ignore[misc]

    def __setstate__(self, state: dict) -> None:
        """torch's, with low-half-only entries set aside (torch's Adam wants a ``step`` in each)."""
        state, bare = splitstate.set_aside_bare_trails(state)
        super().__setstate__(state)  # type: ignore[misc]
        self.state.update(bare)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping split-bf16 storage exact: fp32 state, the int16 low half restored bit
        for bit (torch would cast both to bf16); see :func:`splitstate.restore_state`."""
        splitstate.unsplit_widened(self)
        live = [p for g in self.param_groups for p in g["params"]]
        trails = {p: self.state[p][TRAIL_KEY] for p in live if p in self.state and TRAIL_KEY in self.state[p]}
        splitstate.check_trails(state_dict, live, trails)
        groups = list(self.param_groups)
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for number, (group, loaded) in enumerate(zip(groups, self.param_groups)):
            # torch's load makes new group dicts; keep ours (shared by to_fused with the optimizer it
            # converted, whose LR scheduler would drive dicts no longer used), with the loaded values
            group.clear()
            group.update(loaded)
            self.param_groups[number] = group
        splitstate.restore_state(self, state_dict, live, trails)


def _step_tensor(param: Tensor) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=param.device)


def _adam_moments(state: dict, param: Tensor, master: Tensor) -> bool:
    """Adam's and Lamb's state of ``param`` on its first step (a step count, two moments shaped as its
    fp32 ``master``); True when it was made now."""
    if "exp_avg" in state:
        return False
    state["step"] = _step_tensor(param)
    state["exp_avg"] = torch.zeros_like(master)
    state["exp_avg_sq"] = torch.zeros_like(master)
    return True
