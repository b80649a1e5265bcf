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
"""
from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

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


def convert(model: nn.Module, sample: Sample) -> Any:
    """The model as an ``openvino.Model``, every batched input's dimension 0 dynamic."""
    avoid_deepbind_crash()
    import openvino as ov

    flat = FlatOutputs(model, sample).eval()
    tensors = tuple(sample.tensors(sample.args))
    batched = [sample.batched[i] for i in sample.tensor_positions]
    shapes = [[-1, *t.shape[1:]] if is_batched else list(t.shape) for t, is_batched in zip(tensors, batched)]
    with tracing_for_export():
        return ov.convert_model(flat, example_input=tensors, input=shapes)


def serialize(ov_model: Any) -> dict[str, bytes]:
    """The IR files' bytes (written to a private temporary folder, read back, removed)."""
    import openvino as ov

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
        avoid_deepbind_crash()
        import openvino as ov

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
    avoid_deepbind_crash()
    import openvino as ov

    ov_model = ov.Core().read_model(model=xml, weights=weights)
    return CompiledRunner(ov_model, sample, threads, dtype)
