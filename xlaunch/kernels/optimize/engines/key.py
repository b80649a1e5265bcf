"""The engine cache's key: a hash of what runs, equal in every process, different as soon as
anything that runs differs.

What goes in (:func:`model_key`):

* **the code**: for every module in the model, the Python code of its class and base classes
  (every function defined there: ``forward``, helpers, properties, static and class methods) and,
  transitively, the code those functions reach: global functions and classes their code names
  (also through a module, as in ``helpers.scale(x)``), functions held in closures, default
  arguments and the modules' own attributes (``self.act = my_gelu``), and forward hooks. Code is
  hashed *normalized*: bytecode, names, argument layout and constants, nested code objects
  (comprehensions, lambdas, inner functions) hashed the same way in place. No ``repr`` that holds
  an address, no file name or line number: two processes get the same key, and moving a function
  within its file changes nothing. Code of torch, of the standard library and of builtins is named,
  not walked: the library versions below cover it. At most :data:`MAX_FUNCTIONS` functions are
  walked (a bound on cost for very large programs);
* **the modules' state**: the module tree (``repr`` with addresses removed), every module's plain
  attributes (numbers, strings, flags, tuples of them) and global constants the code reads;
* **the weights**: every ``state_dict`` tensor's name, dtype, shape and bytes (every byte up to
  :data:`FULL_WEIGHT_BYTES` in all; beyond that, :data:`SAMPLED_CHUNKS` chunks of each tensor. The
  entry loaded is still checked against eager on the sample, so a weight change the sample missed
  rebuilds);
* **the call**: the sample's input signature (batch size excluded), dtype, level, flags, the routes
  asked for;
* **the machine and libraries**: thread count, ISA flags, versions of torch, the engines and
  xlaunch (:func:`.cache.library_versions`).

Why not the traced graph: tracing runs the model (seconds for an export, and an export that fails
is common); the graph is a function of exactly the inputs above (code, attributes, weights'
shapes, input signature and library versions), so hashing those covers it without running it.
"""
from __future__ import annotations

import functools
import hashlib
import re
import sys
import types
from typing import Any, Callable, Mapping

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

FORMAT = 2
MAX_FUNCTIONS = 4096          # functions and classes walked per key
MAX_DEPTH = 96                # nested functions and code objects (two per call: ~48 calls deep)
FULL_WEIGHT_BYTES = 2 << 30   # every byte of the weights up to this total
SAMPLED_CHUNKS, CHUNK_BYTES = 64, 1 << 16
SMALL_TENSOR_BYTES = 1 << 20  # a tensor attribute or global up to this size: its bytes
# Packages whose code is named, not walked (their versions are in the key, or they are Python's).
NAMED_PACKAGES = frozenset({"torch", "builtins", "xlaunch", "onnx", "onnxruntime", "openvino", "nncf",
                            "numpy", "typing_extensions"}) | frozenset(
    getattr(sys, "stdlib_module_names", ("abc", "collections", "copy", "enum", "functools", "itertools", "math",
                                         "operator", "os", "re", "sys", "types", "typing", "warnings")))
_ADDRESS = re.compile(r"\s+at\s+0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
                               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                               "_load_state_dict_post_hooks", "_backward_hooks", "_backward_pre_hooks",
                               "_is_full_backward_hook", "_compiled_call_impl", "_forward_hooks_with_kwargs",
                               "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def without_addresses(text: str) -> str:
    """``text`` with ``at 0x7f...`` and long hex numbers taken out (they differ in every process)."""
    return _ADDRESS.sub("", text)


def _named(obj: Any) -> bool:
    """True when ``obj``'s code is the libraries' (named in the key, not walked)."""
    module = getattr(obj, "__module__", None) or ""
    return module.partition(".")[0] in NAMED_PACKAGES


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', type(obj).__name__))}"


class _Walker:
    """Turns code and values into canonical text (memoized per object), feeding a digest."""

    def __init__(self, add: Callable[[str], None]) -> None:
        self.add = add
        self.seen: dict[int, str] = {}
        self.keep: list[Any] = []      # what ``seen`` refers to stays alive (ids are not reused)
        self.walked = 0
        self.depth = 0

    # -- values -----------------------------------------------------------------------------------
    def value(self, value: Any, depth: int = 0) -> str:
        """Canonical text of a value the code uses (a constant, a global, an attribute)."""
        if value is None or value is Ellipsis or isinstance(value, (bool, int, float, complex, str, bytes)):
            return f"{type(value).__name__}:{value!r}"
        if depth > 6:
            return f"deep:{type(value).__qualname__}"
        if isinstance(value, types.CodeType):
            return self.code(value, {})
        if isinstance(value, (tuple, list)):
            return f"{type(value).__name__}(" + ",".join(self.value(v, depth + 1) for v in value[:256]) + ")"
        if isinstance(value, (frozenset, set)):   # string hashing is randomized per process: sort
            return f"{type(value).__name__}{{" + ",".join(sorted(self.value(v, depth + 1) for v in list(value)[:256])) + "}"
        if isinstance(value, dict):
            items = sorted((self.value(k, depth + 1), self.value(v, depth + 1)) for k, v in list(value.items())[:256])
            return "dict{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, (torch.dtype, torch.device, torch.Size)):
            return f"torch:{value}"
        if isinstance(value, types.ModuleType):
            return f"module:{value.__name__}"
        if isinstance(value, (staticmethod, classmethod)):
            return self.value(value.__func__, depth + 1)
        if isinstance(value, property):
            return "property(" + ",".join(self.value(f, depth + 1) for f in (value.fget, value.fset)) + ")"
        if isinstance(value, types.MethodType):
            return "method:" + self.value(value.__func__, depth + 1)
        if isinstance(value, types.FunctionType):
            return self.function(value)
        if isinstance(value, type):
            return self.cls(value)
        if isinstance(value, functools.partial):
            return "partial(" + ",".join(self.value(v, depth + 1) for v in (value.func, value.args, value.keywords)) + ")"
        if isinstance(value, nn.Module):   # a module held outside the tree: its class (its tree is in repr)
            return "module-object:" + self.cls(type(value))
        if not _named(type(value)) and hasattr(value, "__dict__"):   # an object of the user's (a config)
            return f"object:{self.cls(type(value))}:{self.value(vars(value), depth + 1)}"
        if callable(value):
            return "named:" + _qualified(value)
        return "object:" + _qualified(type(value))   # its repr could hold an address

    def tensor(self, tensor: torch.Tensor) -> str:
        text = f"tensor:{tensor.dtype}:{tuple(tensor.shape)}"
        if tensor.numel() * tensor.element_size() <= SMALL_TENSOR_BYTES and not tensor.is_quantized \
                and tensor.layout == torch.strided and tensor.device.type == "cpu":
            flat = tensor.detach().contiguous().reshape(-1)
            try:
                text += ":" + hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
            except (RuntimeError, TypeError):
                pass
        return text

    # -- code ------------------------------------------------------------------------------------
    def _memo(self, obj: Any, make: Callable[[], str], label: str) -> str:
        key = id(obj)
        if key in self.seen:
            return self.seen[key]
        self.keep.append(obj)
        self.seen[key] = f"{label}:<recursive>"   # a function that reaches itself
        self.walked += 1
        if self.walked > MAX_FUNCTIONS or self.depth > MAX_DEPTH:
            text = f"{label}:<bound>"
        else:
            self.depth += 1
            try:
                text = make()
            finally:
                self.depth -= 1
        self.seen[key] = text
        return text

    def code(self, code: types.CodeType, globals_: Mapping[str, Any]) -> str:
        """A code object's hash: bytecode, layout, names, constants (nested code recursed) and
        what its names refer to in ``globals_``."""
        def make() -> str:
            digest = hashlib.blake2b(digest_size=16)
            layout = (code.co_name, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                      code.co_flags, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
            digest.update(repr(layout).encode() + b"\0" + code.co_code + b"\0")
            for const in code.co_consts:
                text = self.code(const, globals_) if isinstance(const, types.CodeType) else self.value(const)
                digest.update(text.encode() + b"\0")
            for name in code.co_names:   # globals it reads (and modules' attributes it reads)
                if name in globals_:
                    digest.update(f"{name}={self.reference(globals_[name], code.co_names)}".encode() + b"\0")
            return f"code:{getattr(code, 'co_qualname', code.co_name)}:{digest.hexdigest()}"
        return self._memo(code, make, "code")

    def reference(self, value: Any, names: tuple) -> str:
        """What a global name refers to; for a module of the user's, also the attributes the code reads."""
        if isinstance(value, types.ModuleType):
            if _named(value) or value.__name__.partition(".")[0] in NAMED_PACKAGES:
                return f"module:{value.__name__}"
            parts = [f"module:{value.__name__}"]
            for name in names:
                attribute = getattr(value, name, None) if name in vars(value) else None
                if attribute is not None:
                    parts.append(f"{name}={self.value(attribute)}")
            return "(" + ",".join(parts) + ")"
        return self.value(value)

    def function(self, function: types.FunctionType) -> str:
        if _named(function):
            return "named:" + _qualified(function)

        def make() -> str:
            parts = [_qualified(function), self.code(function.__code__, function.__globals__),
                     self.value(function.__defaults__), self.value(function.__kwdefaults__)]
            for cell in function.__closure__ or ():
                try:
                    parts.append(self.value(cell.cell_contents))
                except ValueError:   # an empty cell
                    parts.append("empty")
            return "function(" + ",".join(parts) + ")"
        return self._memo(function, make, "function")

    def cls(self, cls: type) -> str:
        """A class: its name; for the user's classes, also every function it and its bases define."""
        if _named(cls):
            return "named:" + _qualified(cls)

        def make() -> str:
            parts = [_qualified(cls)]
            for base in cls.__mro__:
                if base is object or _named(base):
                    parts.append("named:" + _qualified(base))
                    continue
                for name, member in sorted(vars(base).items()):
                    if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                        parts.append(f"{base.__qualname__}.{name}={self.value(member)}")
                    elif not name.startswith("__") and not callable(member):
                        parts.append(f"{base.__qualname__}.{name}={self.value(member)}")   # class constants
            return "class(" + ",".join(parts) + ")"
        return self._memo(cls, make, "class")

    def module_state(self, module: nn.Module) -> str:
        """A module instance: its class and its own attributes (hooks included), not the tensors
        and children (the weights and the tree are hashed apart)."""
        parts = [self.cls(type(module))]
        for name, value in sorted(vars(module).items()):
            if name in _MODULE_INTERNALS:
                continue
            if name in _HOOKS:
                parts.append(f"{name}=" + ",".join(self.value(hook) for hook in value.values()))
                continue
            try:
                parts.append(f"{name}={self.value(value)}")
            except Exception:   # an attribute that cannot be read as a value: its type
                parts.append(f"{name}=unreadable:{_qualified(type(value))}")
        return "(" + ",".join(parts) + ")"


def _tensor_bytes(tensor: torch.Tensor, sampled: bool) -> Any:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if not flat.numel():
        return b""
    try:
        data = flat.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):   # quantized and other tensors without a byte view
        import io

        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return buffer.getvalue()
    if not sampled or data.size <= SAMPLED_CHUNKS * CHUNK_BYTES:
        return data.data   # a view: no copy
    step = (data.size - CHUNK_BYTES) // (SAMPLED_CHUNKS - 1)
    return b"".join(data[i * step:i * step + CHUNK_BYTES].tobytes() for i in range(SAMPLED_CHUNKS))


def model_keys(model: nn.Module, sample_spec: tuple, routes: tuple, threads: int, isa: str, level: str,
               flags: Mapping[str, Any], versions: Mapping[str, str], dtype: str = "float32") -> tuple[str, str]:
    """``(key, choice key)`` of one (model, input signature, routes, machine, libraries): see the
    module. The choice key leaves the weights' values out (their names, dtypes and shapes stay):
    how fast a route runs does not depend on them, so a decision stored under it serves a
    retrained model as the incumbent (:func:`.policy.choose`)."""
    digest = hashlib.blake2b(digest_size=20)

    def add(text: Any) -> None:
        digest.update(without_addresses(text if isinstance(text, str) else repr(text)).encode() + b"\0")

    walker = _Walker(add)
    add((FORMAT, routes, threads, isa, level, dtype, sorted(versions.items())))
    add(walker.value(dict(flags)))
    add(sample_spec)
    add(repr(model))
    for name, module in model.named_modules(remove_duplicate=False):
        add(f"{name}:{walker.module_state(module)}")
    state = model.state_dict()
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            add((name, str(tensor.dtype), tuple(tensor.shape)))
        else:
            add((name, walker.value(tensor)))
    choice = digest.copy().hexdigest()
    total = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    sampled = total > FULL_WEIGHT_BYTES
    add(("weights", total, sampled))
    for tensor in state.values():
        if isinstance(tensor, torch.Tensor):
            digest.update(_tensor_bytes(tensor, sampled))
    return digest.hexdigest(), choice
