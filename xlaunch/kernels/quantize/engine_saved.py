"""What a saved ``onnxruntime_static`` or ``openvino_static`` model holds, and how it runs again.

:mod:`.saved` writes and reads the archive (one zip file, stored entries: the manifest
``xlaunch-quantize.json`` and the engine's own files); this module knows the engines:

  * the files: ``model.onnx`` (the QDQ model ONNX Runtime runs) or ``model.xml`` + ``model.bin``
    (the OpenVINO IR after NNCF), taken from the quantized model's runner (:func:`payload`);
  * the signature the manifest records (:class:`Signature`): each argument a tensor (dtype, shape,
    ``null`` for the batch dimension) or a plain JSON value baked into the export, and the output
    structure (``torch.utils._pytree``'s JSON treespec), so the loaded model takes and returns
    what the original did without the model's class;
  * loading: the engine must import (else one ``ImportError`` naming the extra), an ONNX model
    may not point at external data files (that would read files outside the archive), and the
    session or compiled model is built from bytes, never from a path.
"""
from __future__ import annotations

from typing import Any, Optional

from xlaunch._errors import error_line
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch.utils import _pytree as pytree

ENGINES = {"onnxruntime_static": "onnxruntime", "openvino_static": "openvino"}
FILES = {"onnxruntime": ("model.onnx",), "openvino": ("model.xml", "model.bin")}
NEEDS = {"onnxruntime": ("onnxruntime", "onnx"), "openvino": ("openvino",)}
VERSIONED = {"torch": ("torch", "torchao"), "onnxruntime": ("torch", "onnxruntime", "onnx"),
             "openvino": ("torch", "openvino", "nncf")}
EXTRA = {"onnxruntime": 'pip install "xlaunch[onnxruntime]"', "openvino": 'pip install "xlaunch[openvino]"'}
TITLE = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}
PLAIN_VALUES = (type(None), bool, int, float, str)


def versions(engine: str) -> dict[str, str]:
    """The library versions a saved model records (``-`` for one not installed)."""
    from importlib import metadata

    from xlaunch import __version__

    found = {"xlaunch": __version__}
    for package in VERSIONED.get(engine, ()):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "-"
    return found


# --- the signature ---------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Outputs with named tuples as tuples and ordered dicts as dicts (what a treespec can name
    without the model's classes)."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _outputs_spec(outputs: Any) -> Optional[str]:
    """The outputs' treespec as JSON; named tuples become tuples; None when the structure cannot
    be written (a custom pytree node): the loaded model then returns a tuple of the tensors."""
    leaves, spec = pytree.tree_flatten(outputs)
    try:
        return pytree.treespec_dumps(spec)
    except Exception:
        pass
    plain_leaves, plain_spec = pytree.tree_flatten(_plain(outputs))
    if len(plain_leaves) == len(leaves) and all(a is b for a, b in zip(plain_leaves, leaves)):
        try:
            return pytree.treespec_dumps(plain_spec)
        except Exception:
            pass
    return None


def signature_of(sample: Any) -> dict[str, Any]:
    """The manifest's ``inputs``/``outputs``/``output_count`` for an engine's build-time sample."""
    inputs: list[dict[str, Any]] = []
    for arg, batched in zip(sample.args, sample.batched):
        if isinstance(arg, torch.Tensor):
            shape = [None if batched and i == 0 else int(n) for i, n in enumerate(arg.shape)]
            inputs.append({"dtype": str(arg.dtype).removeprefix("torch."), "shape": shape})
        else:
            inputs.append({"value": arg})
    return {"inputs": inputs, "outputs": _outputs_spec(sample.outputs), "output_count": sample.output_count}


class Signature:
    """What a loaded engine model takes and returns (read back from the manifest); used where
    the build-time :class:`..optimize.engines.sample.Sample` was (``tensors``, ``structure``)."""

    def __init__(self, saved: dict[str, Any]) -> None:
        inputs, count = saved.get("inputs"), saved.get("output_count")
        if not isinstance(inputs, list) or not inputs or not isinstance(count, int) or count < 1:
            raise ValueError("no input signature")
        self.saved = {"inputs": inputs, "outputs": saved.get("outputs"), "output_count": count}
        self.tensor_positions: list[int] = []
        self.specs: list[Any] = []   # (dtype, shape with None for the batch) or ("value", v)
        for position, entry in enumerate(inputs):
            if isinstance(entry, dict) and set(entry) == {"dtype", "shape"}:
                dtype = getattr(torch, str(entry["dtype"]), None)
                shape = entry["shape"]
                if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(
                        n is None or (isinstance(n, int) and n >= 0) for n in shape):
                    raise ValueError(f"input {position} is not a tensor spec")
                self.tensor_positions.append(position)
                self.specs.append((dtype, shape))
            elif isinstance(entry, dict) and set(entry) == {"value"} and isinstance(entry["value"], PLAIN_VALUES):
                self.specs.append(("value", entry["value"]))
            else:
                raise ValueError(f"input {position} is neither a tensor spec nor a plain value")
        if not self.tensor_positions:
            raise ValueError("no tensor input")
        self.count = count
        self.treespec = None
        if saved.get("outputs") is not None:
            try:
                self.treespec = pytree.treespec_loads(str(saved["outputs"]))
            except Exception as exc:
                raise ValueError(f"the output structure does not read back ({type(exc).__name__})") from None
            if self.treespec.num_leaves != count:
                raise ValueError("the output structure does not match the output count")

    def describe(self) -> str:
        parts = []
        for spec in self.specs:
            if spec[0] == "value":
                parts.append(repr(spec[1]))
            else:
                dims = ",".join("N" if n is None else str(n) for n in spec[1])
                parts.append(f"{str(spec[0]).removeprefix('torch.')}[{dims}]")
        return "(" + ", ".join(parts) + ")"

    def mismatch(self, args: tuple) -> Optional[str]:
        """Why ``args`` is not a call this model serves, or None."""
        if len(args) != len(self.specs):
            return f"takes {len(self.specs)} argument(s) {self.describe()}, got {len(args)}"
        for position, (arg, spec) in enumerate(zip(args, self.specs)):
            if spec[0] == "value":
                if type(arg) is not type(spec[1]) or arg != spec[1]:
                    return f"argument {position} was exported as {spec[1]!r}, got {arg!r}"
                continue
            dtype, shape = spec
            if not isinstance(arg, torch.Tensor) or arg.dtype != dtype or arg.dim() != len(shape) or any(
                    n is not None and n != m for n, m in zip(shape, arg.shape)) or arg.device.type != "cpu":
                dims = ",".join(str(n) for n in arg.shape) if isinstance(arg, torch.Tensor) else ""
                got = (f"{str(arg.dtype).removeprefix('torch.')}[{dims}] on {arg.device.type}"
                       if isinstance(arg, torch.Tensor) else type(arg).__name__)
                return f"takes {self.describe()}; argument {position} is {got}"
        return None

    def tensors(self, args: tuple) -> list[torch.Tensor]:
        return [args[i] for i in self.tensor_positions]

    def structure(self, flat: list[torch.Tensor]) -> Any:
        if self.treespec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return pytree.tree_unflatten(list(flat), self.treespec)


# --- saving ----------------------------------------------------------------------------------

def payload(mode: str, runner: Any) -> tuple[dict[str, bytes], dict[str, Any]]:
    """(the engine's files, the signature) of a quantized model's runner: one built by
    :mod:`.engine_routes` or one loaded by :func:`load`."""
    saved = getattr(runner, "xlaunch_saved", None)
    if saved is not None:   # loaded from a file: its files and signature as read
        return saved
    sample = getattr(runner, "sample", None)
    if ENGINES[mode] == "onnxruntime" and isinstance(getattr(runner, "model_bytes", None), bytes):
        files = {"model.onnx": runner.model_bytes}
    elif ENGINES[mode] == "openvino" and getattr(runner, "ov_model", None) is not None:
        from xlaunch.kernels.optimize.engines.routes import openvino_route

        files = openvino_route.serialize(runner.ov_model)
    else:
        raise ValueError(f"save: this {mode} model holds no {TITLE[ENGINES[mode]]} model to save "
                         "(it was not built by quantize or load_quantized)")
    if sample is None:
        raise ValueError(f"save: this {mode} model has no input signature to save")
    return files, signature_of(sample)


# --- loading ---------------------------------------------------------------------------------

def check_installed(name: str, mode: str) -> None:
    """One ImportError naming the extra when the engine ``mode`` runs on cannot be imported."""
    engine = ENGINES[mode]
    for module in NEEDS[engine]:
        try:
            __import__(module)
        except ImportError:
            raise ImportError(f"load_quantized: {name} is a {mode} model and runs on {TITLE[engine]}, "
                              f"which is not installed here ({module} does not import): "
                              f"{EXTRA[engine]}") from None


class Loaded:
    """A loaded engine model: checks each call against the signature, then runs the engine."""

    def __init__(self, runner: Any, signature: Signature, files: dict[str, bytes], label: str) -> None:
        self.runner = runner
        self.signature = signature
        self.label = label
        self.xlaunch_saved = (files, signature.saved)

    def __call__(self, *args: Any) -> Any:
        problem = self.signature.mismatch(args)
        if problem is not None:
            raise ValueError(f"{self.label}: {problem}")
        return self.runner(*args)


def load(name: str, mode: str, manifest: dict[str, Any], files: dict[str, bytes], threads: int) -> Loaded:
    """The runnable model from the files read back (:func:`check_installed` passed already)."""
    corrupt = f"load_quantized: {name} is corrupt"
    try:
        signature = Signature(manifest)
    except ValueError as exc:
        raise ValueError(f"{corrupt}: its manifest's signature: {exc}") from None
    engine = ENGINES[mode]
    saved_with = manifest.get("versions") if isinstance(manifest.get("versions"), dict) else {}
    here = versions(engine)
    try:
        if engine == "onnxruntime":
            from xlaunch.kernels.optimize.engines.routes import onnxruntime_route

            model = files["model.onnx"]
            external = onnxruntime_route.external_data_tensor(model)
            if external is not None:
                raise ValueError(f"load_quantized: {name} is refused: its ONNX model reads tensor {external!r} "
                                 "from an external file (a saved model holds all its data)")
            runner: Any = onnxruntime_route.SessionRunner(model, signature, threads)
        else:
            from xlaunch.kernels.optimize.engines.routes import openvino_route

            ov = openvino_route.import_openvino()

            ov_model = ov.Core().read_model(model=files["model.xml"], weights=files["model.bin"])
            # as engine_routes.build_openvino compiles it: the threads, the latency hint, the
            # plugin's default precision for what NNCF left in float
            config = {"INFERENCE_NUM_THREADS": max(1, threads), "PERFORMANCE_HINT": "LATENCY"}
            runner = openvino_route.CompiledRunner(ov_model, signature, threads, config=config)
    except ValueError:
        raise
    except Exception as exc:
        was = ", ".join(f"{k} {v}" for k, v in saved_with.items() if here.get(k) != v and k != "xlaunch")
        raise ValueError(f"{corrupt}: {TITLE[engine]} cannot load its model ({error_line(exc, 200)})"
                         + (f"; saved with {was}" if was else "")) from None
    count = len(runner.session.get_outputs()) if engine == "onnxruntime" else len(runner.outputs)
    if count != signature.count:
        raise ValueError(f"{corrupt}: its model has {count} output(s), its manifest {signature.count}")
    return Loaded(runner, signature, files, f"{mode} model {name}")
