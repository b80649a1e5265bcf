"""The forward of a module served by an engine (ONNX Runtime, OpenVINO, inductor).

``optimize(..., backend=...)`` returns a copy of the user's module (its class, attributes,
``state_dict``, ``training`` flag) whose instance ``forward`` is an :class:`EngineForward`. A call
goes to the engine when an engine can answer it exactly as the module would:

  * eval mode, no keyword arguments, no tracing, scripting or compiling going on;
  * autograd off (``torch.no_grad()``/``torch.inference_mode()``), or no parameter requiring grad:
    an engine returns no graph to backpropagate through (under autograd the eager forward runs,
    said once);
  * the arguments match the sample in everything but the batch size (:meth:`Sample.accepts`);
  * the parameters and buffers are the ones the engine was built from (their storage and version
    counters are checked on each call: after ``load_state_dict`` or an in-place update the engine
    is dropped, said once, and the eager forward runs).

Every other call runs the module's own forward. The engine's outputs come back in the module's
structure (tuples, dicts, named tuples) as torch tensors. An engine that raises on a call (a
shape its export cannot take) is answered by the eager forward, said once.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch, tensor_version

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize.dispatch import PrepareScriptable
from xlaunch.kernels.optimize.engines.sample import Sample
from xlaunch.kernels.optimize.notes import excerpt


class EngineForward:
    """An instance-level ``forward``: the engine for the calls it can serve, the eager forward else."""

    def __init__(self, module: nn.Module, runner: Callable[..., Any], sample: Sample, route: str,
                 notify: Callable[[str], None]) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward")   # an instance forward the user set, if any
        self.runner: Optional[Callable[..., Any]] = runner
        self.sample = sample
        self.route = route
        self.notify = notify
        self.calls_served = 0
        self._told: set[str] = set()
        self._failed_shapes: set[tuple] = set()   # inputs the engine raised on: eager from then on
        self._tensors = list(itertools.chain(module.parameters(), module.buffers()))
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        self.weights_key = self._weights_key()

    def _weights_key(self) -> tuple:
        return tuple((t.data_ptr(), tensor_version(t)) for t in self._tensors)

    def _tell(self, what: str, message: str) -> None:
        if what not in self._told:
            self._told.add(what)
            self.notify(message)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return functools.partial(type(self.module).forward, self.module)(*args, **kwargs)

    def serves(self, args: tuple, kwargs: dict) -> bool:
        """Whether the engine answers this call (see the module docstring)."""
        if self.runner is None or kwargs or self.module.training:
            return False
        if torch.jit.is_tracing() or torch.jit.is_scripting() or torch.compiler.is_compiling():
            return False
        if torch.is_grad_enabled() and any(p.requires_grad for p in self._trainable):
            self._tell("grad", f"called with autograd on: the eager forward runs (gradients need it); call "
                               f"it under torch.no_grad() or torch.inference_mode() for {self.route}")
            return False
        if not self.sample.accepts(args):
            return False
        if self._weights_key() != self.weights_key:
            self.runner = None
            self._tell("weights", f"the weights changed since the {self.route} engine was built; the eager "
                                  "forward runs from now on (call optimize again to rebuild)")
            return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.serves(args, kwargs):
            shapes = tuple(tuple(a.shape) for a in self.sample.tensors(args)) if self._failed_shapes else ()
            if not shapes or shapes not in self._failed_shapes:
                try:
                    out = self.runner(*args)   # type: ignore[misc]
                except Exception as exc:
                    shapes = tuple(tuple(a.shape) for a in self.sample.tensors(args))
                    self._failed_shapes.add(shapes)
                    self._tell("failed", f"{self.route} failed on inputs {list(shapes)} ({type(exc).__name__}: "
                                         f"{excerpt(exc)}); the eager forward answers such calls")
                else:
                    self.calls_served += 1
                    return out
        return self.eager(*args, **kwargs)

    def __getstate__(self) -> dict:
        """Copies and pickles carry no engine (a session cannot be copied): they run eager."""
        state = dict(self.__dict__)
        state.update(runner=None, notify=_quiet)
        return state


def _quiet(message: str) -> None:
    return None


def install(module: nn.Module, runner: Callable[..., Any], sample: Sample, route: str,
            notify: Callable[[str], None]) -> EngineForward:
    forward = EngineForward(module, runner, sample, route, notify)
    module.forward = forward   # type: ignore[method-assign]
    module.__prepare_scriptable__ = PrepareScriptable(module)   # type: ignore[method-assign]
    return forward


def of(module: nn.Module) -> Optional[EngineForward]:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, EngineForward) else None
