"""Fused optimizers with optional split-bf16 master weights.

``FusedSGD``, ``FusedAdagrad``, ``FusedAdam`` and ``FusedAdamW`` subclass torch's own classes
(same constructor, param groups, state layout and ``state_dict``; ``isinstance`` keeps working) and
replace ``step`` with a lean path onto torch's single-pass CPU kernels (``torch._fused_sgd_``,
``_fused_adagrad_``, ``_fused_adam_``, ``_fused_adamw_``): one read and one write of each
parameter's memory per step, without torch's per-step regrouping overhead. ``FusedLamb`` (:mod:`.lamb`)
has no torch counterpart and uses multi-tensor (``torch._foreach_*``) ops; the shared step
machinery is :mod:`.base`.

Split-bf16: after :func:`to_fused` with ``dtype=torch.bfloat16`` (or :func:`split_params`), every
trained parameter is a bf16 tensor holding the high half of its fp32 master and the optimizer
state keeps the low half (``state[p]["bf16_trail"]``, int16). Each step joins the halves into an
exact fp32 master, runs the fp32 kernel on it with the bf16 gradient widened to fp32, and splits
the result back: the reconstructed master is bit-identical to an fp32 master updated by the same
kernel with the same gradients. Optimizer state (momentum, moments) stays fp32. Options the fast
path does not cover (``differentiable``, tensor ``lr``, ``capturable``, sparse or complex
gradients) fall back to torch's own ``step`` on the joined fp32 masters.
"""
from __future__ import annotations

import inspect
import warnings

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor

from xlaunch.kernels import native_dtypes
from xlaunch.kernels.optim import dtypewatch, splitstate
from xlaunch.kernels.optim.base import _adam_moments, _FusedBase, _StepTensors, _step_tensor
from xlaunch.kernels.optim.lamb import FusedLamb
from xlaunch.kernels.optim.splitbf16 import _dense, join_into, split
from xlaunch.kernels.optim.splitstate import TRAIL_KEY

__all__ = ["FusedSGD", "FusedAdagrad", "FusedAdam", "FusedAdamW", "FusedLamb", "TRAIL_KEY", "to_fused",
           "split_params", "master_params", "is_split"]

class FusedSGD(_FusedBase, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize), fused step."""

    def _group_step(self, group: dict, tensors: _StepTensors) -> None:
        momentum = group["momentum"]
        for entries in tensors.by_dtype.values():
            fresh: tuple[list, list, list, list] = ([], [], [], [])
            running: tuple[list, list, list, list] = ([], [], [], [])
            for param, master, grad in entries:
                state = self.state[param]
                buf = state.get("momentum_buffer")
                if momentum != 0 and buf is None:
                    buf = state["momentum_buffer"] = torch.empty_like(master)
                    target = fresh
                else:
                    target = running
                target[0].append(master)
                target[1].append(grad)
                if momentum != 0:
                    target[2].append(buf)
            for masters, grads, bufs, _ in (fresh, running):
                if masters:
                    torch._fused_sgd_(
                        masters,
                        grads,
                        bufs,
                        weight_decay=group["weight_decay"],
                        momentum=momentum,
                        lr=group["lr"],
                        dampening=group["dampening"],
                        nesterov=group["nesterov"],
                        maximize=group["maximize"],
                        is_first_step=masters is fresh[0],
                    )


class FusedAdagrad(_FusedBase, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` (lr decay, weight decay, maximize), fused step."""

    def _group_step(self, group: dict, tensors: _StepTensors) -> None:
        for entries in tensors.by_dtype.values():
            masters, grads, sums, steps = [], [], [], []
            for param, master, grad in entries:
                state = self.state[param]
                if "sum" not in state:
                    state["sum"] = torch.full_like(master, group["initial_accumulator_value"])
                    state["step"] = _step_tensor(param)
                masters.append(master)
                grads.append(grad)
                sums.append(state["sum"])
                steps.append(state["step"])
            torch._foreach_add_(steps, 1)
            torch._fused_adagrad_(
                masters,
                grads,
                sums,
                steps,
                lr=group["lr"],
                lr_decay=group["lr_decay"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )


class FusedAdam(_FusedBase, torch.optim.Adam):
    """``torch.optim.Adam`` (amsgrad, weight decay, maximize), fused step."""

    def _group_step(self, group: dict, tensors: _StepTensors) -> None:
        amsgrad = group["amsgrad"]
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
        for entries in tensors.by_dtype.values():
            masters, grads, avgs, avg_sqs, max_sqs, steps = [], [], [], [], [], []
            for param, master, grad in entries:
                state = self.state[param]
                if _adam_moments(state, param, master) and amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(master)
                masters.append(master)
                grads.append(grad)
                avgs.append(state["exp_avg"])
                avg_sqs.append(state["exp_avg_sq"])
                if amsgrad:
                    max_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            torch._foreach_add_(steps, 1)
            kernel(
                masters,
                grads,
                avgs,
                avg_sqs,
                max_sqs,
                steps,
                amsgrad=amsgrad,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )


class FusedAdamW(FusedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay), fused step."""

_FUSED_FOR: dict[type, type] = {
    torch.optim.SGD: FusedSGD,
    torch.optim.Adagrad: FusedAdagrad,
    torch.optim.Adam: FusedAdam,
    torch.optim.AdamW: FusedAdamW,
}


def is_split(optimizer: torch.optim.Optimizer, param: Tensor) -> bool:
    """True when ``param`` is stored as split-bf16 by ``optimizer``."""
    return param in optimizer.state and TRAIL_KEY in optimizer.state[param]


def _fused_twin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    cls = _FUSED_FOR[type(optimizer)]
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    fused = cls([dict(group) for group in optimizer.param_groups], **kwargs)
    if optimizer.state:
        fused.load_state_dict(optimizer.state_dict())
    # the same group dicts: an LR scheduler made on ``optimizer`` (or an lr set by hand there) drives
    # the fused one; the scheduler's "lr_scheduler.step() before optimizer.step()" check is told the
    # steps are taken (by the fused optimizer, not the one it wraps)
    fused.param_groups[:] = optimizer.param_groups
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # type: ignore[attr-defined]
    return fused


def _split_dense(param: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`split` of ``param``'s value, made contiguous first when its memory has gaps (a slice
    ``w[:, :k]``: the halves are stored dense, as torch's kernels need)."""
    data = param.data
    return split(data if data.is_contiguous() or _dense(data) else data.contiguous())


def split_params(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> int:
    """Store ``optimizer``'s float32 parameters as split-bf16, in place; return how many.

    Each parameter's ``.data`` becomes its bf16 high half (the same ``Parameter`` object, so the
    model and optimizer keep their references) and the low half goes to the optimizer state.
    Existing gradients are dropped (they have the old dtype). A bf16 parameter of a ``model`` split
    before takes a copy of the low half its hooks know. ``model``'s frozen (``requires_grad=False``)
    float32 parameters are split too, their low halves kept aside (:data:`splitstate.frozen_halves`:
    saved as fp32, taken over by a fused optimizer given them once unfrozen); its other trainable
    ones stay fp32 (another optimizer may train them, split or not: a cast would round them); its
    BatchNorm parameters, trained or not, stay fp32 (batch_norm takes bf16 inputs with fp32
    parameters, not bf16 ones; ipex too), as do buffers. Returns how many parameters were split."""
    if not isinstance(optimizer, _FusedBase):
        raise TypeError("split-bf16 parameters need a fused optimizer (see to_fused)")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"split_params: model must be a torch.nn.Module or None, not {type(model).__name__}")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)] if model else []
    keep = {id(p) for norm in norms for p in norm.parameters(recurse=False)}
    converted = splitstate.adopt_frozen(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
    known = splitstate.known_low_halves(model) if model is not None else {}
    trained = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            trained.add(p)
            if id(p) in known and not is_split(optimizer, p):   # split by another optimizer before
                optimizer.state[p][TRAIL_KEY], converted = known[id(p)].clone(), converted + 1
            if p.dtype != torch.float32 or is_split(optimizer, p) or id(p) in keep:
                continue
            top, trail = _split_dense(p)
            p.data, p.grad = top, None
            optimizer.state[p][TRAIL_KEY] = trail
            converted += 1
    for p in model.parameters() if model is not None else ():   # trainable ones: another optimizer's
        if p not in trained and p.dtype == torch.float32 and id(p) not in keep and not p.requires_grad:
            top, trail = _split_dense(p)
            p.data, p.grad = top, None
            splitstate.frozen_halves[p] = {TRAIL_KEY: trail}
            converted += 1
    dtypewatch.bump()   # ``.data`` made bf16: a forward following the weights' dtype looks again
    return converted


def _low_but_unsplit(optimizer: torch.optim.Optimizer) -> str:
    """'N of the optimizer's parameters are already bfloat16' for the bf16/fp16 parameters of
    ``optimizer`` that are not split (a model cast before ``to_fused``), or ''."""
    low: dict[str, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.dtype in (torch.bfloat16, torch.float16) and not is_split(optimizer, p):
                name = str(p.dtype).replace("torch.", "")
                low[name] = low.get(name, 0) + 1
    if not low:
        return ""
    total = sum(low.values())
    return f"{total} of the optimizer's parameters {'are' if total > 1 else 'is'} already " + \
        " and ".join(f"{n} {name}" if len(low) > 1 else name for name, n in low.items())


def master_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """fp32 copies of every parameter's master value (joined halves for split parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"master_params: optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    splitstate.unsplit_widened(optimizer)
    masters = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_split(optimizer, p):
                master = torch.empty_like(p.data, dtype=torch.float32)
                join_into(p.data, optimizer.state[p][TRAIL_KEY], master)
                masters.append(master)
            else:
                masters.append(p.detach().clone())
    return masters


def to_fused(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
             dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
    """The fused equivalent of a torch SGD/Adagrad/Adam/AdamW ``optimizer``.

    Same param groups, hyperparameters and state. With ``dtype=torch.bfloat16`` the trained
    float32 parameters become split-bf16 (see :func:`split_params`; ``model``'s frozen ones too,
    its other trainable ones stay fp32), and ``model`` is made ready for them (:mod:`.splitstate`): its
    forward runs under bf16 autocast with fp32 outputs, so the fp32 training loop runs as written,
    and its ``state_dict`` holds the fp32 masters. Where the CPU only emulates bf16 (no
    AVX512_BF16/AMX_BF16) that is said in an ``EmulatedPrecisionWarning``. The state tensors are
    shared with ``optimizer``, which should not be stepped again. An optimizer of another type is
    returned unchanged with a warning (and no parameter is converted). Without ``dtype=torch.bfloat16``,
    the parameters ``model`` made split-bf16 before (with another optimizer) become their exact fp32
    masters (:func:`splitstate.widen_known`). A fused optimizer is
    returned as is (converted when ``dtype`` asks for it). The fused twin shares ``optimizer``'s
    param group dicts: an LR scheduler made on ``optimizer`` before drives it.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"to_fused: optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"to_fused: model must be a torch.nn.Module or None, not {type(model).__name__}")
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"to_fused: dtype must be None, float32 or bfloat16, not {dtype}")
    if isinstance(optimizer, _FusedBase):
        fused = optimizer
    elif type(optimizer) in _FUSED_FOR:
        fused = _fused_twin(optimizer)
    else:
        warnings.warn(f"xlaunch.kernels: no fused version of {type(optimizer).__name__}; left unchanged",
                      stacklevel=2)
        return optimizer
    if dtype != torch.bfloat16 and model is not None:
        splitstate.widen_known(fused, model)   # a split model's parameters: their fp32 masters
    if dtype == torch.bfloat16:
        reason = native_dtypes.bf16_unsupported_reason(native_dtypes.isa_flags())
        if reason is not None:
            warnings.warn(f"xlaunch.kernels: to_fused(dtype=torch.bfloat16): {reason} (dtype=None "
                          "trains in fp32)", native_dtypes.EmulatedPrecisionWarning, stacklevel=2)
        split_now = split_params(fused, model)
        unsplit = _low_but_unsplit(fused)
        if unsplit:
            warnings.warn(f"xlaunch.kernels: to_fused(dtype=torch.bfloat16): {unsplit}: trained in that "
                          "precision, without fp32 master weights (each update rounded to it); give the fp32 "
                          "model (before .bfloat16()/.half()) to train them as split-bf16", stacklevel=2)
        if split_now and model is not None:
            splitstate.prepare_model(model, fused)
        elif model is None:
            warnings.warn("xlaunch.kernels: to_fused(dtype=torch.bfloat16) without the model: its "
                          "parameters are bf16 now, so run its forward under torch.autocast('cpu', "
                          "dtype=torch.bfloat16), or pass the model (to_fused(optimizer, model, "
                          "dtype=...)) to have that done", stacklevel=2)
    return fused
