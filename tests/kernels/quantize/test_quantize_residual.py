"""The PT2E routes on ResNet's residual bottleneck (a module called more than once): they build,
quantize every conv and keep the accuracy bound. Export, annotation and calibration only, with
the converted program run eagerly (no inductor compile): cheap.

Before the fix, X86InductorQuantizer raised "Input partition has more than one output node":
torch.export leaves ``source_fn_stack`` unset, so the bottleneck's three calls of one ReLU were
one partition (see ``routes.split_reused_modules``)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from xlaunch.kernels.quantize import routes  # noqa: E402

from quantize_models import skip_module_without_torchao  # noqa: E402

skip_module_without_torchao()

from quantize_models import MAX_ERROR, residual_blocks  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_pt2e_routes_build_on_residual_bottlenecks(mode: str) -> None:
    model, example, calibration = residual_blocks()
    built = routes.build_pt2e(model, (example,), calibration, dynamic=mode == "dynamic", reduce_range=False)
    convs = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert sorted(built.quantized) == sorted(convs) and not built.kept_fp32, built
    with torch.no_grad():
        for (x,) in calibration:
            ref, out = model(x), built.program_source(x)
            assert (ref - out).abs().max() <= MAX_ERROR[mode] * ref.abs().max()


def test_reused_module_paths_are_split_then_restored() -> None:
    model, example, _ = residual_blocks()
    graph = routes.export(model, (example,)).module()
    before = {node: node.meta.get("nn_module_stack") for node in graph.graph.nodes}
    originals = routes.split_reused_modules(graph)
    paths = [list(n.meta["nn_module_stack"].values())[-1][0] for n in graph.graph.nodes
             if n.op == "call_function" and "relu" in str(n.target)]
    assert paths == ["1.relu", "1.relu@1", "1.relu@2", "2.relu", "2.relu@1", "2.relu@2"], paths
    routes.restore_module_stacks(originals)
    assert all(node.meta.get("nn_module_stack") == stack for node, stack in before.items())


def test_both_routes_from_one_export_equal_their_own_exports() -> None:
    """quantize(auto) prepares static and dynamic from one FloatProgram: each route's program is the
    one its own export gives, and neither touches the shared program's tensors (batch norms fold here)."""
    model, example, calibration = residual_blocks()
    shared = routes.FloatProgram(model, (example,))
    shared.graph()
    state = {name: tensor.clone() for name, tensor in shared._program.state_dict.items()}
    for dynamic in (False, True):
        batches = [(example,)] if dynamic else calibration
        one = routes.build_pt2e(model, (example,), batches, dynamic, reduce_range=True, program=shared)
        own = routes.build_pt2e(model, (example,), batches, dynamic, reduce_range=True)
        with torch.no_grad():
            assert torch.equal(one.program_source(example), own.program_source(example)), dynamic
    assert state.keys() == shared._program.state_dict.keys()
    assert all(torch.equal(tensor, shared._program.state_dict[name]) for name, tensor in state.items())
