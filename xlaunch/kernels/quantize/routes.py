"""Building one INT8 route: PT2E static/dynamic (torchao's X86InductorQuantizer, then inductor
with freezing, which lowers the q/dq pattern to oneDNN int8 kernels) and int8 weight-only Linear
(torchao ``Int8WeightOnlyConfig``). Each build returns the runnable module, the program to save
(torch.export format) and which layers were quantized or left in fp32, with why."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from xlaunch._torch import needs_torch, quiet_import_logs
from xlaunch.kernels.quantize import capture

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.quantize.rewrites import (
    LINEAR_OPS, adds_other_shape, contiguous_linear_inputs, full_rank_linear_adds)

# Compile-time noise: inductor's oneDNN lowering copies zero points with torch.tensor(tensor);
# torchao's Int8Tensor has no stable cache hash.
NOISE = ("To copy construct from a tensor", ".*does not implement _stable_hash_for_caching")
# Recompiles (a new input shape) hit them again: a narrow process-wide filter for inductor's
# lowering module, plus a local one around each route's first (compiling) call.
warnings.filterwarnings("ignore", message=NOISE[0], category=UserWarning,
                        module=r"torch\._inductor\.mkldnn_lowerings")

CONV_OPS = ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
            "aten.conv_transpose1d.input", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input")
# Module kinds that hold weights no INT8 route here converts.
UNSUPPORTED_MODULES = (nn.LSTM, nn.GRU, nn.RNN, nn.Embedding, nn.EmbeddingBag, nn.Conv1d, nn.Conv3d,
                       nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class QuantizeWarning(UserWarning):
    """Part of the model stays fp32, or a route could not be built; the message says why."""


@dataclass
class Built:
    """One built route."""

    runner: Callable[..., Any]                 # what quantized models call
    program_source: nn.Module                  # exported (torch.export) for saving
    compiled: bool                             # runner is torch.compile'd (freezing on)
    quantized: list[str] = field(default_factory=list)
    kept_fp32: dict[str, str] = field(default_factory=dict)
    # What the route did against the 16-bit saturation of u8 x s8 sums (the setting it was given):
    # shown per route in the report.
    int8_range: str = ""
    engine_model: Any = None                   # the engine's own quantized model (OpenVINO), if any


def pt2e_range(reduce_range: bool) -> str:
    return "7-bit activations (reduce_range)" if reduce_range else "8-bit activations and weights"


def import_torchao() -> Any:
    """torchao, imported lazily and quietly (it logs failed loads of its CUDA-only libraries)."""
    try:
        with quiet_import_logs():
            import torchao  # noqa: F401
            import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401
    except ImportError as exc:
        raise ImportError("xlaunch.quantize needs torchao: pip install 'xlaunch[torch]'") from exc
    return torchao


def register_decomposed_ops() -> None:
    """The quantized_decomposed ops that PT2E programs hold (needed to load a saved one)."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401


def dynamic_batch(example_inputs: tuple) -> tuple:
    """export's dynamic_shapes: dim 0 of every tensor input may vary (the batch)."""
    from torch.export import Dim

    return tuple({0: Dim.AUTO} if isinstance(a, torch.Tensor) and a.dim() > 0 else None
                 for a in example_inputs)


class Bf16Program(nn.Module):
    """What a ``bf16`` result saves: the fp32 model's forward under bf16 autocast (as optimize()'s
    bf16 route runs it), bf16/fp16 outputs given back in fp32, as that route gives them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        from torch.utils._pytree import tree_map

        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model(*args)
        return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in
                        (torch.bfloat16, torch.float16) else t, out)


def export(model: nn.Module, example_inputs: tuple) -> torch.export.ExportedProgram:
    """``model`` exported with dim 0 of its tensor inputs dynamic. An example batch of 1 is exported as
    2 rows (the row twice): export specializes a size-1 dimension to 1, and the program then refused
    every other batch size (in the quantized model itself, and after load_quantized). A model that
    cannot be captured is one :class:`.capture.ExportError` (nothing printed)."""
    if torch.is_inference_mode_enabled():   # save() under the caller's inference_mode: export refuses it
        with torch.inference_mode(False):
            return export(model, tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a
                                       for a in example_inputs))
    rows = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == 1 else a
                 for a in example_inputs)
    dynamic = dynamic_batch(rows)
    if isinstance(model, Bf16Program):   # its *args are one input of the export's structure
        dynamic = (dynamic,)
    error: Optional[BaseException] = None
    # some models pin their batch size: export them with the example's shapes
    for args, shapes in ((rows, dynamic), (example_inputs, None)):
        with capture.held_back() as held:   # a failing try prints its partial graph: kept from the user
            try:
                program = torch.export.export(model, args, dynamic_shapes=shapes)
            except Exception as exc:
                error = exc
                continue
        capture.give_out(held)
        return program
    assert error is not None
    raise capture.ExportError(f"torch.export cannot capture {type(model).__name__}: {capture.failure(error)}")


class FloatProgram:
    """The float model, exported once for every PT2E route of one quantize() call (``auto`` builds
    static and dynamic from the same program: an export is 0.1-1 s on the test models here, seconds
    on a ResNet or an encoder stack). Each route prepares its own copy."""

    def __init__(self, model: nn.Module, example_inputs: tuple) -> None:
        self._model, self._example = model, example_inputs
        self._program: Optional[torch.export.ExportedProgram] = None
        self._error: Optional[capture.ExportError] = None

    def graph(self) -> Any:
        """A fresh graph module of the exported program (prepare and convert replace its attributes,
        never the program's tensors: tests/kernels/quantize/test_quantize_residual.py checks it).
        A model export cannot capture fails every route the same way: exported once."""
        if self._error is not None:
            raise self._error
        if self._program is None:
            try:
                self._program = export(self._model, self._example)
            except capture.ExportError as exc:
                self._error = exc
                raise
        return self._program.module()


# How FrozenCompiled may compile the batch dimension (a saved model records the one that worked).
COMPILE_MODES = ("unbacked", "dynamic")
_CONVOLUTIONS = ("aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution")
_VIEWS = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.unflatten", "aten.flatten")


def _conv_fails(node: Any) -> bool:
    """A convolution on fp32 weights (a ``get_attr``, where a quantized one reads a dequantize) or
    on dynamically quantized activations (``dequantize_per_tensor.tensor``: the dynamic route's)."""
    if not str(node.target).startswith(_CONVOLUTIONS) or len(node.args) < 2:
        return False
    activation, weight = node.args[0], node.args[1]
    return (getattr(weight, "op", None) == "get_attr"
            or str(getattr(activation, "target", "")).startswith("quantized_decomposed.dequantize_per_tensor.tensor"))


def _folds_batch(node: Any) -> bool:
    """A view whose input or output has a size that is the (symbolic) batch times another size:
    attention's ``(S, B, E) -> (S, B*H, E/H)`` and back."""
    if not str(node.target).startswith(_VIEWS):
        return False
    values = [node.meta.get("val"), *(getattr(a, "meta", {}).get("val") for a in node.args[:1])]
    return any(isinstance(size, torch.SymInt) and not size.node.expr.is_Symbol
               for value in values for size in getattr(value, "shape", ()))


def unbacked_batch_fails(module: Any) -> bool:
    """Whether inductor cannot compile the program with an unbacked batch, known from its graph:
    a convolution on fp32 weights or dynamically quantized activations (its lowering asserts
    strides that an unbacked batch breaks), or a view folding the batch with another dimension
    (the reshape lowering cannot prove the sizes equal and adds a runtime assert ``batch == 1``
    that fails the compile's own guards). Either fails only after a whole compile (3.9 s for the
    test CNN's dynamic route, 10 s of CPU for the test encoder's, AVX2 VM), then compiles again with
    a dynamic batch: go there at once. (A view that keeps the batch apart, as ``Flatten`` after
    pooling, is fine.)"""
    graph = getattr(module, "graph", None)
    return any(node.op == "call_function" and (_conv_fails(node) or _folds_batch(node) or adds_other_shape(node))
               for node in getattr(graph, "nodes", ()))


class FrozenCompiled:
    """torch.compile'd module whose compiles run with inductor freezing (int8 weight prepacking),
    compiled once for every batch size: the batch dimension is marked unbacked on the first call
    (:class:`xlaunch.kernels.optimize.engines.routes.inductor_route.FrozenDynamicBatch`), so batches 3,
    16 and 1 after 8 reuse the first compile instead of compiling again (seconds each)."""

    def __init__(self, module: nn.Module, how: Optional[str] = None) -> None:
        from xlaunch.kernels.optimize.engines.routes.inductor_route import FrozenDynamicBatch

        self.module = module
        if how not in COMPILE_MODES:
            how = "dynamic" if unbacked_batch_fails(module) else "unbacked"
        self._compiled = FrozenDynamicBatch(module, how=how, quiet=NOISE)

    @property
    def calls(self) -> int:
        return self._compiled.calls

    @property
    def how(self) -> str:
        """How the batch dimension is compiled: ``unbacked``, or ``dynamic`` where an unbacked
        compile failed (known after the first call) or cannot work (:func:`unbacked_batch_fails`)."""
        return self._compiled.how

    def __call__(self, *args: Any) -> Any:
        return self._compiled(*args)


def _layer_name(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else node.name


def _weight_name(node: Any) -> str:
    weight = node.args[1] if len(node.args) > 1 else None
    return str(getattr(weight, "target", "") or "")


def account_pt2e(graph_module: nn.Module, route: str) -> tuple[list[str], dict[str, str]]:
    """Which Linear/conv ops of a converted PT2E graph read a dequantized int8 weight."""
    quantized: list[str] = []
    kept: dict[str, str] = {}
    for node in graph_module.graph.nodes:
        target = str(node.target)
        if node.op != "call_function" or target not in LINEAR_OPS + CONV_OPS:
            continue
        name = _layer_name(node)
        if "dequantize_per_channel" in _weight_name(node):
            quantized += [name] if name not in quantized else []   # a layer called twice is one layer
            continue
        stack = node.meta.get("nn_module_stack") or {}
        kind = list(stack.values())[-1][1] if stack else ""
        param = _weight_name(node)
        if kind.endswith("MultiheadAttention"):
            name = param.removesuffix(".weight").removesuffix("_weight") or name
            why = "MultiheadAttention projection (X86InductorQuantizer annotates nn.Linear/nn.Conv2d modules only)"
        else:
            why = f"{target.split('.')[1]} not annotated by X86InductorQuantizer"
        kept[name] = why
    return quantized, kept


def unsupported_modules(model: nn.Module) -> dict[str, str]:
    return {name: f"{type(module).__name__} has no INT8 route here"
            for name, module in model.named_modules() if isinstance(module, UNSUPPORTED_MODULES)}


def split_reused_modules(graph_module: nn.Module) -> dict[Any, dict]:
    """Give each call of a module instance called more than once its own module path, for the
    quantizer's pattern matching; returns the nodes' original ``nn_module_stack`` to restore.

    torch.export (non-strict, the default) leaves ``source_fn_stack`` unset, and torch's
    ``get_source_partitions`` then groups nodes by their innermost module path. ResNet's bottleneck
    calls one ``self.relu`` three times: its three calls became one partition with three outputs,
    and X86InductorQuantizer raised "Input partition has more than one output node". The stack's
    keys already tell the calls apart (``relu``, ``relu@1``, ``relu@2``); the paths here follow."""
    calls: dict[str, list[str]] = {}
    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op == "call_function" and stack:
            key, (path, _) = list(stack.items())[-1]
            keys = calls.setdefault(path, [])
            if key not in keys:
                keys.append(key)
    originals: dict[Any, dict] = {}
    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op != "call_function" or not stack:
            continue
        key, (path, kind) = list(stack.items())[-1]
        index = calls[path].index(key)
        if index:   # the first call keeps its path (and the layer its name)
            originals[node] = stack
            node.meta["nn_module_stack"] = {**stack, key: (f"{path}@{index}", kind)}
    return originals


def restore_module_stacks(originals: dict[Any, dict]) -> None:
    for node, stack in originals.items():
        node.meta["nn_module_stack"] = stack


def build_pt2e(model: nn.Module, example_inputs: tuple, calibration: Iterable[tuple], dynamic: bool,
               reduce_range: bool, program: Optional[FloatProgram] = None) -> Built:
    """A PT2E route (static or dynamic) of ``model``; ``program``: its export, shared with the other route."""
    import_torchao()
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config(
        is_dynamic=dynamic, reduce_range=reduce_range))
    with torch.no_grad():
        graph = (program or FloatProgram(model, example_inputs)).graph()
        contiguous_linear_inputs(graph)
        full_rank_linear_adds(graph)
        originals = split_reused_modules(graph)
        prepared = prepare_pt2e(graph, quantizer)
        restore_module_stacks(originals)
        for batch in calibration:
            prepared(*batch)
        converted = convert_pt2e(prepared)
    quantized, kept = account_pt2e(converted, "dynamic" if dynamic else "static")
    return Built(runner=FrozenCompiled(converted), program_source=converted, compiled=True,
                 quantized=quantized, kept_fp32=kept, int8_range=pt2e_range(reduce_range))


def build_weight_only(model: nn.Module) -> Built:
    import_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantized_model = copy.deepcopy(model)
    attention = [name for name, m in quantized_model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    linears = {name for name, m in quantized_model.named_modules() if isinstance(m, nn.Linear)
               and not any(name.startswith(a + ".") for a in attention)}
    with capture.ignored_warnings(["torchao"]):   # its notices, not the user's threads' warnings
        quantize_(quantized_model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, name: isinstance(m, nn.Linear) and name in linears)
    quantized = sorted(name for name, m in quantized_model.named_modules()
                       if name in linears and type(m.weight) not in (nn.Parameter, torch.Tensor))
    kept = {name: "MultiheadAttention projections call their weights directly (not converted)" for name in attention}
    kept.update({name: "weight-only INT8 covers nn.Linear only" for name, m in model.named_modules()
                 if isinstance(m, nn.Conv2d)})
    kept.update({name: "not converted by torchao Int8WeightOnlyConfig" for name in sorted(linears - set(quantized))})

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return quantized_model(*args)

    return Built(runner=run, program_source=quantized_model, compiled=False, quantized=quantized, kept_fp32=kept,
                 int8_range="fp32 activations (no u8 x s8 products)")
