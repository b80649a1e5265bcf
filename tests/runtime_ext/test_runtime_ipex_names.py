"""IPEX's runtime API names (``ipex.cpu.runtime``), used the way IPEX's docs and examples do."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from _runtime_helpers import thread_cpus  # noqa: E402

import xlaunch  # noqa: E402
import xlaunch.runtime_ext as runtime  # noqa: E402  (was: intel_extension_for_pytorch.cpu.runtime)

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
STREAMS = min(2, len(ALLOWED))
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")


def where() -> tuple:
    return thread_cpus(threading.get_native_id())


def test_names_are_exported_from_runtime_ext_and_lazily_from_xlaunch():
    names = ["CPUPool", "pin", "Task", "MultiStreamModule", "MultiStreamModuleHint",
             "get_core_list_of_node_id", "is_runtime_ext_enabled", "get_default_num_streams"]
    for name in names:
        assert getattr(xlaunch, name) is getattr(runtime, name)
        assert name in dir(xlaunch) and name in runtime.__all__
    code = ("import sys, xlaunch; xlaunch.MultiStreamModuleHint; xlaunch.is_runtime_ext_enabled; "
            "assert xlaunch.get_default_num_streams() >= 1; assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_cpupool_with_core_ids_and_node_id_keywords():
    pool = runtime.CPUPool(core_ids=list(ALLOWED[:STREAMS]))
    assert list(pool.core_ids) == list(ALLOWED[:STREAMS])
    assert runtime.CPUPool(core_ids=range(ALLOWED[0], ALLOWED[0] + 1)).core_ids == (ALLOWED[0],)
    nodes = runtime.topology.node_ids()
    if not nodes:
        pytest.skip("no NUMA node information on this machine")
    node = nodes[0]
    assert runtime.get_core_list_of_node_id(node) == list(runtime.CPUPool(node_id=node).core_ids)
    assert all(c in ALLOWED for c in runtime.get_core_list_of_node_id(node))
    with pytest.raises(ValueError, match="NUMA node 4096 has no CPU"):
        runtime.get_core_list_of_node_id(4096)
    with pytest.raises(ValueError, match="node_id"):
        runtime.get_core_list_of_node_id("0")


def test_is_runtime_ext_enabled_once_an_openmp_runtime_is_loaded():
    assert runtime.is_runtime_ext_enabled() is True
    code = "import xlaunch; print(xlaunch.is_runtime_ext_enabled())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.stdout.strip() == "False", result.stderr


def test_pin_as_context_and_decorator():
    cpu_pool = runtime.CPUPool(core_ids=[ALLOWED[-1]])
    with runtime.pin(cpu_pool):
        assert where() == (ALLOWED[-1],)

    @runtime.pin(cpu_pool)
    def inside():
        return where()

    assert inside() == (ALLOWED[-1],)
    assert where() == ALLOWED


def test_task_positional_and_keyword_pool_and_get():
    model = torch.nn.Linear(4, 3).eval()
    x = torch.randn(5, 4)
    cpu_pool = runtime.CPUPool(core_ids=[ALLOWED[-1]])
    positional = runtime.Task(model, cpu_pool)
    keyword = runtime.Task(model, cpu_pool=cpu_pool)
    try:
        y_future = positional(x)
        assert torch.equal(y_future.get(), model(x))
        assert torch.equal(keyword(x).get(timeout=60), model(x))
        assert torch.equal(keyword.run_sync(x), model(x))
        assert keyword.cpu_pool is cpu_pool and positional.pool is cpu_pool
    finally:
        positional.close()
        keyword.close()
    with pytest.raises(TypeError, match="cpu_pool must be a CPUPool"):
        runtime.Task(model, [ALLOWED[0]])
    with pytest.raises(TypeError, match="not both"):
        runtime.Task(model, cpu_pool, pool=cpu_pool)


class Heads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x, y=None):
        out = self.linear(x)
        return {"logits": out, "scale": torch.ones(1)} if y is None else (out, out * y)


def test_multi_stream_module_ipex_style():
    model = Heads().eval()
    x = torch.randn(6, 4)
    cpu_pool = runtime.CPUPool(core_ids=list(ALLOWED[:STREAMS]))
    MultiStreamModuleHint = runtime.MultiStreamModuleHint
    with torch.no_grad():
        expected = model(x)
        with runtime.MultiStreamModule(
            model, num_streams="AUTO", cpu_pool=cpu_pool,
            input_split_hint=MultiStreamModuleHint(0),
            output_concat_hint=MultiStreamModuleHint(logits=0, scale=None),
        ) as msm:
            assert msm.get_stream_number() == STREAMS
            out = msm(x)
        torch.testing.assert_close(out["logits"], expected["logits"])
        assert torch.equal(out["scale"], torch.ones(1))
        y = torch.full((6, 1), 3.0)
        with runtime.MultiStreamModule(
            model, num_streams=STREAMS, cpu_pool=cpu_pool,
            input_split_hint=MultiStreamModuleHint(0, y=0),
            output_concat_hint=MultiStreamModuleHint((0, 0)),
        ) as msm:
            a, b = msm(x, y=y)
        torch.testing.assert_close(a, model(x, y)[0])
        torch.testing.assert_close(b, model(x, y)[1])
    with pytest.raises(ValueError, match="one output"):
        runtime.MultiStreamModule(model, 1, cpu_pool, output_concat_hint=MultiStreamModuleHint(0, logits=0))


def test_get_default_num_streams_is_what_auto_streams_give():
    """IPEX's test: a MultiStreamModule without num_streams has get_default_num_streams(pool) streams."""
    model = torch.nn.Linear(4, 3).eval()
    x = torch.randn(4, 4)
    for count in range(1, len(ALLOWED) + 1):
        cpu_pool = runtime.CPUPool(core_ids=list(ALLOWED[:count]))
        assert runtime.get_default_num_streams(cpu_pool) == count   # one core per stream
        with torch.no_grad(), runtime.MultiStreamModule(model, cpu_pool=cpu_pool) as msm:
            torch.testing.assert_close(msm(x), model(x))
            assert msm.get_stream_number() == runtime.get_default_num_streams(cpu_pool)
    assert runtime.get_default_num_streams() == len(runtime.CPUPool())
    with pytest.raises(TypeError, match="cpu_pool must be a CPUPool"):
        runtime.get_default_num_streams([0])
