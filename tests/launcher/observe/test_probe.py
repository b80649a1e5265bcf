"""probe: parsing oneDNN verbose output (lines as oneDNN 3.x and 2.x print them), attributing
them to cases, advice from measured ratios, the table; no torch in the launcher process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xlaunch.launcher.observe import probe

# Lines as oneDNN v3.12 (torch 2.13) printed them on this AVX2 machine, and a v2.x line from an AMX
# machine (the older layout without the "v1,primitive" prefix).
V3_CONV = ("onednn_verbose,v1,primitive,exec,cpu,convolution,jit:avx2,forward_training,"
           "src:f32:a:blocked:aBcd8b::f0 wei:f32:a:blocked:ABcd8b8a::f0,attr-scratchpad:user,"
           "alg:convolution_direct,mb4_ic32oc32_ih28oh28kh3,0.5")
V3_QCONV = ("onednn_verbose,v1,primitive,exec,cpu,convolution,jit_uni_int8:avx2,forward_inference,"
            "src:u8::blocked:acdb::f0,attr-scratchpad:user,,mb4_ic32oc32,0.3")
V3_MATMUL = ("onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit,undef,src:u8:a:blocked:ab::f0 "
             "wei:s8::blocked:ab::f0,attr-scratchpad:user,,256x256:256x256,48.3")
V3_REORDER = ("onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:s8::blocked:ba::f0 "
              "dst:s8::blocked:ab::f0,attr-scratchpad:user,,256x256,17.6")
V2_AMX = ("onednn_verbose,exec,cpu,matmul,brg:avx512_core_amx,undef,src_bf16::blocked:ab:f0 "
          "wei_bf16::blocked:ab:f0,,,64x64:64x64,0.02")


@pytest.mark.parametrize("line, expected", [
    (V3_CONV, {"kind": "convolution", "impl": "jit:avx2", "isa": "avx2"}),
    (V3_QCONV, {"kind": "convolution", "impl": "jit_uni_int8:avx2", "isa": "avx2"}),
    (V3_MATMUL, {"kind": "matmul", "impl": "gemm:jit", "isa": ""}),
    (V2_AMX, {"kind": "matmul", "impl": "brg:avx512_core_amx", "isa": "avx512_core_amx"}),
    ("onednn_verbose,v1,info,cpu,isa:Intel AVX2", None),
    ("onednn_verbose,v1,primitive,info,template:operation,engine,primitive", None),
    ("some program output, exec, cpu", None),
])
def test_parse_verbose_line(line: str, expected) -> None:
    assert probe.parse_verbose_line(line) == expected


def worker_output(cases: list[dict]) -> str:
    return "\n".join([
        "onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa710)",
        "onednn_verbose,v1,info,cpu,isa:Intel AVX2",
        "XLAUNCH_PROBE case 0",
        "XLAUNCH_PROBE case 1",
        V3_REORDER, V3_CONV, V3_CONV,
        "XLAUNCH_PROBE case 2",
        V3_REORDER, V3_MATMUL,
        "XLAUNCH_PROBE timing",
        V3_CONV,   # a timed call printing (verbose left on): belongs to no case
        "XLAUNCH_PROBE result " + json.dumps({"torch": "2.13.0", "threads": 1, "cases": cases}),
    ])


CASES = [
    {"index": 0, "op": "gemm", "dtype": "fp32", "shape": "256x256x256", "ms": 1.0, "gflops": 33.0},
    {"index": 1, "op": "conv", "dtype": "fp32", "shape": "4x32x28x28 k3", "ms": 2.0, "gflops": 28.0},
    {"index": 2, "op": "gemm", "dtype": "int8 static", "shape": "256x256x256", "ms": 0.6, "gflops": 55.0},
    {"index": 3, "op": "gemm", "dtype": "bf16", "shape": "256x256x256", "ms": 60.0, "gflops": 0.5},
    {"index": 4, "op": "conv", "dtype": "int8 static", "shape": "4x32x28x28 k3", "error": "RuntimeError: gone"},
]


def test_parse_output_attributes_primitives_to_cases() -> None:
    result = probe.parse_output(worker_output([dict(c) for c in CASES]))
    assert result["onednn"] == {"version": "v3.12.0", "isa": "Intel AVX2"}
    by_index = {c["index"]: c["primitives"] for c in result["cases"]}
    assert by_index[0] == []   # fp32 GEMM ran in BLAS: no oneDNN line
    assert by_index[1] == [{"kind": "convolution", "impl": "jit:avx2", "isa": "avx2"}]   # reorders dropped, deduplicated
    assert by_index[2] == [{"kind": "matmul", "impl": "gemm:jit", "isa": ""}]


def test_parse_output_without_result_is_an_error() -> None:
    with pytest.raises(probe.ProbeError, match="no result line"):
        probe.parse_output("XLAUNCH_PROBE case 0\n")


def test_advice_follows_the_measured_ratios() -> None:
    result = probe.parse_output(worker_output([dict(c) for c in CASES]))
    advice = probe.advise(result["cases"])
    int8 = next(a for a in advice if a.startswith("static INT8"))
    bf16 = next(a for a in advice if a.startswith("bf16"))
    assert "gemm 1.67x" in int8 and "pays off here" in int8
    assert "gemm 0.02x" in bf16 and "keep fp32" in bf16
    assert not any(a.startswith("fp16") for a in advice)   # nothing measured, nothing said
    assert result["cases"][2]["vs_fp32"] == pytest.approx(55 / 33)


def test_format_probe_table() -> None:
    result = probe.parse_output(worker_output([dict(c) for c in CASES]))
    result["advice"] = probe.advise(result["cases"])
    text = probe.format_probe(result)
    lines = text.splitlines()
    assert "max ISA: Intel AVX2" in lines[0]
    assert any(l.startswith("conv  fp32") and l.endswith("convolution jit:avx2") for l in lines)
    assert any(l.startswith("gemm  fp32") and "no oneDNN primitive" in l for l in lines)
    assert any(l.startswith("conv  int8 static") and "failed: RuntimeError: gone" in l for l in lines)
    json.dumps(result)


@pytest.mark.parametrize("kwargs, match", [({"seconds_budget": 0}, "seconds_budget"),
                                           ({"threads": 0}, "threads")])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        probe.run_probe(**kwargs)


def test_a_failing_child_is_reported(tmp_path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'broken torch' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(probe.ProbeError, match="status 3: broken torch"):
        probe.run_probe(1, python=str(fake))


def test_probe_module_does_not_import_torch() -> None:
    code = "import sys, xlaunch.launcher.observe.probe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_one_verdict_per_dtype_in_the_check_isa_table() -> None:
    """The flags say int8 is fast (AVX2 multiply-adds); measured 1.05x, the table says "even", once."""
    from synthetic_machines import synthetic_machine

    from xlaunch.machine.report import apply_measurements, format_isa, isa_report

    cases = [dict(c) for c in CASES[:4]]
    cases[2]["gflops"] = 33.0 * 1.05
    found = probe.verdicts(cases)
    assert found["int8"] == {"mark": "even", "ratio": 1.05, "route": "int8 static",
                             "verdict": "about even with fp32 here; only worth it for memory savings"}
    assert found["bf16"]["mark"] == "no" and "fp16" not in found
    machine = synthetic_machine()
    report = isa_report(machine)
    report["advice"]["int8"] = {"fast": True, "why": "AVX2 integer multiply-adds"}
    apply_measurements(report, found)
    rows = {line.split()[0]: line for line in format_isa(report).splitlines() if line[:5].strip() in
            ("fp32", "bf16", "fp16", "int8")}
    assert rows["int8"].split()[1] == "even" and "measured 1.05x fp32" in rows["int8"]
    assert "the flags alone said fast: AVX2" in rows["int8"]
    assert report["advice"]["int8"]["fast"] is False and rows["bf16"].split()[1] == "no"
    assert rows["fp16"].split()[1] in ("yes", "no") and "measured" not in rows["fp16"]   # nothing measured


def test_progress_steps_follow_the_child(tmp_path) -> None:
    """A stand-in child printing the worker's markers: each step is told once, in order."""
    fake = tmp_path / "python"
    result = json.dumps({"torch": "x", "threads": 1, "cases": [dict(c) for c in CASES[:3]]})
    fake.write_text("#!/bin/sh\necho 'XLAUNCH_PROBE case 0'\nsleep 0.1\necho 'XLAUNCH_PROBE timing'\n"
                    f"sleep 0.1\necho 'XLAUNCH_PROBE result {result}'\n")
    fake.chmod(0o755)

    class Lines:
        def __init__(self, tty: bool) -> None:
            self.text, self.tty = "", tty

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return self.tty

    plain, terminal = Lines(False), Lines(True)
    measured = probe.run_probe(1, python=str(fake), progress=probe.StepPrinter(plain, delay=0))
    assert measured["verdicts"]["int8"]["mark"] == "yes"
    steps = plain.text.splitlines()
    shown = [s.split(": ", 2)[2][:8] for s in steps]   # each step once, in order ("torch loaded" may be
    assert shown in (["starting", "torch lo", "timing t", "done in "],   # passed over on a busy machine)
                     ["starting", "timing t", "done in "]), steps
    probe.run_probe(1, python=str(fake), progress=probe.StepPrinter(terminal, delay=0))
    assert terminal.text.count("\n") == 1 and terminal.text.count("\r\x1b[K") >= 4   # one line, rewritten
    quiet = Lines(False)                     # over within the delay: nothing shown
    probe.run_probe(1, python=str(fake), progress=probe.StepPrinter(quiet, delay=30))
    assert quiet.text == ""
