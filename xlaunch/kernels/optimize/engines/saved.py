"""Save what ``optimize(..., backend="auto")`` kept, and load it in another process without the
model's class.

    fast = optimize(model.eval(), sample_input=x, backend="auto")
    fast.save("model.xlaunch")                    # or save_optimized(fast, "model.xlaunch")
    served = load_optimized("model.xlaunch")      # a fresh process: no model class needed
    served(x)                                     # on the same engine, same outputs

What can be saved is what the engine serializes:
  * ``onnxruntime``: the ONNX model (``model.onnx``);
  * ``openvino``: the IR (``model.xml`` + ``model.bin``), compiled again with the precision kept;
  * ``eager``, ``torch``, ``inductor`` are your module's class run by torch (the torch route's
    frozen graph and inductor's compiled code are built for this process): refused with one line
    that says what to do instead (save ``state_dict()`` and call ``optimize`` again where it runs;
    for ``eager``, ``torch.export`` can save the module as given, but ``torch.export.load``
    unpickles, which this loader never does).

The saved model is a directory: ``manifest.json`` (format, route, dtype, the input signature, the
output structure as ``torch.utils._pytree`` JSON, the output dtypes, the report, the library
versions, each file's size and sha256) and the engine's files. It is written into a private
temporary directory beside ``path`` and renamed into place: ``path`` must not exist (a symlink
planted there is refused, never followed). Reading trusts nothing: the directory and its files are
opened without following symlinks and must be a directory and regular files, the manifest is read
up to 1 MiB, each file up to the size the manifest declares and checked against its sha256; no
pickle is read and no code from the files runs in Python; an ONNX model whose tensors point at
external data files (which ONNX Runtime would read from wherever they say) is refused. Any problem is one
:class:`SavedModelError` line naming the path. A missing engine names the extra to install.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Optional

from xlaunch._errors import error_line
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn
    from torch.utils import _pytree as pytree

from xlaunch.kernels.optimize.engines import cache as disk
from xlaunch.kernels.optimize.engines.base import missing_module
from xlaunch.kernels.optimize.engines.report import PIP_LINES, EngineReport

FORMAT = "xlaunch.optimize/1"
MANIFEST = "manifest.json"
SAVED_ATTRIBUTE = "_xlaunch_engine_saved"
SAVABLE = ("onnxruntime", "openvino")
REFUSED = {
    "eager": "the eager route is your module as given: save its state_dict(), or torch.export.save its "
             "torch.export.export(model, args) (torch.export.load unpickles: trusted files only)",
    "torch": "the torch route is your module's class with rewrites and a graph frozen in this process: save "
             "state_dict() and call optimize() again where it runs",
    "inductor": "inductor's compiled code is built for this process and not serialized here: save state_dict() "
                "and call optimize() again where it runs",
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
          "bool": torch.bool}


class SavedModelError(ValueError):
    """A model that is not saved or not loaded; the message names the path and the problem."""


class Saveable:
    """What :func:`save_optimized` needs, kept on the module ``optimize`` returns (the engine's
    files are held in memory: the ONNX model or the IR, as big as the weights)."""

    def __init__(self, route: str, files: dict[str, bytes], sample: Any, dtype: str) -> None:
        self.route = route
        self.files = dict(files)
        self.dtype = dtype
        self.inputs = [_input_entry(spec) for spec in sample.spec]
        self.outputs = _dumps_structure(sample.treespec)
        self.output_dtypes = [None if d is None else str(d).removeprefix("torch.")
                              for d in _float_dtypes(sample.outputs)]


def _input_entry(spec: tuple) -> dict[str, Any]:
    if spec[0] == "T":
        _, dtype, _, shape, batched = spec
        return {"tensor": True, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape), "batched": batched}
    return {"tensor": False, "type": spec[1], "repr": spec[2]}


def _dumps_structure(treespec: Any) -> Optional[str]:
    try:
        return pytree.treespec_dumps(treespec)
    except Exception:   # a structure pytree cannot write as JSON (a custom node): saving says so
        return None


def _float_dtypes(value: Any) -> list[Optional[torch.dtype]]:
    return [leaf.dtype if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else None
            for leaf in pytree.tree_leaves(value)]


class SaveMethod:
    """``module.save(path)``: :func:`save_optimized` of the module (picklable, as the module is)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, path: str) -> str:
        return save_optimized(self.module, path)


def keep(module: nn.Module, saveable: Saveable) -> None:
    """Attach ``saveable`` and, unless the module has its own ``save``, ``module.save(path)``."""
    module.__dict__[SAVED_ATTRIBUTE] = saveable
    if not hasattr(module, "save") or isinstance(module.__dict__.get("save"), SaveMethod):
        module.__dict__["save"] = SaveMethod(module)


def save_optimized(model: nn.Module, path: str) -> str:
    """Write what ``optimize(..., backend=...)`` kept for ``model`` to the new directory ``path``
    (see the module docstring); returns the path. :class:`SavedModelError` when it cannot."""
    saveable = model.__dict__.get(SAVED_ATTRIBUTE) if isinstance(model, nn.Module) else None
    if not isinstance(saveable, Saveable):
        raise SavedModelError("save: not a model returned by optimize(..., backend=...) with an engine route "
                              "(nothing engine-specific to save)")
    if saveable.route in REFUSED:
        raise SavedModelError(f"save: the route kept is {saveable.route}; {REFUSED[saveable.route]}")
    if not saveable.files:
        raise SavedModelError(f"save: the {saveable.route} route kept no files to save")
    if saveable.outputs is None:
        raise SavedModelError("save: the model's output structure holds a type torch.utils._pytree cannot write")
    target = os.path.abspath(os.fspath(path))
    if os.path.lexists(target):
        raise SavedModelError(f"save: {target} exists (a symlink is never followed); choose a new path")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise SavedModelError(f"save: {parent} is not a directory")
    report = model.__dict__.get("_xlaunch_engine_report")
    manifest = {"format": FORMAT, "route": saveable.route, "dtype": saveable.dtype, "inputs": saveable.inputs,
                "outputs": saveable.outputs, "output_dtypes": saveable.output_dtypes,
                "model": type(model).__qualname__, "versions": disk.library_versions(),
                "report": report.to_dict() if isinstance(report, EngineReport) else None,
                "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                          for name, data in saveable.files.items()}}
    temporary = os.path.join(parent, f".{os.path.basename(target)}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(temporary, 0o755)
        for name, data in saveable.files.items():
            disk.write_new(os.path.join(temporary, name), data)
        disk.write_new(os.path.join(temporary, MANIFEST), json.dumps(manifest, indent=1).encode("utf-8"))
        if os.path.lexists(target):
            raise SavedModelError(f"save: {target} appeared while saving; not replaced")
        os.rename(temporary, target)
    except OSError as exc:
        raise SavedModelError(f"save: cannot write {target}: {exc.strerror or exc}") from None
    finally:
        if os.path.lexists(temporary):
            shutil.rmtree(temporary, ignore_errors=True)
    return target


def _read(path: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SavedModelError(f"load_optimized: {path}: not a directory saved by save_optimized "
                              f"({exc.strerror or exc}; symlinks are not followed)") from None
    try:
        try:
            manifest = json.loads(disk.read_regular(dir_fd, MANIFEST, disk.MAX_ENTRY_BYTES).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise disk.CorruptEntry(f"{MANIFEST} is not valid JSON ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise disk.CorruptEntry(f"{MANIFEST} is not a manifest of format {FORMAT}")
        declared = manifest.get("files")
        if not isinstance(declared, dict) or not declared:
            raise disk.CorruptEntry(f"{MANIFEST} lists no files")
        files = {}
        for name, meta in declared.items():
            if not isinstance(name, str) or os.sep in name or name in (".", "..", MANIFEST) or not isinstance(meta, dict):
                raise disk.CorruptEntry(f"{MANIFEST} names a bad file {name!r}")
            size = meta.get("size")
            if not isinstance(size, int) or not 0 <= size <= disk.MAX_ARTIFACT:
                raise disk.CorruptEntry(f"{name}: bad size {size!r}")
            content = disk.read_regular(dir_fd, name, size)
            if len(content) != size or hashlib.sha256(content).hexdigest() != meta.get("sha256"):
                raise disk.CorruptEntry(f"{name} is truncated or changed (size or sha256 differ from the manifest)")
            files[name] = content
        return manifest, files
    except disk.CorruptEntry as exc:
        raise SavedModelError(f"load_optimized: {path}: {exc}") from None
    finally:
        os.close(dir_fd)


class Signature:
    """The saved input signature and output structure: what the runners need of a sample."""

    def __init__(self, manifest: dict[str, Any], path: str) -> None:
        try:
            self.inputs = list(manifest["inputs"])
            self.tensor_positions = tuple(i for i, entry in enumerate(self.inputs) if entry["tensor"])
            self.dtypes = {i: DTYPES[self.inputs[i]["dtype"]] for i in self.tensor_positions}
            self.treespec = pytree.treespec_loads(manifest["outputs"])
            self.output_dtypes = [None if d is None else DTYPES[d] for d in manifest["output_dtypes"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SavedModelError(f"load_optimized: {path}: {MANIFEST} has a bad signature "
                                  f"({type(exc).__name__}: {exc})") from None

    def check(self, args: tuple) -> None:
        if len(args) != len(self.inputs):
            raise ValueError(f"the saved model takes {len(self.inputs)} positional argument(s), not {len(args)}")
        for position, (arg, entry) in enumerate(zip(args, self.inputs)):
            if not entry["tensor"]:
                if type(arg).__name__ != entry["type"] or repr(arg) != entry["repr"]:
                    raise ValueError(f"argument {position} must be {entry['repr']} (the sample's value, fixed "
                                     f"in the export), not {arg!r}")
                continue
            shape = list(arg.shape[1:] if entry["batched"] else arg.shape) if isinstance(arg, torch.Tensor) else None
            if shape != entry["shape"] or arg.dtype != self.dtypes[position]:
                want = ["N", *entry["shape"]] if entry["batched"] else entry["shape"]
                raise ValueError(f"argument {position} must be a {entry['dtype']} tensor of shape {want}")

    def tensors(self, args: tuple) -> list[torch.Tensor]:
        return [args[i] for i in self.tensor_positions]

    def structure(self, flat: list[torch.Tensor]) -> Any:
        flat = [t.to(d) if d is not None and t.is_floating_point() and t.dtype != d else t
                for t, d in zip(flat, self.output_dtypes)]
        return pytree.tree_unflatten(list(flat), self.treespec)


class LoadedModel(nn.Module):
    """A saved engine: ``model(*args)`` as the optimized model answered (same structure); the
    manifest as ``.manifest``, the report as ``.report``."""

    def __init__(self, runner: Any, signature: Signature, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.runner = runner
        self.signature = signature
        self.manifest = manifest
        self.route = manifest["route"]
        report = manifest.get("report")
        self.report = EngineReport.from_dict(report) if isinstance(report, dict) else None
        self.eval()

    def forward(self, *args: Any) -> Any:
        self.signature.check(args)
        with torch.no_grad():
            return self.runner(*args)


def load_optimized(path: str, threads: Optional[int] = None) -> LoadedModel:
    """The model :func:`save_optimized` wrote to ``path``, on its engine, with ``threads`` threads
    (default: torch's). :class:`SavedModelError` for a path that is not one, or damaged."""
    shown = os.path.abspath(os.fspath(path))
    manifest, files = _read(shown)
    route = manifest.get("route")
    if route not in SAVABLE:
        raise SavedModelError(f"load_optimized: {shown}: unknown route {route!r}")
    missing = missing_module((route, "onnx") if route == "onnxruntime" else (route,), PIP_LINES.get(route))
    if missing:
        raise SavedModelError(f"load_optimized: {shown}: the saved model runs on {route}, and {missing}")
    signature = Signature(manifest, shown)
    threads = torch.get_num_threads() if threads is None else threads
    try:
        if route == "onnxruntime":
            from xlaunch.kernels.optimize.engines.routes.onnxruntime_route import (ARTIFACT, SessionRunner,
                                                                                  external_data_tensor)

            external = external_data_tensor(files[ARTIFACT])
            if external is not None:
                raise SavedModelError(f"load_optimized: {shown}: {ARTIFACT} reads tensor {external!r} from "
                                      "another file (external data): refused, only the saved files are read")
            runner: Any = SessionRunner(files[ARTIFACT], signature, threads)
        else:
            from xlaunch.kernels.optimize.engines.routes.openvino_route import WEIGHTS, XML, load_runner

            runner = load_runner(files[XML], files[WEIGHTS], signature, threads, DTYPES.get(manifest.get("dtype")))
    except SavedModelError:
        raise
    except KeyError as exc:
        raise SavedModelError(f"load_optimized: {shown}: {MANIFEST} does not list {exc}") from None
    except Exception as exc:
        raise SavedModelError(f"load_optimized: {shown}: {route} cannot load it ({error_line(exc)})") from None
    return LoadedModel(runner, signature, manifest)
