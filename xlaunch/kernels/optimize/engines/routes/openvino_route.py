"""The ``openvino`` route: ``openvino.convert_model`` of the model (its PyTorch frontend, batch
dimension dynamic), compiled for the CPU with this process's thread count, fp32 precision and the
latency hint.

OpenVINO's ``torch.compile`` backend fails on torch 2.13 at the first compilation ("sources must
not be empty for symbol ..."), so the model is converted whole. The CPU plugin would run fp32
models in bf16 on CPUs with native bf16 (its default precision hint there); the route pins the
precision asked for (:func:`compile_config`): f32 for fp32, so its numbers are the model's, and
bf16/f16 for ``optimize(dtype=torch.bfloat16/float16)`` (:mod:`.lowp`). The artifacts cached are the IR (``model.xml`` + ``model.bin``), read
back from bytes the cache has checked.

With an allocator preloaded (``LD_PRELOAD`` of jemalloc or tcmalloc, as ``xlaunch`` does by
default) OpenVINO 2026.4 aborts the process at its first compile ("free(): invalid pointer"):
oneTBB loads its hwloc binding with ``RTLD_DEEPBIND``, so hwloc frees with glibc's ``free`` what
libc allocated through the preloaded ``malloc`` (oneTBB #1645, OpenVINO #29025). oneTBB's own
switch ``TBB_ENABLE_SANITIZERS=1`` drops that flag; it is set (unless the user set it) before
OpenVINO is first used in such a process.

OpenVINO (at ``import openvino`` and in every ``convert_model``) and NNCF (in ``nncf.quantize``) send
usage telemetry to Google Analytics and write a client ID under ``~/intel`` unless the user opted out
or a CI variable is set: every event forks this (multi-threaded, often multi-GB) process and waits up
to 3 s for the send (OpenVINO 2026.4: 0.6 s per conversion of a small model on an AVX2 VM without
internet, 0.04 s without). xlaunch sends none: it imports both with the ``openvino_telemetry`` package
hidden (:func:`import_openvino`, :func:`import_nncf`), so that they take the path they take without it
(OpenVINO's converter stub, NNCF's ``NNCFTelemetryStub``) for this process; where the user imported them
first, xlaunch's own calls run with their telemetry silenced (:func:`telemetry_off`) and the user's are
left alone.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import threading
from typing import Any, Iterator

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize.engines import lowp
from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.sample import FlatOutputs, Sample, tracing_for_export

XML, WEIGHTS = "model.xml", "model.bin"
DEEPBIND_SWITCH = "TBB_ENABLE_SANITIZERS"
ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "tbbmalloc_proxy")
TELEMETRY_PACKAGE = "openvino_telemetry"   # OpenVINO's and NNCF's usage telemetry


def allocator_preloaded() -> bool:
    """Whether a malloc replacement is interposed (preloaded, or mapped into this process)."""
    if any(name in entry for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
           for name in ALLOCATORS):
        return True
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any(name in line for line in maps for name in ALLOCATORS[:3])
    except OSError:
        return False


def avoid_deepbind_crash() -> None:
    """``TBB_ENABLE_SANITIZERS=1`` when an allocator is interposed (see the module docstring)."""
    if DEEPBIND_SWITCH not in os.environ and allocator_preloaded():
        os.environ[DEEPBIND_SWITCH] = "1"


class _Silent:
    """A telemetry object whose every method sends nothing (``Telemetry()`` of it is itself)."""

    def __call__(self, *args: Any, **kwargs: Any) -> "_Silent":
        return self

    def __getattr__(self, name: str) -> "_Silent":
        return self


_SILENT = _Silent()
_ABSENT = object()
_telemetry_lock = threading.Lock()
_telemetry_depth = 0
_telemetry_saved: list[tuple[Any, str, Any]] = []


def _telemetry_hooks() -> list[tuple[Any, str]]:
    """(object, attribute) through which OpenVINO's converter and NNCF reach their telemetry, as far as
    they are imported: the converter modules' ``tm`` (the ``openvino_telemetry`` module; the stub
    OpenVINO falls back to without it is :class:`_Silent`'s equal; ``utils`` sends conversion errors'
    FAQ numbers) and NNCF's ``telemetry._impl``."""
    hooks: list[tuple[Any, str]] = []
    for name in ("openvino.tools.ovc.convert_impl", "openvino.tools.ovc.telemetry_utils", "openvino.tools.ovc.utils"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "tm"):
            hooks.append((module, "tm"))
    wrapper = sys.modules.get("nncf.telemetry.wrapper")
    telemetry = getattr(wrapper, "telemetry", None)
    if telemetry is not None and hasattr(telemetry, "_impl"):
        hooks.append((telemetry, "_impl"))
    return hooks


def _import_without_telemetry(name: str) -> Any:
    """``name`` imported; when this imports it first, with :data:`TELEMETRY_PACKAGE` unimportable meanwhile."""
    if name not in sys.modules:
        with _telemetry_lock:
            if name not in sys.modules:
                hidden = sys.modules.get(TELEMETRY_PACKAGE, _ABSENT)
                sys.modules[TELEMETRY_PACKAGE] = None   # type: ignore[assignment] - importing it raises ImportError
                try:
                    importlib.import_module(name)
                finally:
                    if hidden is _ABSENT:
                        sys.modules.pop(TELEMETRY_PACKAGE, None)
                    else:
                        sys.modules[TELEMETRY_PACKAGE] = hidden
    return sys.modules[name]


def import_openvino() -> Any:
    """``openvino``, ready for this process (:func:`avoid_deepbind_crash`), its telemetry off when first imported here."""
    avoid_deepbind_crash()
    return _import_without_telemetry("openvino")


def import_nncf() -> Any:
    """``nncf``, its telemetry off when first imported here (OpenVINO's first, as NNCF imports it)."""
    import_openvino()
    return _import_without_telemetry("nncf")


@contextlib.contextmanager
def telemetry_off() -> Iterator[None]:
    """The usage telemetry of OpenVINO and NNCF as imported (:func:`import_openvino`, :func:`import_nncf`)
    silenced inside (reentrant, across threads: the first to enter silences, the last to leave restores
    what was there)."""
    global _telemetry_depth
    with _telemetry_lock:
        if _telemetry_depth == 0:
            _telemetry_saved[:] = [(owner, attribute, getattr(owner, attribute)) for owner, attribute in _telemetry_hooks()]
            for owner, attribute, _ in _telemetry_saved:
                setattr(owner, attribute, _SILENT)
        _telemetry_depth += 1
    try:
        yield
    finally:
        with _telemetry_lock:
            _telemetry_depth -= 1
            if _telemetry_depth == 0:
                for owner, attribute, value in reversed(_telemetry_saved):
                    setattr(owner, attribute, value)
                _telemetry_saved.clear()


def convert(model: nn.Module, sample: Sample) -> Any:
    """The model as an ``openvino.Model``, every batched input's dimension 0 dynamic."""
    ov = import_openvino()

    flat = FlatOutputs(model, sample).eval()
    tensors = tuple(sample.tensors(sample.args))
    batched = [sample.batched[i] for i in sample.tensor_positions]
    shapes = [[-1, *t.shape[1:]] if is_batched else list(t.shape) for t, is_batched in zip(tensors, batched)]
    with tracing_for_export(), telemetry_off():
        return ov.convert_model(flat, example_input=tensors, input=shapes)


def serialize(ov_model: Any) -> dict[str, bytes]:
    """The IR files' bytes (written to a private temporary folder, read back, removed)."""
    ov = import_openvino()

    with tempfile.TemporaryDirectory(prefix="xlaunch-ov-") as folder:
        xml = os.path.join(folder, XML)
        ov.save_model(ov_model, xml, compress_to_fp16=False)
        files = {}
        for name in (XML, WEIGHTS):
            with open(os.path.join(folder, name), "rb") as handle:
                files[name] = handle.read()
    return files


def compile_config(threads: int, dtype: Any = None) -> dict[str, Any]:
    """The CPU plugin's configuration: threads, latency hint and the precision pinned."""
    return {"INFERENCE_NUM_THREADS": max(1, threads), "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": lowp.openvino_hint(dtype)}


class CompiledRunner:
    """One compiled model; one infer request per calling thread (a request is not thread-safe).
    Outputs are copied out of the request's buffers, which the next inference overwrites."""

    def __init__(self, ov_model: Any, sample: Sample, threads: int, dtype: Any = None,
                 config: Any = None) -> None:
        ov = import_openvino()

        config = compile_config(threads, dtype) if config is None else config
        self.compiled = ov.Core().compile_model(ov_model, "CPU", config)
        self.outputs = list(self.compiled.outputs)
        self.sample = sample
        self._local = threading.local()

    def __call__(self, *args: Any) -> Any:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        inputs = [tensor.detach().contiguous().numpy() for tensor in self.sample.tensors(args)]
        results = request.infer(inputs)
        return self.sample.structure([torch.from_numpy(results[out].copy()) for out in self.outputs])


class OpenVinoRoute(Route):
    name = "openvino"
    needs = ("openvino",)
    cached_files = True

    def build(self, model: nn.Module, sample: Sample, context: Context) -> Built:
        ov_model = convert(model, sample)
        files = serialize(ov_model)
        return Built(CompiledRunner(ov_model, sample, context.threads, context.dtype), files=files)

    def load(self, model: nn.Module, sample: Sample, context: Context, files: dict[str, bytes],
             state: dict[str, Any]) -> Built:
        return Built(load_runner(files[XML], files[WEIGHTS], sample, context.threads, context.dtype), files=files)


def load_runner(xml: bytes, weights: bytes, sample: Any, threads: int, dtype: Any = None) -> CompiledRunner:
    """A runner from the IR's bytes (the cache's or a saved model's, already checked)."""
    ov = import_openvino()

    ov_model = ov.Core().read_model(model=xml, weights=weights)
    return CompiledRunner(ov_model, sample, threads, dtype)
