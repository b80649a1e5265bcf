"""The hooks ``xlaunch --auto-optimize`` installs in the child (see :mod:`xlaunch.kernels.inject`).

Nothing here imports torch until the program does: :func:`install_from_environment` puts a
finder on ``sys.meta_path`` that lets torch import normally and then patches it.

* ``torch.optim.SGD/Adagrad/Adam/AdamW`` become :mod:`xlaunch.kernels.optim.fused`'s fused subclasses
  (same constructor and state, so scripts and checkpoints keep working).
* ``nn.Module.__call__`` gains one check: a module called by the program itself (not from inside
  another module's forward) in eval mode with autograd off (``torch.no_grad()`` or
  ``torch.inference_mode()``) runs itself on that first call, watched (:mod:`.state`): when the call
  left its own state alone, it is optimized once, and later calls go to the optimized copy (a forward
  that keeps changing its module's attributes or buffers runs unoptimized, said once). In fp32 that copy is the fastest route measured on the first call's
  arguments (``optimize(..., sample_input=args, backend="auto")`` within
  ``XLAUNCH_AUTO_OPTIMIZE_BUDGET`` seconds, default 120; ``XLAUNCH_AUTO_OPTIMIZE_BACKEND`` picks
  another backend, ``torch`` for the rewrite alone), cached on disk, so the next run and the other
  instances load it; ``--dtype bfloat16`` does the same in bf16 (every engine in bf16, checked
  against fp32 with bf16's tolerance). With keyword arguments it is the torch rewrite, whose forward
  freezes a graph per exact input signature on its first call with it
  (:mod:`xlaunch.kernels.optimize.dispatch`, without the timing). The program's own model object is
  never modified, except a Hugging Face decoder :mod:`xlaunch.llm` supports (Llama, Mistral,
  Qwen2): :func:`xlaunch.llm.optimize` packs it in place on its first call (``generate``'s included),
  in the dtype asked for, with ``XLAUNCH_AUTO_OPTIMIZE_LLM_WEIGHTS=int8|int4`` for weight-only INT8/INT4. When its parameters or buffers change in place (more training, a loaded state
  dict) the copy is rebuilt. A module the library cannot handle runs unchanged, with one warning.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional

from xlaunch.kernels.inject import VERBOSE_ENV, read_variables
from xlaunch.kernels.inject import append_record as _record
from xlaunch.kernels.inject.report import describe as _describe
from xlaunch._torch import tensor_version
from xlaunch.kernels.optimize.notes import excerpt

PREFIX = "xlaunch --auto-optimize"
OPTIMIZERS = ("SGD", "Adagrad", "Adam", "AdamW")
MAX_REBUILDS = 3
DEFAULT_FREEZE = "jit"


class Settings:
    """What the launcher asked for (from the environment; a bad value is one ValueError naming it)."""

    def __init__(self, environ: Optional[dict] = None) -> None:
        values = read_variables(os.environ if environ is None else environ)
        self.dtype: str = values["dtype"]
        self.verbose = (os.environ if environ is None else environ).get(VERBOSE_ENV, "") not in ("", "0")
        self.freeze: str = values["freeze"]
        self.backend: Any = values["backend"]
        self.budget: float = values["budget"]
        self.llm_weights: Optional[str] = values["llm_weights"]


_settings: Optional[Settings] = None


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"{PREFIX}: {message}\n")
        sys.stderr.flush()
    except (AttributeError, ValueError, OSError):   # no stderr, a closed one, a full disk: the line is lost, not the job
        pass


def _verbose(message: str) -> None:
    if _settings is not None and _settings.verbose:
        _say(message)


def install_from_environment() -> None:
    """Patch torch now if it is already imported, else as soon as the program imports it."""
    global _settings
    _settings = Settings()
    if "torch" in sys.modules:
        patch_torch(sys.modules["torch"])
    elif not any(isinstance(finder, _TorchImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds torch with the other finders, and patches it right after it has executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchAfterExec(spec.loader)
                return spec
        return None


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            patch_torch(module)
        except Exception as exc:  # the program runs unpatched rather than not at all
            _say(f"not active ({type(exc).__name__}: {exc})")

    def __getattr__(self, name: str) -> Any:   # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


def patch_torch(torch: Any) -> None:
    """Swap in the fused optimizers and hook ``nn.Module.__call__`` (idempotent)."""
    if getattr(torch.nn.Module, "_xlaunch_auto_optimize", False):
        return
    from xlaunch.kernels.optim import fused as optim

    swapped = []
    for name in OPTIMIZERS:
        fused = getattr(optim, f"Fused{name}")
        if getattr(torch.optim, name) is not fused:
            setattr(torch.optim, name, fused)
            swapped.append(name)
    _verbose(f"optimizers {', '.join(swapped)} -> xlaunch fused ({', '.join('Fused' + n for n in swapped)})")
    # torch's fused kernels (ours, and torch.optim's fused=True) update parameters without bumping
    # their version counter, which is how an optimized copy learns that its weights are stale
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_mark_stepped)
    original = torch.nn.Module.__call__
    torch.nn.Module.__call__ = _make_call(original, torch)
    torch.nn.Module._xlaunch_auto_optimize = True
    _verbose(f"eval-mode models called under no_grad are optimized on first call "
             f"(dtype {_settings.dtype if _settings else 'float32'}, freeze "
             f"{_settings.freeze if _settings else DEFAULT_FREEZE})")


def _mark_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """After any optimizer's step: bump the version of every parameter it holds (as a plain,
    unfused step does), so an optimized copy built from them is rebuilt."""
    from torch.autograd.graph import increment_version

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params:
        increment_version(params)


_local = threading.local()


def _compiled_module_type() -> Any:
    """``torch.compile``'s module wrapper once torch._dynamo is imported (a model can be one only
    then), else None. Reading ``torch._dynamo`` would import it: sympy and more, ~2 s of CPU in
    every process, whether the program compiles or not."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def _make_call(original: Callable, torch: Any) -> Callable:
    script_types = tuple(t for t in (getattr(torch.jit, "ScriptModule", None),) if t)
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

    def skipped(module: Any) -> bool:
        compiled = _compiled_module_type()
        return isinstance(module, script_types) or (compiled is not None and isinstance(module, compiled))

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        if depth == 0 and not self.training and not skipped(self) and not is_compiling():
            optimized = _optimized_for(self, args, kwargs, torch)
            if optimized is _WATCH:
                return _watched_call(original, self, args, kwargs, torch)
            if optimized is not None:
                _local.depth = 1
                try:
                    return optimized(*args, **kwargs)
                except Exception as exc:   # e.g. a frozen graph meeting an input it cannot take
                    failure = exc
                finally:
                    _local.depth = 0
                # the model itself: when it fails too, the call was wrong (the program's error, raised
                # as the model raises it) and the optimized copy stays; else the copy is at fault
                result = _call_original(original, self, args, kwargs, depth)
                _give_up(self, f"the optimized copy failed ({type(failure).__name__}: {excerpt(failure, 200)})")
                return result
        return _call_original(original, self, args, kwargs, depth)

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    return __call__


def _watched_call(original: Callable, module: Any, args: tuple, kwargs: dict, torch: Any) -> Any:
    """Until a call leaves the module's own state alone, the module itself runs (an optimized copy
    would update the copy's state, or none once frozen); then the copy is built for the next calls.
    A second call that changes it gives the model up (the first may fill a cache once)."""
    from xlaunch.kernels.inject.state import changed, snapshot

    before = snapshot(module)
    result = _call_original(original, module, args, kwargs, 0)
    entry, names = _entries.get(module), changed(module, before)
    if entry is None or entry.given_up:
        return result
    if names:
        entry.state_changes += 1
        if entry.state_changes > 1:
            _give_up(module, f"its forward changes its own state ({', '.join(names)}), which a copy would not update")
    else:
        entry.watched = True
        with _lock:   # the copy the next calls run, built on arguments the module itself just took
            if entry.eager is None and not entry.given_up:
                _build_eager(module, entry, torch, args if not kwargs else None, proven=True)
    return result


def _call_original(original: Callable, module: Any, args: tuple, kwargs: dict, depth: int) -> Any:
    _local.depth = depth + 1
    try:
        return original(module, *args, **kwargs)
    finally:
        _local.depth = depth


class _Entry:
    """One user module: its optimized copy (folded, channels-last, bf16: right for any input; its
    forward holds frozen graphs per exact input signature, see :mod:`xlaunch.kernels.optimize.dispatch`)
    and the versions of the user's tensors it was built from."""

    def __init__(self) -> None:
        self.eager: Optional[Callable] = None
        self.tensors: list = []
        self.versions: tuple = ()
        self.given_up = False
        self.rebuilds = 0
        self.told_grad = False
        self.recorded: Optional[str] = None   # the backend of the last summary entry
        self.watched = False                  # a call of the module itself left its state alone
        self.state_changes = 0                # calls of it that changed its state

    def current(self) -> bool:
        return self.eager is not None and tuple(map(tensor_version, self.tensors)) == self.versions


_entries: "weakref.WeakKeyDictionary[Any, _Entry]" = weakref.WeakKeyDictionary()
_WATCH: Any = object()   # _optimized_for: run the module itself, watching its state (_watched_call)
_lock = threading.RLock()


def _fresh_lock() -> None:   # forked while another thread built a copy, a child would wait on its lock for ever
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_fresh_lock)


def _name(module: Any) -> str:
    return type(module).__name__


def _optimized_for(module: Any, args: tuple, kwargs: dict, torch: Any) -> Optional[Callable]:
    """What to call for ``module`` now (building it if needed); None = run the module as is,
    ``_WATCH`` = run it watching its state."""
    entry = _entries.get(module)
    if entry is None:
        if next(module.parameters(), None) is None:   # nothing to fold, cast or prepack
            return None
        with _lock:
            entry = _entries.get(module)
            if entry is None:          # the first call (of any thread) decides
                entry = _entries[module] = _Entry()
                if _is_llm_decoder(module):
                    _optimize_llm(module, entry, torch)
    if entry.given_up:
        return None
    if torch.is_grad_enabled():
        if not entry.told_grad:
            entry.told_grad = True
            _verbose(f"{_name(module)} called in eval mode with autograd on: runs unoptimized "
                     "(call it under torch.no_grad() or torch.inference_mode())")
        return None
    if entry.current():
        return entry.eager
    if not entry.watched:
        return _WATCH
    with _lock:
        if not entry.current():
            if entry.eager is not None:
                entry.rebuilds += 1
                if entry.rebuilds > MAX_REBUILDS:
                    _give_up(module, "its weights keep changing between eval calls")
                    return None
                _verbose(f"{_name(module)}: weights changed since it was optimized; optimizing again")
            _build_eager(module, entry, torch, args if not kwargs else None, earlier=entry.eager)
        return entry.eager


def _is_llm_decoder(module: Any) -> bool:
    """A Hugging Face causal LM of an architecture :mod:`xlaunch.llm` optimizes."""
    from xlaunch.llm.shapes import SUPPORTED_ARCHITECTURES

    kind = type(module)
    return kind.__name__ in SUPPORTED_ARCHITECTURES and kind.__module__.startswith("transformers.")


def _optimize_llm(module: Any, entry: _Entry, torch: Any) -> None:
    """Pack the decoder in place (its own forward then runs the fused decoder); never again for it."""
    from xlaunch.llm import optimize as optimize_llm

    settings = _settings or Settings({})
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    entry.given_up = True          # the hook leaves it alone from now on: the module itself is optimized
    try:
        with _library_calls():
            optimize_llm(module, dtype=dtype, weights=settings.llm_weights)
    except Exception as exc:
        _say(f"{_name(module)} runs unoptimized: xlaunch.llm.optimize failed ({type(exc).__name__}: {str(exc)[:200]})")
        return
    route = f"xlaunch.llm {settings.llm_weights or str(dtype).replace('torch.', '')}"
    _record({"module": _name(module), "backend": route, "cache": "off", "reason": "Hugging Face decoder, packed in place"})
    _verbose(f"{_name(module)} optimized in place by {route}")


def _give_up(module: Any, why: str) -> None:
    entry = _entries.get(module)
    if entry is not None:
        entry.given_up, entry.eager = True, None
    _say(f"{_name(module)} runs unoptimized: {why}")
    _record({"module": _name(module), "backend": "none", "cache": "off", "reason": f"runs unoptimized: {why}"})


@contextlib.contextmanager
def _library_calls() -> Iterator[None]:
    """Within the block, the library's own calls of a model are kept out of the hook."""
    previous_depth = getattr(_local, "depth", 0)
    _local.depth = 1
    try:
        yield
    finally:
        _local.depth = previous_depth


def _quietly(build: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``build`` with the library's own calls of the model kept out of the hook; return its
    result and the OptimizeWarnings it raised (as text)."""
    from xlaunch.kernels.optimize.pipeline import OptimizeWarning

    with _library_calls(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build()
    return result, [str(w.message) for w in caught if issubclass(w.category, OptimizeWarning)]


def _outside_inference_mode(build: Callable[[], Any], torch: Any) -> Any:
    """``build()`` with autograd off, out of inference mode: a copy made of inference tensors was refused
    by the engine routes (every model first called under ``torch.inference_mode()`` ran unoptimized)."""
    with torch.inference_mode(False), torch.no_grad():
        return build()


def _engine_sample(settings: Settings, args: Optional[tuple], torch: Any) -> Optional[tuple]:
    """The first call's arguments as the sample for ``backend`` auto/engines (fp32 or bf16: each
    precision goes to its fastest engine), or None (torch route: keywords, or arguments other than
    tensors and plain values)."""
    if settings.backend == "torch" or not args:
        return None
    if not any(isinstance(a, torch.Tensor) for a in args):
        return None
    if not all(isinstance(a, torch.Tensor) or a is None or isinstance(a, (bool, int, float, str)) for a in args):
        return None
    return tuple(args)


def _build_eager(module: Any, entry: _Entry, torch: Any, args: Optional[tuple] = None,
                 earlier: Optional[Any] = None, proven: bool = False) -> None:
    """The optimized copy. With the engine backend (default ``auto``, fp32 or bf16): the fastest
    route measured on the first call's arguments (``optimize(..., dtype=..., backend=...)``, cached
    on disk); rebuilt for changed weights (``earlier``: the copy before), the route measured then,
    built again untimed (:func:`xlaunch.kernels.optimize.engines.api.rebuild`). Else
    (``XLAUNCH_AUTO_OPTIMIZE_BACKEND=torch``, or no usable sample): the torch rewrite, whose forward
    freezes a graph per input signature on first use (unless the freeze backend is "none"). ``proven``: the
    module itself has just run on ``args``, so the copy failing on them gives the model up."""
    from xlaunch.kernels.optimize import dispatch
    from xlaunch.kernels.optimize.pipeline import optimize

    settings = _settings or Settings({})
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    freezing = settings.freeze != "none"
    flags = {"weights_prepack": freezing, "measure": False}
    if freezing:
        flags["freeze_backend"] = settings.freeze
    sample = _engine_sample(settings, args, torch)
    if sample is not None:
        flags = {"freeze_backend": settings.freeze} if freezing else {"weights_prepack": False}

        def build() -> Any:
            if earlier is not None:   # only the weights changed: the route measured for them, built again
                from xlaunch.kernels.optimize.engines.api import rebuild

                again = rebuild(optimize, earlier, module, sample, dtype, flags=flags)
                if again is not None:
                    return again
            return optimize(module, dtype=dtype, sample_input=sample, backend=settings.backend,
                            time_budget=settings.budget, **flags)
    else:
        def build() -> Any:
            return optimize(module, dtype=dtype, **flags)
    try:
        eager, notes = _quietly(lambda: _outside_inference_mode(build, torch))
    except Exception as exc:
        from xlaunch.kernels.optimize.notes import SampleInputError

        # the call was wrong (the model raises it, the next builds), unless the model itself just took it
        if not isinstance(exc, SampleInputError):
            _give_up(module, f"{type(exc).__name__}: {excerpt(exc, 300)}")
        elif proven:
            cause = exc.__cause__ or exc
            _give_up(module, f"a copy of it fails on a call the model itself took ({type(cause).__name__}: "
                             f"{excerpt(cause, 300)})")
        return
    forward = dispatch.of(eager)
    if forward is not None:
        name = _name(module)
        forward.notify = lambda message, is_warning: _verbose(f"{name}: {message}")
    entry.eager = eager
    entry.tensors = list(module.parameters()) + list(module.buffers())
    entry.versions = tuple(map(tensor_version, entry.tensors))
    report = getattr(eager, "_xlaunch_optimize_report", None)
    engine = getattr(eager, "_xlaunch_engine_report", None)
    backend = engine.backend if engine is not None else "torch"
    if not (engine is not None and engine.cache.startswith("rebuilt") and backend == entry.recorded):
        entry.recorded = backend   # one summary entry per route a model runs on, not one per rebuild
        _record({"module": _name(module), "backend": backend, "cache": engine.cache if engine is not None else "off",
                 "reason": engine.reason if engine is not None else _describe(report)})
    if settings.verbose:
        _verbose(f"{_name(module)} optimized: {_describe(report, getattr(eager, '_xlaunch_engine_report', None))}")
        for note in notes:
            _verbose(f"  {note}")
    elif settings.dtype == "bfloat16" and report is not None and report.dtype != torch.bfloat16:
        _say(f"{_name(module)}: bf16 not used; see --auto-optimize-verbose")
