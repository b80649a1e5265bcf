"""The ``openvino`` route: ``openvino.convert_model`` of the model (its PyTorch frontend, batch
dimension dynamic), compiled for the CPU with this process's thread count, fp32 precision and the
latency hint.

OpenVINO's ``torch.compile`` backend fails on torch 2.13 at the first compilation ("sources must
not be empty for symbol ..."), so the model is converted whole. The CPU plugin would run fp32
models in bf16 on CPUs with native bf16 (its default precision hint there); the route pins f32 so
its numbers are the model's. The artifacts cached are the IR (``model.xml`` + ``model.bin``), read
back from bytes the cache has checked.
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

from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.sample import FlatOutputs, Sample, tracing_for_export

XML, WEIGHTS = "model.xml", "model.bin"


def convert(model: nn.Module, sample: Sample) -> Any:
    """The model as an ``openvino.Model``, every batched input's dimension 0 dynamic."""
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


class CompiledRunner:
    """One compiled model; one infer request per calling thread (a request is not thread-safe).
    Outputs are copied out of the request's buffers, which the next inference overwrites."""

    def __init__(self, ov_model: Any, sample: Sample, threads: int) -> None:
        import openvino as ov

        config = {"INFERENCE_NUM_THREADS": max(1, threads), "PERFORMANCE_HINT": "LATENCY",
                  "INFERENCE_PRECISION_HINT": "f32"}
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
        return Built(CompiledRunner(ov_model, sample, context.threads), files=files)

    def load(self, model: nn.Module, sample: Sample, context: Context, files: dict[str, bytes],
             state: dict[str, Any]) -> Built:
        import openvino as ov

        ov_model = ov.Core().read_model(model=files[XML], weights=files[WEIGHTS])
        return Built(CompiledRunner(ov_model, sample, context.threads), files=files)
