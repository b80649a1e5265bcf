"""The forward of an optimized module: eager, or a frozen graph per exact input signature.

``optimize`` returns the user's module (its class, attributes, ``training`` flag, ``state_dict``)
and sets an :class:`OptimizedForward` as the instance's ``forward``. It runs the module's own
forward (under autocast for bf16/fp16), except for calls that a frozen graph can serve exactly:
eval mode, autograd off (``torch.no_grad()`` / ``torch.inference_mode()``), positional tensor or
plain arguments, no tracing, scripting or compiling going on. Those go to a graph frozen for that
exact input signature (shapes, dtypes, layout, plain values; a traced graph is only right for
inputs like the one it was traced with), built on the first such call and checked against the
eager result. When the module's parameters or buffers change (``load_state_dict``, training, a
``.to()`` that moves their storage) the graphs are dropped and rebuilt on the next call; a
parameter object replaced by hand (``module.weight = nn.Parameter(...)``) is not seen.

``torch.jit.trace(model, x)`` of the module records the eager forward, so tracing and freezing it
yourself keeps working; ``torch.jit.script(model)`` compiles the class's (rewritten) forward on a
shallow copy without the dispatcher (:class:`PrepareScriptable`). ``--auto-optimize`` uses the
same class.
"""
from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch, tensor_version

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optim.splitstate import LowWeights
from xlaunch.kernels.optimize import freeze, measure, precision
from xlaunch.kernels.optimize.compare import BF16_RTOL, FP32_RTOL, dtypes_differ, outputs_close
from xlaunch.kernels.optimize.notes import excerpt

MAX_SIGNATURES = 4
MAX_REBUILDS = 3
Notify = Callable[[str, bool], None]   # (message, is_warning)


def signature(args: tuple, kwargs: Optional[dict] = None) -> Optional[tuple]:
    """What a traced graph depends on: every tensor's shape, dtype, device and layout, and the
    value of every plain argument. None when a call cannot be traced safely (keywords, others)."""
    if kwargs:
        return None
    # a graph records the casts of the autocast it was traced under (the caller's, if any)
    parts: list = [("A", torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append(("T", tuple(arg.shape), arg.dtype, arg.device.type, arg.is_contiguous(),
                          arg.is_contiguous(memory_format=torch.channels_last)))
        elif arg is None or isinstance(arg, (bool, int, float, str)):
            parts.append(("V", type(arg), arg))
        else:
            return None
    return tuple(parts)


def shapes(sig: tuple) -> list:
    return [part[1] for part in sig if part[0] == "T"]


def _default_notify(message: str, is_warning: bool) -> None:
    from xlaunch.kernels.optimize.notes import info, warn

    (warn if is_warning else info)(message)


class OptimizedForward:
    """An instance-level ``forward``: autocast (optional) and frozen graphs per input signature."""

    def __init__(self, module: nn.Module, *, autocast_dtype: Optional[torch.dtype] = None,
                 output_dtype: Optional[torch.dtype] = torch.float32,
                 freeze_backend: Optional[str] = None, verify: bool = True, measure: bool = True,
                 max_signatures: int = MAX_SIGNATURES, notify: Optional[Notify] = None) -> None:
        self.module = module
        earlier = module.__dict__.get("forward")
        self.inner = earlier.inner if isinstance(earlier, OptimizedForward) else earlier
        self.autocast_dtype = autocast_dtype
        self.low_weights: Optional[LowWeights] = None   # set: autocast only while a parameter is low
        self.output_dtype = output_dtype
        self.freeze_backend = freeze_backend   # None: never freeze
        self.verify = verify
        self.measure = measure
        self.max_signatures = max_signatures
        self.notify = notify
        self.frozen: dict[tuple, Optional[Callable]] = {}   # None: eager for that signature
        self.prefer_eager: Optional[bool] = None            # set by the first measurement
        self.timings_ms: dict[str, float] = {}
        self.weights_key: Optional[tuple] = None
        self.rebuilds = 0
        self._building = False   # a graph is being built: calls made by the build run eager
        self._tensors: Optional[list] = None
        self._stateful: frozenset[int] = frozenset()   # ids of the buffers the forward updates
        self._lock = threading.RLock()

    # -- the eager path ------------------------------------------------------------------------
    def eager(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.inner if self.inner is not None else functools.partial(type(self.module).forward, self.module)
        if not self.runs_autocast():
            return forward(*args, **kwargs)
        with torch.autocast("cpu", dtype=self.autocast_dtype):
            out = forward(*args, **kwargs)
        if self.output_dtype is None:
            return out
        dtype = precision.output_dtype(args, kwargs)   # what eager gives in this context
        return out if dtype is None else precision.outputs_as(out, dtype)

    def follow_weights(self) -> None:
        """From now on the autocast is for the module's low-precision weights (which ``optimize``
        made bf16/fp16): it runs while one parameter is bf16/fp16, and ``model.float()`` gives the
        fp32 forward (split-bf16 parameters joined with their low halves first)."""
        self.low_weights = LowWeights(self.module)

    def runs_autocast(self) -> bool:
        """Whether the eager forward runs under ``autocast_dtype`` now."""
        return self.autocast_dtype is not None and (self.low_weights is None or self.low_weights())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.graph_for(args, kwargs)
        if graph is not None:
            return graph(*args)
        return self.eager(*args, **kwargs)

    # -- frozen graphs -------------------------------------------------------------------------
    def _can_freeze_now(self, kwargs: dict) -> bool:
        if self.freeze_backend is None or kwargs or self.module.training or torch.is_grad_enabled():
            return False
        return not (torch.jit.is_tracing() or torch.jit.is_scripting() or torch.compiler.is_compiling())

    def _weights_key(self) -> tuple:
        """Storage, version and dtype of every parameter and buffer (the tensor list is cached;
        ``load_state_dict`` refreshes it, see :class:`RefreshAfterLoad`)."""
        if self._tensors is None:
            self._tensors = list(itertools.chain(self.module.parameters(), self.module.buffers()))
        return tuple((t.data_ptr(), tensor_version(t), t.dtype) for t in self._tensors if id(t) not in self._stateful)

    def refresh(self) -> None:
        """Forget the graphs and the tensor list (parameters may have been replaced)."""
        with self._lock:
            self.frozen, self.weights_key, self._tensors, self._stateful = {}, None, None, frozenset()

    def graph_for(self, args: tuple, kwargs: Optional[dict] = None) -> Optional[Callable]:
        """The frozen graph serving this call (built now if needed), or None for the eager path."""
        if self._building or not self._can_freeze_now(kwargs or {}):
            return None
        sig = signature(args)
        if sig is None:
            return None
        key = self._weights_key()
        if key == self.weights_key and sig in self.frozen:
            return self.frozen[sig]
        with self._lock:
            if key != self.weights_key:
                if self.weights_key is not None:
                    self.rebuilds += 1
                    if self.rebuilds > MAX_REBUILDS:
                        self.freeze_backend, self.frozen = None, {}
                        self._note("its weights keep changing between no-grad calls; frozen graphs "
                                   "are no longer built (eager forward)", True)
                        return None
                    self._note("weights changed since the graphs were frozen; freezing again", False)
                self.frozen, self.weights_key = {}, key
            if sig not in self.frozen:
                if len(self.frozen) >= self.max_signatures:
                    return None
                self._building = True
                state = freeze.BufferState(self.module)
                try:
                    self.frozen[sig] = self._build(sig, args)
                finally:   # the build's runs leave no trace in buffers the forward updates
                    state.restore(self.module)
                    self._building = False
                self.weights_key = self._weights_key()
            return self.frozen[sig]

    def _note(self, message: str, is_warning: bool) -> None:
        (self.notify or _default_notify)(message, is_warning)

    def _build(self, sig: tuple, args: tuple) -> Optional[Callable]:
        backend, inputs = self.freeze_backend, shapes(sig)
        if self.prefer_eager:
            return None
        state = freeze.BufferState(self.module)   # each run below starts from the module's state
        try:   # built, checked and timed on copies: the call being answered gets its own arguments
            graph = freeze.freeze(self.module, backend, freeze.fresh(args))
        except Exception as exc:
            self._note(f"not frozen for inputs {inputs}: {backend} failed: {type(exc).__name__}: "
                       f"{excerpt(exc)}", True)
            return None
        updated = state.changed(self.module)   # running statistics, counters: the forward's own state
        state.restore(self.module)
        if self.verify or updated:
            rtol = BF16_RTOL if self.runs_autocast() else FP32_RTOL
            want = self.eager(*freeze.fresh(args))
            after_eager = freeze.BufferState(self.module)
            state.restore(self.module)
            got = graph(*freeze.fresh(args))
            problem = outputs_close(want, got, rtol) or dtypes_differ(want, got)
            if not problem and updated:
                buffers = dict(self.module.named_buffers(remove_duplicate=False))
                differs = outputs_close([after_eager.saved[name] for name in updated],
                                        [buffers[name] for name in updated], rtol)
                problem = differs and f"the buffers it updates ({', '.join(updated)}): {differs}"
            state.restore(self.module)
            if problem:
                self._note(f"not frozen for inputs {inputs}: the {backend} graph changed results ({problem})", True)
                return None
        if self.measure and self.prefer_eager is None:
            args = freeze.fresh(args)
            timings = measure.interleaved({"eager": lambda: self.eager(*args), "frozen": lambda: graph(*args)})
            state.restore(self.module)
            self.timings_ms = {name: seconds * 1e3 for name, seconds in timings.medians().items()}
            self.prefer_eager = not timings.not_slower("frozen", "eager")
            if self.prefer_eager:
                self._note(f"kept the eager forward: the {backend} graph for inputs {inputs} measured "
                           f"{1 / timings.ratio('frozen', 'eager'):.2f}x the eager speed", False)
                return None
        # the graph updates these buffers as the forward does (they are its state, not its weights)
        names = set(updated)
        self._stateful = frozenset(id(b) for name, b in self.module.named_buffers() if name in names)
        self._note(f"frozen with {backend} for inputs {inputs}", False)
        return graph

    # -- copies ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """Copies and pickles carry the configuration, not the graphs (rebuilt on first use). A copy
        made while a graph is built (freeze's prepacked copy, whose convs and linears hold their
        weights as packed buffers, not parameters) runs under autocast exactly when this one does now."""
        state = dict(self.__dict__)
        if self._building and self.low_weights is not None:
            state.update(low_weights=None, autocast_dtype=self.autocast_dtype if self.runs_autocast() else None)
        state.update(frozen={}, weights_key=None, notify=None, _building=False, _tensors=None, _stateful=frozenset())
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.setdefault("low_weights", None)   # pickled before it existed
        self.__dict__.update(state)
        self._lock = threading.RLock()


def of(module: nn.Module) -> Optional[OptimizedForward]:
    """The module's OptimizedForward, if ``optimize`` installed one."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, OptimizedForward) else None


def restore(module: nn.Module, state: freeze.BufferState) -> None:
    """``module``'s buffers back to ``state``; its frozen graphs stay (they hold the same tensors)."""
    state.restore(module)
    forward = of(module)
    if forward is not None and forward.weights_key is not None:
        forward.weights_key = forward._weights_key()


class RefreshAfterLoad:
    """``load_state_dict`` post-hook: the loaded tensors (copied in, or assigned with
    ``assign=True``) are picked up and the graphs rebuilt on the next call."""

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        forward = of(module)
        if forward is not None:
            forward.refresh()


_INSTANCE_ONLY = ("forward", "__prepare_scriptable__", "train")


class PrepareScriptable:
    """The optimized module's ``__prepare_scriptable__`` (``torch.jit.script`` calls it first): a
    shallow copy without the instance-level forward, so script compiles the class's forward over
    the rewritten submodules and shared parameters. A bf16/fp16 module runs under autocast, which
    script cannot carry: it is refused, naming what works (trace under autocast, torch.compile)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> nn.Module:
        module = self.module
        forward = of(module)
        if forward is not None and forward.runs_autocast():
            raise RuntimeError(
                f"torch.jit.script cannot compile this {type(module).__name__}: optimize() runs it under "
                f"{forward.autocast_dtype} autocast, which a script does not carry; use torch.jit.trace under "
                f"torch.autocast('cpu', dtype={forward.autocast_dtype}), or torch.compile")
        clone = type(module).__new__(type(module))
        clone.__dict__.update({k: v for k, v in module.__dict__.items() if k not in _INSTANCE_ONLY})
        own = getattr(type(module), "__prepare_scriptable__", None)   # the class's own, if any
        return own(clone) if own is not None else clone


def install(module: nn.Module, **options: Any) -> OptimizedForward:
    """Set an OptimizedForward as ``module``'s forward (replacing one installed before)."""
    forward = OptimizedForward(module, **options)
    module.forward = forward   # type: ignore[method-assign]
    module.__prepare_scriptable__ = PrepareScriptable(module)   # type: ignore[method-assign]
    if not any(isinstance(hook, RefreshAfterLoad) for hook in module._load_state_dict_post_hooks.values()):
        module.register_load_state_dict_post_hook(RefreshAfterLoad())
    return forward
