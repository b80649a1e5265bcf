"""The ``onnxruntime`` route: ``torch.onnx.export`` (the TorchScript exporter, batch dimension
dynamic) and an ``onnxruntime.InferenceSession`` on the CPU with this process's thread count.

torch 2.13 has no ``onnxrt`` compile backend, and the torch.export-based exporter needs
onnxscript and fails on more models here, so the TorchScript exporter it is (its deprecation
notice is not repeated to users). The artifact cached is the ``.onnx`` file; the session is
created from its bytes (already read and checked by the cache), never from a path.
"""
from __future__ import annotations

import io
from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.sample import FlatOutputs, Sample, tracing_for_export

ARTIFACT = "model.onnx"
QUIET = 3   # onnxruntime's log severity: errors only (its warnings about initializers are noise)


def export_onnx(model: nn.Module, sample: Sample) -> bytes:
    """The model as ONNX bytes, every batched input's dimension 0 dynamic."""
    flat = FlatOutputs(model, sample).eval()
    tensors = tuple(sample.tensors(sample.args))
    batched = [sample.batched[i] for i in sample.tensor_positions]
    names = [f"input_{i}" for i in range(len(tensors))]
    dynamic = {name: {0: "batch"} for name, is_batched in zip(names, batched) if is_batched}
    buffer = io.BytesIO()
    with tracing_for_export():
        torch.onnx.export(flat, tensors, buffer, dynamo=False, input_names=names,
                          output_names=[f"output_{i}" for i in range(sample.output_count)],
                          dynamic_axes=dynamic or None, do_constant_folding=True)
    return buffer.getvalue()


class SessionRunner:
    """Calls the session with the call's tensors; outputs come back in the model's structure."""

    def __init__(self, model_bytes: bytes, sample: Sample, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        options.log_severity_level = QUIET
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle threads sleep instead of spinning: spinning cost ResNet-50 nothing here but slowed
        # the next torch call 1.1-1.7x (its OpenMP threads waited for the CPUs); see docs/kernels.md.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        self.names = [node.name for node in self.session.get_inputs()]
        self.sample = sample

    def __call__(self, *args: Any) -> Any:
        feeds = {name: tensor.detach().contiguous().numpy()
                 for name, tensor in zip(self.names, self.sample.tensors(args))}
        outputs = self.session.run(None, feeds)
        return self.sample.structure([torch.from_numpy(out) for out in outputs])


class OnnxRuntimeRoute(Route):
    name = "onnxruntime"
    needs = ("onnxruntime",)
    cached_files = True

    def build(self, model: nn.Module, sample: Sample, context: Context) -> Built:
        model_bytes = export_onnx(model, sample)
        return Built(SessionRunner(model_bytes, sample, context.threads), files={ARTIFACT: model_bytes})

    def load(self, model: nn.Module, sample: Sample, context: Context, files: dict[str, bytes],
             state: dict[str, Any]) -> Built:
        return Built(SessionRunner(files[ARTIFACT], sample, context.threads), files=files)


def external_data_tensor(model_bytes: bytes) -> Optional[str]:
    """The name of the first tensor of a serialized ONNX model whose data would be read from another
    file, or None. A saved model must hold all its data: ONNX Runtime resolves an external path
    itself, outside whatever folder or archive the model came from. Parsing bytes never loads
    external data. Subgraphs (If/Loop bodies), sparse initializers and functions are searched too."""
    import onnx

    model = onnx.ModelProto.FromString(model_bytes)

    def graphs(graph: Any) -> Any:
        yield graph
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    yield from graphs(attribute.g)
                for sub in attribute.graphs:
                    yield from graphs(sub)

    def tensors(graph: Any) -> Any:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors

    for graph in graphs(model.graph):
        for tensor in tensors(graph):
            if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.external_data):
                return tensor.name or "(unnamed)"
    for function in model.functions:
        for node in function.node:
            for attribute in node.attribute:
                if attribute.HasField("t") and attribute.t.data_location == onnx.TensorProto.EXTERNAL:
                    return attribute.t.name or "(unnamed)"
    return None
