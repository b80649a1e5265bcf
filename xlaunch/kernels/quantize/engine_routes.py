"""The INT8 routes on the other engines, built from the same calibration batches as PT2E ``static``:

  * ``openvino_static``: the model converted to OpenVINO (:func:`..optimize.engines.routes.openvino_route.convert`,
    batch dynamic), quantized post-training by NNCF (``nncf.quantize``: every calibration batch, its default
    preset; ``ModelType.TRANSFORMER`` was measured at 0.31 relative error on a 1-layer encoder the
    default keeps at 0.017), and compiled for the CPU with this process's threads. Operators NNCF leaves in float run
    at OpenVINO's default precision: bf16 on a CPU with native bf16 (AVX512_BF16, AMX), else f32.
  * ``onnxruntime_static``: the ONNX export of :mod:`..optimize.engines.routes.onnxruntime_route`,
    ``onnxruntime.quantization.quantize_static`` in QDQ format, weights per channel (s8),
    activations u8 (``reduce_range``, which in ONNX Runtime means 7-bit weights, where the CPU has
    no VNNI/AMX), MinMax calibration on
    every calibration batch; run by ONNX Runtime's CPU provider (which fuses the QDQ pairs into its
    int8 kernels) with spinning off.

Each runner keeps its quantized model (``ov_model``, ``model_bytes``): :meth:`.api.QuantizedModule.save`
writes it (:mod:`.engine_saved`).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize.engines.base import missing_module
from xlaunch.kernels.quantize import capture
from xlaunch.kernels.quantize.routes import Built

OPENVINO, ONNXRUNTIME = "openvino_static", "onnxruntime_static"
ROUTES = (OPENVINO, ONNXRUNTIME)
NEEDS = {OPENVINO: ("openvino", "nncf"), ONNXRUNTIME: ("onnxruntime", "onnx")}
PIP = {OPENVINO: "pip install 'xlaunch[openvino]'", ONNXRUNTIME: "pip install 'xlaunch[onnxruntime]'"}


def missing(route: str) -> Optional[str]:
    """Why ``route`` cannot be built here (a library not installed), or None."""
    return missing_module(NEEDS[route], PIP[route])


def quiet() -> Any:
    """The quantizers' chatter kept from the user (NNCF's progress bars and INFO lines, ONNX Runtime's
    advice on the root logger, their warnings), for this thread only: :func:`.capture.quiet_libraries`."""
    return capture.quiet_libraries()


def _layers(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Linear/Conv2d layers (what both quantizers convert); attention projections are named too
    (NNCF and ONNX Runtime quantize the MatMuls they export to)."""
    names = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return names, {}


def build_openvino(model: nn.Module, example: tuple, calibration: list[tuple], threads: int,
                   overflow_fix: bool) -> Built:
    """``overflow_fix``: every Conv/MatMul weight on half the 8-bit range (NNCF ``OverflowFix.ENABLE``),
    for CPUs whose u8 x s8 sums saturate in 16 bits; else the full range (``DISABLE``)."""
    from xlaunch.kernels.optimize.engines.routes import openvino_route
    from xlaunch.kernels.optimize.engines.sample import Sample

    sample = Sample(model, example)
    ov_model = openvino_route.convert(model, sample)
    nncf = openvino_route.import_nncf()
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    fix = OverflowFix.ENABLE if overflow_fix else OverflowFix.DISABLE
    dataset = nncf.Dataset(calibration, lambda batch: [t.detach().numpy() for t in sample.tensors(batch)])
    with quiet(), openvino_route.telemetry_off():
        quantized = nncf.quantize(ov_model, dataset, subset_size=len(calibration),
                                  advanced_parameters=AdvancedQuantizationParameters(overflow_fix=fix))
    config = {"INFERENCE_NUM_THREADS": max(1, threads), "PERFORMANCE_HINT": "LATENCY"}   # default precision
    runner = openvino_route.CompiledRunner(quantized, sample, threads, config=config)
    runner.ov_model = quantized   # what QuantizedModule.save writes (.engine_saved)
    names, kept = _layers(model)
    return Built(runner=runner, program_source=model, compiled=False, quantized=names, kept_fp32=kept,
                 int8_range=f"{'7-bit' if overflow_fix else '8-bit'} weights (NNCF overflow_fix={fix.value})",
                 engine_model=quantized)


def build_onnxruntime(model: nn.Module, example: tuple, calibration: list[tuple], threads: int,
                      reduce_range: bool) -> Built:
    from onnxruntime import quantization as q

    from xlaunch.kernels.optimize.engines.routes import onnxruntime_route
    from xlaunch.kernels.optimize.engines.sample import Sample

    sample = Sample(model, example)
    model_bytes = onnxruntime_route.export_onnx(model, sample)
    names = [f"input_{i}" for i in range(len(sample.tensor_positions))]
    feeds = ({name: t.detach().contiguous().numpy() for name, t in zip(names, sample.tensors(batch))}
             for batch in calibration)   # made as ONNX Runtime reads them: no second copy of the calibration

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
    return Built(runner=runner, program_source=model, compiled=False, quantized=layers, kept_fp32=kept,
                 int8_range=f"{'7-bit weights (reduce_range)' if reduce_range else '8-bit weights'}, u8 activations")


def build(route: str, model: nn.Module, example: tuple, calibration: list[tuple], seven_bit: bool) -> Built:
    """``seven_bit``: the CPU sums u8 x s8 products in saturating 16-bit lanes (no VNNI/AMX); each
    engine gets its own setting for it (OpenVINO: NNCF's overflow fix; ONNX Runtime: reduce_range)."""
    threads = torch.get_num_threads()
    if route == OPENVINO:
        return build_openvino(model, example, calibration, threads, overflow_fix=seven_bit)
    return build_onnxruntime(model, example, calibration, threads, reduce_range=seven_bit)
