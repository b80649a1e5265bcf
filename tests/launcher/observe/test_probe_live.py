"""The probe on this machine: a real torch child, real oneDNN verbose output, real timings."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
from xlaunch.launcher.observe.probe import format_probe, run_probe  # noqa: E402

pytestmark = pytest.mark.live

ONEDNN_ISA = re.compile(r"^(sse41|avx\w*|amx\w*)$")


def test_probe_measures_every_case_and_names_the_dispatched_isa() -> None:
    result = run_probe(seconds_budget=2)
    json.dumps(result)
    cases = {(c["op"], c["dtype"]): c for c in result["cases"]}
    assert {("gemm", "fp32"), ("conv", "fp32"), ("gemm", "bf16"), ("conv", "bf16"), ("gemm", "fp16"),
            ("gemm", "int8 static"), ("gemm", "int8 weight-only")} <= set(cases)
    for case in result["cases"]:
        if "error" not in case:
            assert case["gflops"] > 0 and case["ms"] > 0
    assert result["threads"] == 1
    assert "stderr" not in result, result["stderr"]   # the child printed nothing on stderr
    # fp32 convolution always goes through oneDNN on x86: its implementation names an ISA.
    conv = cases[("conv", "fp32")]["primitives"]
    assert any(p["kind"] == "convolution" and ONEDNN_ISA.match(p["isa"]) for p in conv), conv
    assert result["onednn"].get("isa")
    assert result["advice"] and result["seconds"] < 60
    assert "dispatched to" in format_probe(result)
