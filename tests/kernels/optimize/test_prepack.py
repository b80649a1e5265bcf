"""Weights laid out once (0 oneDNN weight reorders per steady call, counted by xlaunch's own
verbose parser), and output dtypes that follow eager under the same context (issue 28, items 3, 6)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optimize import dispatch  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402
from xlaunch.launcher.observe.kernels import KernelTally  # noqa: E402

pytestmark = pytest.mark.torch

BF16 = torch.bfloat16
CALLS = 3

CHILD = textwrap.dedent('''
    import os, sys, warnings
    import torch
    from torch import nn
    from xlaunch.kernels.optimize.pipeline import optimize
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).eval()
    x = torch.randn(2, 3, 8, 8)
    sections = [("plain", torch.float32, "0"), ("fp32", torch.float32, "1")]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        sections.append(("bf16", torch.bfloat16, "1"))
    with torch.no_grad():
        for label, dtype, prepack in sections:
            os.environ["XLAUNCH_PREPACK"] = prepack
            print("SECTION build", flush=True)
            optimized = optimize(model, dtype=dtype, force_bf16=True, sample_input=x, measure=False)
            frozen = optimized._xlaunch_optimize_report.frozen_with
            print(label, frozen, optimized._xlaunch_optimize_report.warnings, file=sys.stderr)
            optimized(x)
            print("SECTION", label, frozen, flush=True)
            for _ in range(int(sys.argv[1])):
                optimized(x)
    print("SECTION end", flush=True)
''')


def steady_tallies() -> dict[str, tuple[str, KernelTally]]:
    """One child process, oneDNN's creation-level verbose on: {section: (frozen with, tally)}."""
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, str(CALLS)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out: dict[str, tuple[str, KernelTally]] = {}
    label, tally = None, KernelTally()
    for line in done.stdout.splitlines():
        if line.startswith("SECTION "):
            _, label, frozen = (line.split() + [""])[:3]
            tally = KernelTally()
            out[label] = (frozen, tally)
        elif label is not None:
            tally.add(line)
    out.pop("end", None)
    out.pop("build", None)
    return out


def test_steady_calls_make_no_weight_reorders() -> None:
    tallies = steady_tallies()
    frozen, plain = tallies.pop("plain")
    reorders = plain.to_json()["weight_reorders"]
    if not reorders:
        pytest.skip("aten's conv re-lays no weight on this CPU: nothing for prepacking to remove")
    assert reorders >= 2 * CALLS, plain.to_json()   # the counter sees aten's per-call reorders
    for label, (frozen, tally) in tallies.items():
        report = tally.to_json()
        assert frozen == "jit", label
        assert report["primitives"]["convolution"]["creations"] == 2 * CALLS, (label, report)
        assert report["weight_reorders"] == 0, (label, report)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()


def call(model: nn.Module, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        return model(x)


CASES = [("fp32 input", torch.float32, False), ("bf16 input", BF16, False), ("caller's autocast", torch.float32, True)]


@pytest.mark.parametrize("frozen, sample", [(False, False), (True, True), (True, False)],
                         ids=["eager", "frozen", "frozen-on-first-call"])
def test_bf16_outputs_follow_eager_in_the_same_context(frozen: bool, sample: bool) -> None:
    """frozen-on-first-call: a graph built on the first call (no sample_input) returned bf16 for fp32
    inputs: its prepacked copy (convs and linears without parameters) was traced without the autocast."""
    model, x = tiny(), torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimized = optimize(model, dtype=BF16, force_bf16=True, measure=False, weights_prepack=frozen,
                             sample_input=x if sample else None)
    for name, dtype, autocast in CASES:
        eager_model = copy.deepcopy(model).to(dtype) if not autocast else model
        expected = call(eager_model, x.to(dtype), autocast)
        for _ in range(2):   # the first call of a signature builds its graph (frozen), the next one runs it
            got = call(optimized, x.to(dtype), autocast)
            assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
            assert torch.allclose(got.float(), expected.float(), rtol=0.05, atol=0.05), name
    forward = dispatch.of(optimized)
    assert forward is not None
    if frozen:
        assert sum(graph is not None for graph in forward.frozen.values()) == len(CASES)


def test_a_graph_frozen_under_the_callers_autocast_serves_only_autocast_calls() -> None:
    model, x = tiny(), torch.randn(2, 3, 6, 6)
    optimized = optimize(model, sample_input=x, measure=False)   # fp32, frozen for x without autocast
    assert call(optimized, x, autocast=True).dtype == call(model, x, autocast=True).dtype == BF16
    assert call(optimized, x, autocast=False).dtype == torch.float32


def test_o0_with_a_dtype_casts_the_weights_as_ipex() -> None:
    model, x = tiny(), torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cast = optimize(model, dtype=BF16, level="O0", force_bf16=True)
    assert cast[0].weight.dtype == cast[3].weight.dtype == BF16
    assert call(cast, x, autocast=False).dtype == torch.float32
    assert cast.state_dict()["0.weight"].dtype == torch.float32   # checkpoints keep the original dtype
    plain = optimize(model, level="O0")
    assert plain[0].weight.dtype == torch.float32 and dispatch.of(plain) is None
