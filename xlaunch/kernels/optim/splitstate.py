"""What a model with split-bf16 parameters needs: checkpoints of fp32 masters, a bf16 forward.

After ``to_fused(optimizer, model, dtype=torch.bfloat16)`` (or ``optimize(model, optimizer,
dtype=torch.bfloat16)``) a trained parameter is the bf16 high half of its fp32 master; the low
half lives in the optimizer state (:mod:`splitbf16`). The hooks of :class:`SplitMasters`,
registered on the model, make ``model.state_dict()`` give the joined fp32 master and make
``model.load_state_dict`` of an fp32 checkpoint set both halves, so saving and loading round-trip
bit for bit and a checkpoint from (or for) the plain fp32 model works (as ipex's do). Several
optimizers may train one model (each its own parameters); they are held by weak references: once
they are gone, the model saves and loads its bf16 tensors as they are.
A copy of the model (``copy.deepcopy``, pickle) keeps the low halves of its split parameters as they
were, so its ``state_dict`` is the masters at the time of the copy; copied together with the
optimizer, the copy's low halves are the copied optimizer's (training the pair keeps them current).

:class:`Bf16Forward` runs the model's forward under bf16 autocast and gives floating outputs back
in fp32, so the training loop written for the fp32 model (fp32 inputs, targets, loss) runs as is.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn
    from torch.utils.weak import WeakIdKeyDictionary

from xlaunch.kernels.optim import dtypewatch
from xlaunch.kernels.optim.splitbf16 import TRAIL_DTYPE, join, split

_LOW = (torch.bfloat16, torch.float16)
TRAIL_KEY = "bf16_trail"   # the optimizer-state entry holding a split parameter's low half

# {parameter: {TRAIL_KEY: low half}} of frozen parameters split-bf16 made bf16 (in no optimizer): the
# model's checkpoint hooks save their fp32 values, and a fused optimizer given them later takes them over
frozen_halves = WeakIdKeyDictionary()


def adopt_frozen(optimizer: torch.optim.Optimizer, params: list) -> int:
    """Give ``optimizer`` the low halves of ``params`` made bf16 while frozen (:data:`frozen_halves`;
    the same tensors, which its steps update in place, so the model's hooks find them there too):
    they train on from their exact fp32 masters. Returns how many."""
    adopted = 0
    for param in params:
        entry = frozen_halves.get(param)
        if entry and param.dtype == torch.bfloat16 and TRAIL_KEY not in optimizer.state.get(param, {}):
            optimizer.state[param][TRAIL_KEY] = entry[TRAIL_KEY]
            adopted += 1
    return adopted


def unsplit(param: nn.Parameter, state: dict) -> None:
    """``param``, a split parameter the model has widened since (``model.float()``, ``.double()``: its
    values still the bf16 half), becomes a plain parameter holding its master, the exact join of
    that half and the low half; the low half leaves ``state``. Cast to anything else (``.half()``),
    it keeps its new value."""
    trail = state.pop(TRAIL_KEY)
    if param.dtype in (torch.float32, torch.float64) and param.shape == trail.shape:
        high = param.detach().to(torch.bfloat16)
        if torch.equal(high.to(param.dtype), param.detach()):
            param.data.copy_(join(high, trail))


def unsplit_widened(optimizer: torch.optim.Optimizer) -> None:
    """:func:`unsplit` every split parameter of ``optimizer`` that is no longer bf16."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and TRAIL_KEY in state and param.dtype != torch.bfloat16:
                unsplit(param, state)


class SplitMasters:
    """``state_dict`` hook and ``load_state_dict`` pre-hook for split-bf16 parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.link(model, optimizer)

    def link(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Take the low halves from ``optimizer``'s state too, before those of the optimizers linked
        earlier (two optimizers may train one model, each its own parameters)."""
        live = [ref for ref in getattr(self, "_optimizers", []) if ref() not in (None, optimizer)]
        self._optimizers: list[Callable[[], Optional[torch.optim.Optimizer]]] = [*live, weakref.ref(optimizer)]
        self._model: Callable[[], Optional[nn.Module]] = weakref.ref(model)
        # a copy's {parameter: {TRAIL_KEY: its low half}}, less those ``optimizer`` took over
        kept = getattr(self, "_kept", {})
        self._kept: dict = {p: s for p, s in kept.items() if TRAIL_KEY not in optimizer.state.get(p, {})}
        # every name, a tied parameter's aliases too: each is a key of the model's state_dict
        self.names = [name for name, _ in model.named_parameters(remove_duplicate=False)]

    def _states(self) -> list[dict]:
        """The states holding low halves: the live optimizers', the latest linked first, a copy's, the
        frozen parameters'."""
        live = [optimizer for optimizer in (ref() for ref in reversed(self._optimizers)) if optimizer is not None]
        return [optimizer.state for optimizer in live] + [s for s in (self._kept, frozen_halves) if s]

    def _split_params(self, module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter, dict]]:
        states = self._states()
        found = []
        for name in self.names if states else ():
            try:
                param = module.get_parameter(name)
            except AttributeError:
                continue
            state = next((s[param] for s in states if param in s and TRAIL_KEY in s[param]), None)
            if state is not None:
                if param.dtype != torch.bfloat16:   # widened by the model since: its master now
                    unsplit(param, state)
                    continue
                found.append((prefix + name, param, state))
        return found

    def save(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for key, param, state in self._split_params(module, prefix):
            if key in state_dict:
                state_dict[key] = join(param.detach(), state[TRAIL_KEY])

    def load(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
             missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        found = []
        for key, param, state in self._split_params(module, prefix):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape:
                found.append((key, param, state, value))   # else torch's own load says what is wrong
        # a tied parameter's keys all load into it: its master is the first wider-than-bf16 value
        masters: dict[int, torch.Tensor] = {}
        for _, param, _, value in found:
            if value.dtype != torch.bfloat16:
                masters.setdefault(id(param), value)
        for key, param, state, value in found:
            master = masters.get(id(param))
            if master is None:   # a bf16 checkpoint: the master is that value exactly
                state[TRAIL_KEY].zero_()
                continue
            top, trail = split(master.detach().float().contiguous())
            state[TRAIL_KEY].copy_(trail)
            state_dict[key] = top

    def __getstate__(self) -> dict:
        """The low halves of the model's split parameters, keyed by parameter: copied (or pickled)
        with the model, the memo makes the keys the copy's parameters and, when the optimizer is
        copied in the same call, the low halves the copied optimizer's own."""
        model = self._model()
        kept = self._kept if model is None else {
            param: {TRAIL_KEY: state[TRAIL_KEY]} for _, param, state in self._split_params(model, "")}
        # the frozen ones: a fused optimizer given the copy's, once unfrozen, takes them over (adopt_frozen)
        return {"names": self.names, "kept": kept, "frozen": [param for param in kept if param in frozen_halves]}

    def __setstate__(self, state: dict) -> None:
        self.names = state["names"]
        self._kept = state.get("kept", {})
        self._optimizers, self._model = [], lambda: None
        for param in state.get("frozen", ()):
            frozen_halves.setdefault(param, self._kept[param])


def _hooks_of(model: nn.Module) -> Optional[SplitMasters]:
    for hook in model._state_dict_hooks.values():
        if isinstance(getattr(hook, "__self__", None), SplitMasters):
            return hook.__self__
    return None


def known_low_halves(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(parameter)``: the low half ``model``'s checkpoint hooks join it with (from its
    optimizer, or kept by a copy), for a model made split-bf16 before."""
    hooks = _hooks_of(model)
    found = hooks._split_params(model, "") if hooks is not None else []
    return {id(p): state[TRAIL_KEY] for _, p, state in found if p.dtype == torch.bfloat16}


def widen_known(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """The parameters of ``optimizer`` that ``model`` made split-bf16 before (their low halves known to
    its hooks, held by another optimizer or a copy) become their exact fp32 masters: an optimizer
    converted without ``dtype=torch.bfloat16`` trains them on in fp32 from there (in bf16 it would
    drop their low halves, and the model's checkpoints join stale ones). Returns how many."""
    known = known_low_halves(model)
    widened = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in known and TRAIL_KEY not in optimizer.state.get(param, {}):
                param.data, param.grad = join(param.detach(), known[id(param)]), None
                state = optimizer.state.get(param, {})
                for key, value in list(state.items()):   # made from the bf16 parameter (Adagrad's "sum")
                    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                        state[key] = value.float()
                widened += 1
    if widened:
        dtypewatch.bump()
        unsplit_model(model)   # their low halves leave the states holding them
    return widened


def register(model: nn.Module, optimizer: torch.optim.Optimizer) -> SplitMasters:
    """The checkpoint hooks of ``model``, taking the low halves from ``optimizer`` (the model's
    hooks, if it has them, are linked to it: two would undo each other's load)."""
    hooks = _hooks_of(model)
    if hooks is not None:
        hooks.link(model, optimizer)
        return hooks
    hooks = SplitMasters(model, optimizer)
    model._register_state_dict_hook(hooks.save)
    model.register_load_state_dict_pre_hook(hooks.load)
    return hooks


def _floats_to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_floats_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [_floats_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: _floats_to_fp32(v) for k, v in value.items()}
    return value


def unsplit_model(model: nn.Module) -> None:
    """:func:`unsplit` every split parameter of ``model`` that is no longer bf16 (``model.float()``)."""
    hooks = _hooks_of(model)
    if hooks is not None:
        hooks._split_params(model, "")


class LowWeights:
    """Whether a forward that runs under bf16/fp16 autocast because its module's weights were made
    bf16 (split-bf16 training, bf16 inference weights) still should: while one parameter is bf16 or
    fp16. Once none is (``model.float()``, ``.double()``), split parameters become their exact
    masters first, and the forward runs in the parameters' own precision, as the plain model.

    O(1) per call: it keeps one low parameter (the witness) and the :mod:`.dtypewatch` generation of
    its last scan, and scans again only when the witness is no longer low or a module's dtype may
    have changed since (a cast of the model or of any module in it, a parameter or module assigned)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._widened = False
        self._lock = threading.Lock()
        self._witness: Optional[torch.Tensor] = None
        self._seen = -1   # the generation of the last scan (-1: none yet)

    def __call__(self) -> bool:
        if self._seen == dtypewatch.generation:
            witness = self._witness
            if witness is None:
                return False
            if witness.dtype in _LOW:
                return True
        return self._scan()

    def _scan(self) -> bool:
        with self._lock:
            seen = dtypewatch.generation   # before the scan: a cast during it makes the next call scan again
            dtypewatch.watch(self.module)
            witness = next((p for p in self.module.parameters() if p.dtype in _LOW), None)
            if witness is None and not self._widened:
                unsplit_model(self.module)
            self._widened = witness is None
            self._witness, self._seen = witness, seen
            return witness is not None

    def __getstate__(self) -> dict:
        return {"module": self.module, "_widened": self._widened}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._witness, self._seen = None, -1


class Bf16Forward:
    """The instance ``forward`` of a model whose parameters are split-bf16: its own forward under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``, bf16/fp16 outputs returned as fp32, while its
    parameters are bf16 (:class:`LowWeights`: after ``model.float()`` it runs in fp32). Copies and
    pickles of the model carry it (it refers to the module it is set on)."""

    autocast_dtype = torch.bfloat16

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward")   # an instance forward set before, if any
        self.low_weights = LowWeights(module)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "low_weights" not in state:   # pickled before the precision followed the parameters
            self.low_weights = LowWeights(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.inner or functools.partial(type(self.module).forward, self.module)
        if not self.low_weights():
            return forward(*args, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _floats_to_fp32(forward(*args, **kwargs))


def runs_under_autocast(model: nn.Module) -> bool:
    """Whether ``model``'s forward already enters autocast itself (ours, or optimize()'s)."""
    return getattr(model.__dict__.get("forward"), "autocast_dtype", None) is not None


def prepare_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Checkpoint hooks for ``model``'s split parameters and, unless its forward already runs
    under autocast, a :class:`Bf16Forward`."""
    register(model, optimizer)
    if not runs_under_autocast(model):
        model.forward = Bf16Forward(model)   # type: ignore[method-assign]


def restore_state(optimizer: torch.optim.Optimizer, state_dict: dict, live: list, trails: dict) -> None:
    """After torch's ``Optimizer.load_state_dict`` of a fused optimizer: put split-bf16 storage
    back exactly, and give state tensors their parameter's memory layout.

    ``live`` lists the optimizer's parameters in group order, ``trails`` maps each parameter that
    was split before the load to its low half then. The optimizer's own storage decides, not the
    checkpoint's: a split parameter gets the checkpoint's fp32 state (torch cast it to bf16) and
    the checkpoint's low half (torch cast that int16 to bf16 too), or, from a checkpoint of an fp32
    run (no low half), keeps its current low half, which ``model.load_state_dict`` of the fp32
    masters sets. A parameter that is not split drops a checkpoint's low half. The fused kernels
    walk a parameter and its state in memory order, so a momentum saved from a contiguous model
    and loaded for a channels-last one is re-laid (it would be applied to the wrong elements)."""
    saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    for param, pid in zip(live, saved_ids):
        state = optimizer.state.get(param)
        current = trails.get(param)
        if current is None:
            if state is not None:
                state.pop(TRAIL_KEY, None)
                match_layout(param, state)
            continue
        saved = state_dict["state"].get(pid, {})
        state = optimizer.state[param]
        for key, value in saved.items():
            if key not in ("step", TRAIL_KEY) and isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.to(dtype=torch.float32, device=param.device, copy=True)
        trail = saved.get(TRAIL_KEY)
        if trail is not None and not _carried(trail):   # into the current one (a model's copy may share it)
            current.copy_(trail)
        state[TRAIL_KEY] = current
        match_layout(param, state)


def _carried(trail: Any) -> bool:
    """A low half a plain torch optimizer carried on: its load cast the int16 to its fp32 (or fp64)
    parameter's dtype, and it is stale once that run stepped. Not used (the current low half is
    kept, as for a checkpoint without one): the model's checkpoint holds the fp32 master."""
    return isinstance(trail, torch.Tensor) and trail.dtype in (torch.float32, torch.float64)


def check_trails(state_dict: dict, live: list, trails: dict) -> None:
    """Before loading: refuse a checkpoint whose low half of a split parameter is not its int16
    tensor (e.g. one cast to bf16 on its way into the checkpoint: those low bits are gone)."""
    saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    for number, (param, pid) in enumerate(zip(live, saved_ids)):
        trail = state_dict["state"].get(pid, {}).get(TRAIL_KEY)
        if param not in trails or trail is None or _carried(trail):
            continue
        if not isinstance(trail, torch.Tensor) or trail.dtype != TRAIL_DTYPE or trail.shape != param.shape:
            what = f"{trail.dtype} {tuple(trail.shape)}" if isinstance(trail, torch.Tensor) else type(trail).__name__
            raise ValueError(f"load_state_dict: parameter {number}'s {TRAIL_KEY} is {what}, not int16 "
                             f"{tuple(param.shape)}: the low half of its fp32 master is lost in this checkpoint")


def match_layout(param: torch.Tensor, state: dict) -> None:
    """Give ``param``'s state tensors its memory layout (torch's fused kernels pair them in memory
    order). Not the low half: the split functions pair it in any layout, and a model's copy may share it."""
    for key, value in list(state.items()):
        if key != TRAIL_KEY and isinstance(value, torch.Tensor) and value.shape == param.shape \
                and value.stride() != param.stride():
            state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def _bare(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.keys() == {TRAIL_KEY}


def without_bare_trails(state_dict: dict) -> dict:
    """An optimizer's ``state_dict`` without the entries holding only a low half (a split parameter
    not stepped yet, or frozen): torch's Adam cannot load those (it wants a ``step`` in each), and
    the model's ``state_dict`` carries that half in the parameter's fp32 master."""
    if not any(_bare(entry) for entry in state_dict["state"].values()):
        return state_dict
    kept = {pid: entry for pid, entry in state_dict["state"].items() if not _bare(entry)}
    return dict(state_dict, state=kept)


def set_aside_bare_trails(state: dict) -> tuple[dict, dict]:
    """An optimizer's pickled ``state`` without its low-half-only entries, and those entries."""
    entries = state.get("state")
    if not isinstance(entries, dict) or not any(_bare(entry) for entry in entries.values()):
        return state, {}
    bare = {key: entry for key, entry in entries.items() if _bare(entry)}
    kept: defaultdict = defaultdict(dict, ((key, entry) for key, entry in entries.items() if not _bare(entry)))
    return dict(state, state=kept), bare
