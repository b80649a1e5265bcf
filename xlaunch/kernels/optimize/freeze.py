"""Graph freezing: weights become constants of a compiled graph (prepacked for oneDNN / the
inductor cpp backend), with stock torch only.

Two backends:
  * ``inductor``: ``torch.compile(model, options={"freezing": True})``; constant-folds the weights
    (including bf16 casts and conv weight layouts) and generates C++ kernels with gcc. Compiles on
    the first call (at ``optimize`` time when a sample input is given). Slow to compile (~5-15 s for
    a small CNN on 2 cores); a new input shape recompiles.
  * ``jit`` (default): ``torch.jit.trace`` + ``torch.jit.freeze``; needs a sample input; compiles
    in about a second; the graph is specialised to the traced control flow.

Which one wins was measured by ``bench/optimize.py`` (see docs/kernels.md).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import os
import warnings
from typing import Any, Callable, Iterator, Optional

from xlaunch._torch import needs_torch
from xlaunch.kernels.optimize.notes import excerpt

with needs_torch(__name__):
    import torch
    from torch import nn
    from torch.utils import _pytree as pytree

from xlaunch.kernels.optimize import layout

BACKENDS = ("inductor", "jit")
# XLAUNCH_PREPACK=0 traces the plain modules (aten convs, which re-lay their weights every call).
PREPACK_ENV = "XLAUNCH_PREPACK"


TORCH_DIR = os.path.dirname(torch.__file__)


class UnsafeTrace(RuntimeError):
    """Tracing warned that the graph depends on this input's values (TracerWarning)."""


def from_torch(filename: Any) -> bool:
    """A warning raised in torch's own code: a TracerWarning there is about shapes (``group_norm``'s
    batch-size check, ``len(tensor)``), which a graph frozen per exact input signature bakes in
    rightly; one raised in the user's code is about the data."""
    return isinstance(filename, str) and os.path.abspath(filename).startswith(TORCH_DIR + os.sep)


class _FlatOutputs(nn.Module):
    """The model for a trace: a traced graph returns tensors and plain tuples of them only (a dict,
    list or ``None`` refuses the trace, a named tuple comes back as a plain tuple), so any other
    output structure is flattened (``torch.utils._pytree``) to a tuple of its tensors. ``spec`` is the
    eager structure, ``nones`` the positions of its ``None`` leaves, ``flat`` whether it was
    flattened; :class:`Restructured` rebuilds it around the graph's tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.spec: Any = None
        self.nones: tuple[int, ...] = ()
        self.flat = False

    def forward(self, *args: Any) -> Any:
        out = self.model(*args)
        leaves, self.spec = pytree.tree_flatten(out)
        others = {type(leaf).__name__ for leaf in leaves if leaf is not None and not isinstance(leaf, torch.Tensor)}
        if others:
            raise TypeError(f"the model's outputs hold {', '.join(sorted(others))} values (a graph returns tensors)")
        self.nones = tuple(i for i, leaf in enumerate(leaves) if leaf is None)
        self.flat = bool(self.nones) or not _plain_structure(self.spec)
        return tuple(leaf for leaf in leaves if leaf is not None) if self.flat else out


class Restructured:
    """A frozen graph of :class:`_FlatOutputs` whose calls return the model's own structure
    (dicts, lists, named tuples, ``None``s) instead of the graph's flat tuple."""

    def __init__(self, graph: Callable, spec: Any, nones: tuple[int, ...]) -> None:
        self.graph, self.spec, self.nones = graph, spec, nones

    def __call__(self, *args: Any) -> Any:
        out = self.graph(*args)
        tensors = iter([out] if isinstance(out, torch.Tensor) else out)
        leaves = [None if i in self.nones else next(tensors) for i in range(self.spec.num_leaves)]
        return pytree.tree_unflatten(leaves, self.spec)


def _plain_structure(spec: Any) -> bool:
    """Outputs a traced graph returns as they are: a tensor, or (nested) plain tuples of tensors."""
    if spec.is_leaf():
        return True
    return spec.type is tuple and all(_plain_structure(child) for child in spec.children_specs)


def as_args(sample_input: Any) -> tuple:
    return sample_input if isinstance(sample_input, tuple) else (sample_input,)


def _copy(arg: Any) -> Any:
    if not isinstance(arg, torch.Tensor):
        return arg
    with torch.no_grad():
        if torch._debug_has_internal_overlap(arg) == 0:   # the same strides, so the same input signature
            return torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device).copy_(arg)
        return arg.clone()


def fresh(args: tuple) -> tuple:
    """Copies of the tensor arguments (same shape, strides, dtype): what a build, a check or a timing
    runs the model on, so a forward that changes its input in place (``x.mul_(2)``, a leading
    ``ReLU(inplace=True)``) neither changes the caller's tensors nor sees an input that earlier
    runs already changed."""
    return tuple(_copy(arg) for arg in args)


def fresh_input(sample_input: Any) -> Any:
    """:func:`fresh` for a ``sample_input`` (a tuple of arguments, or one argument)."""
    return fresh(sample_input) if isinstance(sample_input, tuple) else _copy(sample_input)


class BufferState:
    """The values of a module's buffers, by name: a forward that updates them (running statistics,
    a counter, an EMA) must not see the extra runs a build, check or timing makes. :meth:`restore`
    writes them back into a module (the same one, or its rewrite), only where they changed."""

    def __init__(self, module: nn.Module) -> None:
        self.saved = {name: b.detach().clone() for name, b in module.named_buffers(remove_duplicate=False)}

    def changed(self, module: nn.Module) -> list[str]:
        """The names of the buffers whose values differ from the saved ones."""
        return [name for name, b in module.named_buffers(remove_duplicate=False)
                if name in self.saved and not _same(b, self.saved[name])]

    def restore(self, module: nn.Module) -> None:
        with torch.no_grad():
            for name, b in module.named_buffers(remove_duplicate=False):
                saved = self.saved.get(name)
                if saved is not None and saved.shape == b.shape and saved.dtype == b.dtype and not _same(b, saved):
                    b.copy_(saved)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def freeze_inductor(model: nn.Module) -> nn.Module:
    """``torch.compile`` with inductor freezing; compiled lazily on the first call."""
    return torch.compile(model, backend="inductor", options={"freezing": True})


@contextlib.contextmanager
def _jit_records_autocast() -> Iterator[None]:
    """Let tracing record autocast's casts as ordinary ops (the JIT autocast pass stays off)."""
    previous = torch._C._jit_set_autocast_mode(False)
    try:
        yield
    finally:
        torch._C._jit_set_autocast_mode(previous)


class _Seen:
    """What a conv/linear got on its first call: input size and the dtype it computed in."""

    def __init__(self) -> None:
        self.calls: dict[int, Optional[tuple[tuple, torch.dtype]]] = {}

    def hook(self, module: nn.Module, args: tuple) -> None:
        if id(module) in self.calls:
            return
        self.calls[id(module)] = None
        x = args[0] if len(args) == 1 else None
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or not x.is_floating_point():
            return
        weight = module.weight
        if torch.is_autocast_enabled("cpu") and weight.dtype in (torch.float32, torch.bfloat16):
            dtype = torch.get_autocast_dtype("cpu")   # conv and linear run in it under CPU autocast
        elif x.dtype == weight.dtype:
            dtype = weight.dtype
        else:
            return
        self.calls[id(module)] = (tuple(x.shape), dtype)


def _packed(module: nn.Module, seen: Optional[tuple[tuple, torch.dtype]]) -> Optional[nn.Module]:
    """The module's prepacked stand-in for the call it got, or None when it keeps aten's op."""
    if seen is None:
        return None
    size, dtype = seen
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None   # oneDNN has no bf16 kernels on this CPU (no AVX-512): aten's path
    if (type(module) is nn.Conv2d and module.padding_mode == "zeros" and not isinstance(module.padding, str)
            and len(size) == 4 and dtype in (torch.float32, torch.bfloat16)):
        return layout.PackedConv2d(module, size, dtype)
    # fp32 linear runs MKL's sgemm (no oneDNN weight reorder); bf16 runs oneDNN's matmul
    if type(module) is nn.Linear and len(size) >= 2 and dtype == torch.bfloat16:
        return layout.PackedLinear(module, math.prod(size[:-1]), dtype)
    return None


def _plain(module: nn.Module) -> bool:
    """A module that runs nothing but its class's forward: no instance forward, no hooks."""
    return "forward" not in module.__dict__ and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or getattr(module, "_backward_pre_hooks", None))


def prepacked_copy(model: nn.Module, args: tuple) -> tuple[nn.Module, int]:
    """A copy of ``model`` (sharing its tensors) whose convs and bf16 linears hold their weights
    prepacked for the call ``model(*args)`` makes (:class:`layout.PackedConv2d`), and how many
    were swapped. Modules called more than once or from elsewhere keep their first call's
    packing; modules ``forward`` never calls (read directly, as ``nn.MultiheadAttention`` does),
    and modules with hooks or an instance ``forward``, are left as they are."""
    seen = _Seen()
    candidates = [m for m in model.modules() if type(m) in (nn.Conv2d, nn.Linear) and _plain(m)]
    if not candidates:
        return model, 0
    hooks = [m.register_forward_pre_hook(seen.hook) for m in candidates]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for handle in hooks:
            handle.remove()
    tensors = itertools.chain(model.parameters(), model.buffers())
    clone = copy.deepcopy(model, {id(t): t for t in tensors})
    originals = dict(model.named_modules(remove_duplicate=False))
    swapped = 0
    scripted: dict[int, nn.Module] = {}
    for name, module in list(clone.named_modules(remove_duplicate=False)):
        parent_name, _, child = name.rpartition(".")
        original = originals.get(name)
        if not child or original is None or id(original) not in seen.calls:
            continue
        if id(original) not in scripted:
            packed = _packed(original, seen.calls[id(original)])
            if packed is None:
                continue
            scripted[id(original)] = torch.jit.script(packed)
            swapped += 1
        setattr(clone.get_submodule(parent_name) if parent_name else clone, child, scripted[id(original)])
    return clone, swapped


_CONV_THEN = """
graph(%x, %w, %b, %p, %s, %d, %g, %attr, %sc, %alg):
  %y = mkldnn::_convolution_pointwise(%x, %w, %b, %p, %s, %d, %g, %attr, %sc, %alg)
  %z = aten::{op}(%y)
  return (%z)"""
_CONV_FUSED = """
graph(%x, %w, %b, %p, %s, %d, %g, %attr, %sc, %alg):
  %fused : str = prim::Constant[value="{attr}"]()
  %z = mkldnn::_convolution_pointwise(%x, %w, %b, %p, %s, %d, %g, %fused, %sc, %alg)
  return (%z)"""


def fuse_pointwise(graph: Any) -> None:
    """A prepacked conv whose only use is a ReLU computes it as oneDNN's post-op (in place)."""
    for op, attr in (("relu_", "relu"), ("relu", "relu")):
        torch._C._jit_pass_custom_pattern_based_rewrite_graph(_CONV_THEN.format(op=op),
                                                               _CONV_FUSED.format(attr=attr), graph)


def prepack_enabled() -> bool:
    return os.environ.get(PREPACK_ENV, "1") not in ("0", "") and layout.can_prepack()


def freeze_jit(model: nn.Module, sample_input: Any) -> Callable:
    """Trace with ``sample_input`` and freeze (weights become constants, conv and bf16 linear
    weights prepacked once: :func:`prepacked_copy`). The frozen module itself when the model returns
    a tensor or plain tuples of them, else a :class:`Restructured` around it (the eager structure:
    dicts, lists, named tuples and ``None``s as the model returns them).

    oneDNN graph fusion (``torch.jit.enable_onednn_fusion``) is left as the user set it: here it
    gained under 10% on the examples CNN and failed ("partition compile failed") on small models
    with reductions, at run time, so it is not worth turning on behind the user's back.
    torch 2.13 marks ``torch.jit.trace``/``freeze`` deprecated; they still work and win here
    (see ``DEFAULT_FREEZE_BACKEND``), so their deprecation notices are not repeated to users."""
    with torch.no_grad(), _jit_records_autocast(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated")
        packed = 0
        if prepack_enabled():
            model, packed = prepacked_copy(model, as_args(sample_input))
        flat = _FlatOutputs(model)
        traced = torch.jit.trace(flat, as_args(sample_input), check_trace=False)
        unsafe = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning) and not from_torch(w.filename)]
        if unsafe:   # the trace baked in a Python value taken from a tensor: not valid for other inputs
            where = f"{os.path.basename(str(unsafe[0].filename))}:{unsafe[0].lineno}"
            raise UnsafeTrace(f"{excerpt(unsafe[0].message)} (at {where})")
        frozen = torch.jit.freeze(traced.eval())
        if packed:
            fuse_pointwise(frozen.graph)
        graph: Callable = Restructured(frozen, flat.spec, flat.nones) if flat.flat else frozen
        for _ in range(2):  # the profiling executor specialises and fuses on the first runs
            graph(*as_args(sample_input))
    return graph


class InductorUnavailable(RuntimeError):
    """Inductor's C++ code cannot be built in this installation (known before a compile)."""


@functools.lru_cache(maxsize=None)
def inductor_blocker() -> Optional[str]:
    """Why inductor cannot build its C++ code here, or None. torch 2.13's C++ builder leaves paths in its
    command line unquoted: the library folders (torch's ``lib/``, Python's ``LIBDIR``: pytorch/pytorch#191010),
    the sources and outputs under its cache folder and the temporary folder. With a space in one of them every
    compile fails, after seconds of work, with a bare "C++ compile error"."""
    import sysconfig
    import tempfile

    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit()) > (2, 13):
        return None
    folders = {"torch's library folder": os.path.join(os.path.dirname(torch.__file__), "lib"),
               "Python's library folder": sysconfig.get_config_var("LIBDIR") or "",
               "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""),
               "the temporary folder (TMPDIR)": tempfile.gettempdir()}
    for what, folder in folders.items():
        if any(char.isspace() for char in folder):
            return (f"torch {torch.__version__}'s inductor cannot compile with a space in {what} ({folder!r}): its "
                    "C++ builder leaves paths unquoted (pytorch/pytorch#191010)")
    return None


def freeze(model: nn.Module, backend: str, sample_input: Any = None) -> nn.Module:
    """The frozen model; with a sample input, compiled now (so errors surface here)."""
    if backend not in BACKENDS:
        raise ValueError(f"optimize: freeze_backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "jit":
        if sample_input is None:
            raise ValueError("the jit backend needs a sample_input to trace")
        return freeze_jit(model, sample_input)
    if inductor_blocker() is not None:
        raise InductorUnavailable(inductor_blocker())
    compiled = freeze_inductor(model)
    if sample_input is not None:
        with torch.no_grad():
            compiled(*as_args(sample_input))
    return compiled
