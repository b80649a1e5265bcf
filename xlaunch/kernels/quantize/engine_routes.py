"""The INT8 routes on the other engines, built from the same calibration batches as PT2E ``static``:

  * ``openvino_static``: the model converted to OpenVINO (:func:`..optimize.engines.routes.openvino_route.convert`,
    batch dynamic), quantized post-training by NNCF (``nncf.quantize``: every calibration batch, its default
    preset; ``ModelType.TRANSFORMER`` was measured at 0.31 relative error on a 1-layer encoder the
    default keeps at 0.017), and compiled for the CPU with this process's threads. Operators NNCF leaves in float run
    at OpenVINO's default precision: bf16 on a CPU with native bf16 (AVX512_BF16, AMX), else f32.
  * ``onnxruntime_static``: the ONNX export of :mod:`..optimize.engines.routes.onnxruntime_route`,
    ``onnxruntime.quantization.quantize_static`` in QDQ format, weights per channel (s8),
    activations u8 (7-bit ``reduce_range`` where the CPU has no VNNI/AMX), MinMax calibration on
    every calibration batch; run by ONNX Runtime's CPU provider (which fuses the QDQ pairs into its
    int8 kernels) with spinning off.

Each runner keeps its quantized model (``ov_model``, ``model_bytes``): :meth:`.api.QuantizedModule.save`
writes it (:mod:`.engine_saved`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize.engines.base import missing_module
from xlaunch.kernels.quantize.routes import Built

OPENVINO, ONNXRUNTIME = "openvino_static", "onnxruntime_static"
ROUTES = (OPENVINO, ONNXRUNTIME)
NEEDS = {OPENVINO: ("openvino", "nncf"), ONNXRUNTIME: ("onnxruntime", "onnx")}
PIP = {OPENVINO: "pip install 'xlaunch[openvino]'", ONNXRUNTIME: "pip install 'xlaunch[onnxruntime]'"}


def missing(route: str) -> Optional[str]:
    """Why ``route`` cannot be built here (a library not installed), or None."""
    return missing_module(NEEDS[route], PIP[route])


@contextlib.contextmanager
def quiet() -> Any:
    """The quantizers' chatter kept from the user: NNCF's progress bars (rich, on stdout), its
    logger, ONNX Runtime's advice on the root logger, warnings."""
    loggers = [logging.getLogger(), logging.getLogger("nncf")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _layers(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Linear/Conv2d layers (what both quantizers convert); attention projections are named too
    (NNCF and ONNX Runtime quantize the MatMuls they export to)."""
    names = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return names, {}


def build_openvino(model: nn.Module, example: tuple, calibration: list[tuple], threads: int) -> Built:
    from xlaunch.kernels.optimize.engines.routes import openvino_route
    from xlaunch.kernels.optimize.engines.sample import Sample

    sample = Sample(model, example)
    ov_model = openvino_route.convert(model, sample)
    import nncf
    dataset = nncf.Dataset(calibration, lambda batch: [t.detach().numpy() for t in sample.tensors(batch)])
    with quiet():
        quantized = nncf.quantize(ov_model, dataset, subset_size=len(calibration))
    config = {"INFERENCE_NUM_THREADS": max(1, threads), "PERFORMANCE_HINT": "LATENCY"}   # default precision
    runner = openvino_route.CompiledRunner(quantized, sample, threads, config=config)
    runner.ov_model = quantized   # what QuantizedModule.save writes (.engine_saved)
    names, kept = _layers(model)
    return Built(runner=runner, program_source=model, compiled=False, quantized=names, kept_fp32=kept)


def build_onnxruntime(model: nn.Module, example: tuple, calibration: list[tuple], threads: int,
                      reduce_range: bool) -> Built:
    from onnxruntime import quantization as q

    from xlaunch.kernels.optimize.engines.routes import onnxruntime_route
    from xlaunch.kernels.optimize.engines.sample import Sample

    sample = Sample(model, example)
    model_bytes = onnxruntime_route.export_onnx(model, sample)
    names = [f"input_{i}" for i in range(len(sample.tensor_positions))]
    feeds = [{name: t.detach().contiguous().numpy() for name, t in zip(names, sample.tensors(batch))}
             for batch in calibration]

    class Reader(q.CalibrationDataReader):   # every calibration batch, once
        def __init__(self) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> Optional[dict]:
            return next(self.feeds, None)

    reader = Reader()
    with tempfile.TemporaryDirectory(prefix="xlaunch-ort-int8-") as folder:
        source, target = os.path.join(folder, "model.onnx"), os.path.join(folder, "int8.onnx")
        with open(source, "wb") as handle:
            handle.write(model_bytes)
        with quiet():
            q.quantize_static(source, target, reader, quant_format=q.QuantFormat.QDQ, per_channel=True,
                              reduce_range=reduce_range, activation_type=q.QuantType.QUInt8,
                              weight_type=q.QuantType.QInt8, calibrate_method=q.CalibrationMethod.MinMax)
        with open(target, "rb") as handle:
            quantized = handle.read()
    runner = onnxruntime_route.SessionRunner(quantized, sample, threads)
    runner.model_bytes = quantized   # what QuantizedModule.save writes (.engine_saved)
    layers, kept = _layers(model)
    return Built(runner=runner, program_source=model, compiled=False, quantized=layers, kept_fp32=kept)


def build(route: str, model: nn.Module, example: tuple, calibration: list[tuple], reduce_range: bool) -> Built:
    threads = torch.get_num_threads()
    if route == OPENVINO:
        return build_openvino(model, example, calibration, threads)
    return build_onnxruntime(model, example, calibration, threads, reduce_range)
