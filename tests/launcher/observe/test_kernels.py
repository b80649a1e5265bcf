"""--kernel-report without a live program: recorded oneDNN verbose logs parsed into summaries,
the line layouts of earlier oneDNN versions, the stream filter, and the plan's environment.

The logs in ``onednn_logs/`` (``ONEDNN_VERBOSE=profile_create`` unless said, oneDNN 3.12 as torch
2.13 ships it):

* ``avx2_eager_f32.log``: recorded on the project's earlier AVX2 VM, ``examples/infer.py
  --batch-size 2 --iterations 2 --warmup 1 --image-size 32`` (7 convolutions, 3 forward calls).
* ``avx512_*.log``: recorded on the AMD EPYC Zen 4 VM (AVX-512 with VNNI and BF16, no AMX), torch
  2.13, a 2-conv + linear model, batch 2, 16x16 images: ``avx512_bf16_autocast.log`` (2 calls under
  bf16 autocast); ``avx512_user_verbose_1.log`` (2 f32 calls with the user's own
  ``ONEDNN_VERBOSE=1``: execution lines only); ``avx512_torch_and_openvino.log`` (eager calls,
  then ``openvino.convert_model`` + ``compile_model`` and 2 OpenVINO calls, then 1 eager call:
  torch's oneDNN v3.12.0 and OpenVINO's v3.13.0 in one log); ``avx512_optimize_build.log`` (2
  eager calls, ``xlaunch.optimize(backend=["torch"])`` with ``XLAUNCH_KERNEL_MARKS=1``, 3 calls of
  the result; between the build marks only the first 120 lines after each mark are kept: the cut
  15,513 lines were more of the same timing rounds).
* ``amx_autocast_bf16.log``, ``amx_eager_f32.log``: the infer.py model on a Sapphire Rapids
  machine under bf16 autocast (with ``ONEDNN_VERBOSE_TIMESTAMP=1``), and in f32;
* ``avx512_vnni_int8_small_cache.log``: an int8 model (weights prepacked once) on an AVX-512 VNNI
  machine with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=4``, so every call builds its convolutions again.

The last three are written from oneDNN's line format as 3.x prints it on those ISAs (header, ISA
sentences, implementation names such as ``brg_conv_fwd:avx10_1_512_amx``, which the project's AMX
machine printed, and tensor descriptors).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from synthetic_machines import synthetic_machine

from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.observe.kernel_filter import MAX_VERBOSE_LINE, VerboseFilter
from xlaunch.launcher.observe.kernel_report import (RELAYOUT_ADVICE, RELAYOUT_AFTER_BUILD, RELAYOUT_UNDER_AUTO,
                                                    kernel_cell, kernel_line, kernel_warnings, short_isa)
from xlaunch.launcher.observe.kernels import KernelTally, isa_of, parse_line
from xlaunch.launcher.plan.options import build_options
from xlaunch.launcher.plan.planner import plan

LOGS = Path(__file__).parent / "onednn_logs"
AMX_ISA = ("Intel AVX-512 with float16, Intel DL Boost and bfloat16 support and Intel AMX with bfloat16 "
           "and 8-bit integer support")


def tally_of(name: str) -> dict:
    tally = KernelTally()
    for line in (LOGS / name).read_text().splitlines():
        tally.add(line)
    return tally.to_json()


# ------------------------------------------------------------------------------ recorded logs

def test_avx2_eager_cnn_recorded_here() -> None:
    data = tally_of("avx2_eager_f32.log")
    assert (data["isa"], data["onednn_version"], data["lines"]) == ("Intel AVX2", "v3.12.0", 88)
    conv = data["primitives"]["convolution"]
    assert conv["implementations"] == {"jit:avx2": 21} and conv["data_types"] == ["f32"]
    assert data["calls"] == 21 and data["data_types"] == ["f32"]
    assert (data["cache_misses"], data["cache_hits"], data["recreated"]) == (22, 59, 0)
    # every call re-lays-out the 7 weight tensors (jit:uni into Acdb8a / ABcd8b8a)
    assert (conv["weight_reorders"], conv["weight_reorders_distinct"]) == (21, 7)
    assert data["weight_reorders_per_call"] == 1.0
    assert data["primitives"]["reorder"]["implementations"] == {"jit:blk": 39, "jit:uni": 21}
    assert kernel_line(data) == ("oneDNN v3.12.0, AVX2; convolution: jit:avx2 21 (f32); reorders 60, of weights 21 "
                                 "(1.00 per call); re-created 0")
    assert kernel_warnings(data) == [
        "weights re-laid-out on every call (convolution: 21 weight reorders in 21 calls): a route that lays the "
        "weights out once removes this; `--auto-optimize --kernel-report` shows whether the route xlaunch.optimize "
        "keeps on this machine does so"]
    assert kernel_cell(data) == "AVX2, conv avx2 f32, w 1.0/call"


def test_amx_bf16_autocast_uses_amx_but_relays_weights() -> None:
    data = tally_of("amx_autocast_bf16.log")
    assert data["isa"] == AMX_ISA
    assert data["primitives"]["convolution"]["implementations"] == {"brg_conv_fwd:avx10_1_512_amx": 21}
    assert data["primitives"]["matmul"]["implementations"] == {"brg_matmul:avx10_1_512_amx": 3}
    assert data["data_types"] == ["bf16"]
    assert "weight_reorders" not in data["primitives"]["matmul"]   # matmul packs its weights inside
    warnings = kernel_warnings(data, requested_dtype="bfloat16")     # the program ran under --auto-optimize
    assert warnings == ["weights re-laid-out on every call (convolution: 21 weight reorders in 21 calls): "
                        "under --auto-optimize: the route it kept does not lay them out once here"]
    assert kernel_line(data).startswith("oneDNN v3.12.0, AMX; convolution: brg_conv_fwd:avx10_1_512_amx 21 (bf16); "
                                        "matmul: brg_matmul:avx10_1_512_amx 3 (bf16)")


def test_amx_machine_running_f32_says_amx_is_idle_and_bf16_was_not_reached() -> None:
    data = tally_of("amx_eager_f32.log")
    assert data["primitives"]["convolution"]["implementations"] == {"brg_conv_fwd:avx512_core": 21}
    assert data["recreated"] == 0
    warnings = kernel_warnings(data, requested_dtype="bfloat16")
    assert warnings[:2] == [
        "bf16 requested but convolutions ran in f32",
        "AMX available but not used (convolution brg_conv_fwd:avx512_core, f32): AMX computes in bf16 and int8 only",
    ]
    assert warnings[2].startswith("weights re-laid-out on every call")
    assert "bf16 requested" not in " ".join(kernel_warnings(data, requested_dtype="float32"))


def test_avx512_int8_with_a_small_primitive_cache() -> None:
    data = tally_of("avx512_vnni_int8_small_cache.log")
    assert short_isa(data["isa"]) == "AVX-512 VNNI"
    conv = data["primitives"]["convolution"]
    assert conv["data_types"] == ["s8", "u8"] and conv["implementations"] == {"brg_conv_fwd:avx512_core_vnni": 21}
    # 7 convolutions and the matmul built on each of 3 calls: 2 calls' worth rebuilt
    assert (conv["recreated"], data["primitives"]["matmul"]["recreated"], data["recreated"]) == (14, 2, 16)
    # weights were prepacked once: reorders on the first call only, nothing to say about them
    assert (conv["weight_reorders"], conv["weight_reorders_distinct"]) == (7, 7)
    assert kernel_warnings(data) == [
        "16 oneDNN primitives built again after their first use (dropped from the primitive cache: raise "
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY)"]
    assert "(s8/u8)" in kernel_line(data)


def test_isa_names_from_the_three_machines() -> None:
    assert [short_isa(tally_of(name)["isa"]) for name in
            ("avx2_eager_f32.log", "avx512_bf16_autocast.log", "amx_autocast_bf16.log")] == \
        ["AVX2", "AVX-512 VNNI BF16", "AMX"]


def test_avx512_bf16_recorded_on_zen4() -> None:
    data = tally_of("avx512_bf16_autocast.log")
    assert data["isa"] == "Intel AVX-512 with Intel DL Boost and bfloat16 support"
    conv = data["primitives"]["convolution"]
    assert conv["implementations"] == {"jit_bf16:avx512_core_bf16": 4} and conv["data_types"] == ["bf16"]
    line = kernel_line(data)
    assert line.startswith("oneDNN v3.12.0, AVX-512 VNNI BF16; convolution: jit_bf16:avx512_core_bf16 4 (bf16)")
    assert "FP16" not in line and "FP16" not in kernel_cell(data)
    assert kernel_warnings(data, requested_dtype="bfloat16") == [
        f"weights re-laid-out on every call (convolution: 4 weight reorders in 4 calls): {RELAYOUT_UNDER_AUTO}"]


def test_torch_and_openvino_onednn_in_one_log() -> None:
    data = tally_of("avx512_torch_and_openvino.log")
    torch_lib, openvino = data["libraries"]
    assert (torch_lib["onednn_version"], torch_lib["runtime"], torch_lib["owner"]) == ("v3.12.0", "OpenMP", "torch")
    assert (openvino["onednn_version"], openvino["runtime"], openvino["owner"]) == ("v3.13.0", "threadpool", "OpenVINO")
    # torch's eager call after OpenVINO's header still counts under torch (the primitives are torch's)
    assert torch_lib["primitives"]["convolution"]["implementations"] == {"jit:avx512_core": 16}
    assert openvino["primitives"]["convolution"]["implementations"] == {"brg_conv_fwd:avx512_core": 2}
    assert (data["onednn_version"], data["calls"]) == ("v3.12.0", 16)      # the top: the first library
    line = kernel_line(data)
    assert line.startswith("oneDNN v3.12.0 (OpenMP: torch's), AVX-512 VNNI BF16; convolution: jit:avx512_core 16")
    assert " | oneDNN v3.13.0 (threadpool: OpenVINO's), AVX-512 VNNI BF16; convolution: brg_conv_fwd:avx512_core 2" \
        in line
    # OpenVINO laid its weights out once per primitive: only torch's are judged re-laid-out
    assert kernel_warnings(data) == [
        "oneDNN v3.12.0 (OpenMP: torch's): weights re-laid-out on every call (convolution: 16 weight reorders in 16 "
        f"calls): {RELAYOUT_ADVICE}"]
    assert kernel_cell(data) == ("v3.12.0 AVX-512 VNNI BF16, conv avx512_core f32, w 1.0/call | "
                                 "v3.13.0 AVX-512 VNNI BF16, conv avx512_core f32")


def test_the_same_librarys_header_again_is_one_section() -> None:
    """A second process of the same program (a spawned worker) prints torch's header again."""
    tally = KernelTally()
    lines = (LOGS / "avx512_bf16_autocast.log").read_text().splitlines()
    for line in lines + lines:
        tally.add(line)
    data = tally.to_json()
    assert len(data["libraries"]) == 1 and data["calls"] == 8


def test_build_calls_are_reported_apart() -> None:
    data = tally_of("avx512_optimize_build.log")
    steady, build = data["libraries"][0], data["build"]
    # steady state: 2 eager calls before optimize, 3 calls of the model it kept (eager): 5 x 2 convolutions
    assert steady["calls"] == 10 and steady["primitives"]["convolution"]["implementations"] == {"jit:avx512_core": 10}
    assert (build["builds"], build["calls"]) == (3, 85)
    assert kernel_line(data).endswith(" | while optimize/quantize built (3 builds, not counted above): 247 lines, "
                                      "85 calls")
    assert all("85" not in warning for warning in kernel_warnings(data))
    # the program ran optimize: advising it would not help; what it kept is named instead
    assert kernel_warnings(data) == [f"weights re-laid-out on every call (convolution: 10 weight reorders in 10 "
                                     f"calls): {RELAYOUT_AFTER_BUILD}"]


def test_users_own_onednn_verbose_1_counts_executions() -> None:
    data = tally_of("avx512_user_verbose_1.log")
    assert (data["counted"], data["exec_lines"], data["calls"]) == ("executions", 14, 4)
    assert data["primitives"]["convolution"]["executions"] == 4
    line = kernel_line(data)
    assert "convolution: jit:avx512_core 4 executions (f32)" in line and "no primitive" not in line
    assert line.endswith("counted from 14 execution lines (no creation line)")
    warnings = kernel_warnings(data)
    assert warnings[0].startswith("weights re-laid-out on every execution (convolution: 4 weight reorders in 4 "
                                  "executions)")
    assert warnings[1].startswith("oneDNN printed 14 per-execution lines")


def test_build_marks_are_written_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from xlaunch.kernels import build_mark

    written: list[bytes] = []
    monkeypatch.setattr(os, "write", lambda fd, data: written.append(data) or len(data))
    monkeypatch.delenv(build_mark.MARKS_ENV, raising=False)
    with build_mark.building("optimize"):
        pass
    assert written == []
    monkeypatch.setenv(build_mark.MARKS_ENV, "1")
    assert build_mark.marked("quantize")(lambda: 7)() == 7
    assert written == [b"xlaunch_verbose,build,start,quantize\n", b"xlaunch_verbose,build,end,quantize\n"]
    keep = VerboseFilter()
    assert keep.feed(b"a" + written[0] + b"b\n" + written[1]) == b"ab\n"    # taken out of the output
    assert keep.tally.builds == 1


# ------------------------------------------------------------------------------ line layouts

@pytest.mark.parametrize("line, what, kind, impl, src", [
    # 3.2-3.3: v0, tensors as name_type
    ("onednn_verbose,v0,primitive,create:cache_miss,cpu,convolution,jit:avx512_core,forward_training,"
     "src_f32:a:blocked:aBcd16b::f0 wei_f32:a:blocked:ABcd16b16a::f0 bia_f32:a:blocked:a::f0 "
     "dst_f32:a:blocked:aBcd16b::f0,,alg:convolution_direct,mb2_ic16oc16_ih7oh7kh5sh1dh0ph2_iw7ow7kw5sw1dw0pw2,0.709961",
     "create", "convolution", "jit:avx512_core", "f32"),
    # the same with ONEDNN_VERBOSE_TIMESTAMP=1
    ("onednn_verbose,v0,1693533460228.559082,primitive,create:cache_hit,cpu,reorder,jit:uni,undef,"
     "src_f32::blocked:abcd::f0 dst_f32::blocked:ABcd16b16a::f0,,,16x16x5x5,0.724854",
     "create", "reorder", "jit:uni", "f32"),
    # 3.0-3.1: no version field
    ("onednn_verbose,1693533460193.346924,primitive,exec,cpu,matmul,brg:avx512_core_amx,undef,"
     "src_bf16::blocked:ab::f0 wei_bf16::blocked:ab::f0 dst_bf16::blocked:ab::f0,,,64x64:64x64,0.02",
     "exec", "matmul", "brg:avx512_core_amx", "bf16"),
    # 2.x: no API field; 1.x: dnnl_verbose
    ("onednn_verbose,exec,cpu,convolution,jit:avx512_core_amx_bf16,forward_training,src_bf16::blocked:acdb:f0 "
     "wei_bf16:p:blocked:ABcd16b16a2b:f0 dst_bf16::blocked:acdb:f0,attr-scratchpad:user ,alg:convolution_direct,"
     "mb7_ic2oc1_ih224oh111kh3sh2dh1ph1_iw2,0.1", "exec", "convolution", "jit:avx512_core_amx_bf16", "bf16"),
    ("dnnl_verbose,create:cache_miss,cpu,reorder,simple:any,undef,src_f32::blocked:a:f0 dst_f32::blocked:a:f0,,,16,0.03",
     "create", "reorder", "simple:any", "f32"),
])
def test_older_layouts(line: str, what: str, kind: str, impl: str, src: str) -> None:
    parsed = parse_line(line)
    assert parsed is not None
    assert (parsed.what, parsed.kind, parsed.impl, parsed.tensors["src"][0]) == (what, kind, impl, src)


@pytest.mark.parametrize("line, isa, version", [
    ("onednn_verbose,v1,info,cpu,isa:" + AMX_ISA, AMX_ISA, ""),            # the ISA sentence holds a comma
    ("onednn_verbose,info,cpu,isa:Intel AVX-512 with Intel DL Boost", "Intel AVX-512 with Intel DL Boost", ""),
    ("onednn_verbose,v0,info,oneDNN v3.2.0 (commit 6afab8e57f65a8995685d97ba6f80fa6c24b87a0)", "", "v3.2.0"),
    ("dnnl_verbose,info,DNNL v1.3.0 (commit d0fc158e98590dfad0165e568ca466876a794597)", "", "v1.3.0"),
])
def test_headers(line: str, isa: str, version: str) -> None:
    parsed = parse_line(line)
    assert parsed is not None and (parsed.what, parsed.isa, parsed.version) == ("info", isa, version)


@pytest.mark.parametrize("line", [
    "onednn_verbose, is how you spell it",          # the marker in a sentence
    "onednn_verbose",                               # nothing after it
    "my_onednn_verbose,v1,info,cpu,isa:x",          # not at the start
    "onednn_verbose,v1,nonsense,cpu",               # an unknown API kind
])
def test_not_verbose_lines(line: str) -> None:
    assert parse_line(line) is None


def test_graph_api_and_check_lines_are_counted_apart() -> None:
    tally = KernelTally()
    tally.add("onednn_verbose,v1,primitive,create:check,matmul,dimension src:1 is inconsistent with weights:0,"
              "src/common/matmul.cpp:144")
    tally.add("onednn_verbose,v1,graph,exec,cpu,100002,sdp,,,,,dnnl_backend,0.5")
    tally.add("onednn_verbose,v1,primitive,exec,cpu,convolution,jit:avx2,forward_inference,src:f32::blocked:abcd::f0,"
              ",,mb1,0.1")
    data = tally.to_json()
    assert (data["lines"], data["exec_lines"], data["counted"]) == (3, 1, "executions")
    assert data["primitives"]["convolution"]["executions"] == 1 and data["libraries"][0]["other_lines"] == 2
    assert "per-execution lines" in kernel_warnings(data)[0]
    assert kernel_line(data).endswith("counted from 1 execution lines (no creation line)")


def test_dispatch_notes_are_not_creations() -> None:
    """``ONEDNN_VERBOSE=all``/``dispatch`` (oneDNN 3.12 in torch 2.13, recorded): an implementation passed
    over is a note, never a primitive of kind ``cpu`` or ``unsupported feature for padding: f``."""
    tally = KernelTally()
    for line in (
        "onednn_verbose,v1,primitive,create:dispatch,convolution,unsupported feature for padding: f,t,l padding "
        "not supported,src/cpu/x64/jit_avx512_common_1x1_conv_kernel.cpp:680",
        "onednn_verbose,v1,primitive,create:dispatch,reorder,cpu,reorder,jit_direct_copy:uni,undef,"
        "src:f32::blocked:abcd::f0 dst:f32::blocked:Acdb16a::f0,attr-scratchpad:user,,32x3x3x3,memory formats for "
        "src and dst tensors do not match,src/cpu/x64/jit_uni_reorder_direct_copy.cpp:314",
        "onednn_verbose,v1,primitive,create:dispatch,convolution,unsupported format tag,"
        "src/cpu/x64/jit_brgemm_conv_utils.cpp:261",
        "onednn_verbose,v1,primitive,exec:check,primitive,unused primitive execution argument (80),"
        "src/common/primitive_exec_types.cpp:136",
        "onednn_verbose,v1,primitive,create:cache_miss,cpu,convolution,jit:avx512_core,forward_training,"
        "src:f32::blocked:abcd::f0 wei:f32:a:blocked:Acdb16a::f0,,alg:convolution_direct,mb2_ic3oc32,0.2",
    ):
        assert tally.add(line) is not None
    data = tally.to_json()
    assert list(data["primitives"]) == ["convolution"] and data["other_lines"] == 4
    assert (data["cache_misses"], data["lines"]) == (1, 5)
    assert "other" not in kernel_line(data)


def test_isa_of_and_short_isa() -> None:
    assert [isa_of(i) for i in ("jit:avx2", "brg_matmul:avx10_1_512_amx", "gemm:jit", "ref:any")] == \
        ["avx2", "avx10_1_512_amx", "", ""]
    assert [short_isa(s) for s in (AMX_ISA, "Intel AVX2", "Intel AVX2 with Intel DL Boost", None)] == \
        ["AMX", "AVX2", "AVX2 VNNI", "?"]
    # whole words: "bfloat16" is BF16 and never FP16; "float16" is FP16
    assert short_isa("Intel AVX-512 with Intel DL Boost and bfloat16 support") == "AVX-512 VNNI BF16"
    assert short_isa("Intel AVX-512 with float16, Intel DL Boost and bfloat16 support") == "AVX-512 VNNI BF16 FP16"
    assert short_isa("Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions") == "AVX-512"


def test_nothing_ran_through_onednn() -> None:
    data = KernelTally().to_json()
    assert kernel_line(data).startswith("no oneDNN line") and kernel_warnings(data) == []
    assert kernel_cell(data) == "no oneDNN" and kernel_cell(None) == "-"


# ------------------------------------------------------------------------------ the stream filter

RECORDED = (LOGS / "amx_autocast_bf16.log").read_bytes().splitlines(keepends=True)


def mixed_stream(seed: int) -> tuple[bytes, bytes, bytes]:
    """(what the pipe carries, the program's own bytes, the verbose lines): the program's lines
    are sometimes written in pieces, with oneDNN's whole lines landing between the pieces."""
    rng = random.Random(seed)
    stream, user, verbose = [], [], []
    texts = [b"epoch 1 loss 0.5\n", b"\xff\xfe binary \r progress\n", b"mentions onednn_verbose, in a sentence\n",
             b"dnnl_verbose,but not a real one\n", b"ends with o", b"\n", b"last onednn_verbose,v1 words\n"]
    pending = list(RECORDED)
    for text in texts * 3:
        if rng.random() < 0.5 and len(text) > 4:       # oneDNN's line lands in the middle of ours
            cut = rng.randrange(1, len(text) - 1)
            line = pending.pop(0)
            stream += [text[:cut], line, text[cut:]]
            verbose.append(line)
        else:
            stream.append(text)
        user.append(text)
        while pending and rng.random() < 0.4:
            verbose.append(pending[0])
            stream.append(pending.pop(0))
    stream += pending
    verbose += pending
    return b"".join(stream), b"".join(user), b"".join(verbose)


@pytest.mark.parametrize("seed", range(6))
def test_filter_gives_back_the_program_bytes_exactly(seed: int) -> None:
    data, user, verbose = mixed_stream(seed)
    rng = random.Random(seed)
    raw = __import__("io").BytesIO()
    keep = VerboseFilter(raw=raw)
    out, at = [], 0
    while at < len(data):            # pipe reads of any size, cutting markers and lines anywhere
        size = rng.choice([1, 2, 7, 15, 64, 4096])
        out.append(keep.feed(data[at:at + size]))
        at += size
    out.append(keep.close())
    assert b"".join(out) == user
    assert raw.getvalue() == verbose
    assert keep.taken == len(RECORDED)
    assert keep.tally.to_json()["primitives"]["convolution"]["creations"] == 21


def test_filter_passes_bytes_on_as_they_come() -> None:
    keep = VerboseFilter()
    assert keep.feed(b"step 1\nstep 2 (no newline yet)") == b"step 1\nstep 2 (no newline yet)"
    assert keep.feed(b"...go") == b"...g"           # "o" could start the marker: held back
    assert keep.feed(b"od\n") == b"ood\n"
    assert keep.feed(b"onednn_verbose,v1,info,cpu,isa:Intel AVX2") == b""   # a verbose line until its newline
    assert keep.feed(b"\nafter\n") == b"after\n"
    assert keep.tally.isa == "Intel AVX2"


def test_filter_end_of_stream_and_overlong_lines() -> None:
    keep = VerboseFilter()
    assert keep.feed(b"done onednn_verbose,v1,info,cpu,isa:Intel AVX2") == b"done "
    assert keep.close() == b""                       # a cut-off verbose line is counted, not printed
    assert keep.tally.isa == "Intel AVX2"
    keep = VerboseFilter()
    assert keep.feed(b"xo") == b"x" and keep.close() == b"o"
    keep = VerboseFilter()
    long = b"onednn_verbose," + b"x" * (MAX_VERBOSE_LINE + 10)
    assert keep.feed(long) == long and keep.tally.lines == 0     # not oneDNN's: given back unchanged


def test_filter_gives_back_binary_bytes_after_a_marker() -> None:
    """oneDNN prints text: a program's binary output holding ``onednn_verbose,v1,info,`` up to a newline is the
    program's (it was taken out as a header: the bytes vanished from the output)."""
    keep = VerboseFilter()
    binary = b"\x89PNG onednn_verbose,v1,info,cpu,isa:\x00\xff\x13 raw pixels\n"
    control = b"onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit,undef,\x1b[2K,,,2x2,0.1\n"
    assert keep.feed(binary + control + RECORDED[0]) + keep.close() == binary + control
    assert keep.taken == 1 and keep.tally.lines == 1


def test_filter_raw_log_failure_keeps_counting() -> None:
    class Full:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

    keep = VerboseFilter(raw=Full())  # type: ignore[arg-type]
    assert keep.feed(b"".join(RECORDED[:12]) + b"mine\n") == b"mine\n"
    assert keep.raw_error is not None and keep.raw_error.errno == 28
    assert keep.tally.lines == 12


# ------------------------------------------------------------------------------ option and plan

MACHINE = synthetic_machine(nodes=1, cores_per_l3=2, smt=1)


def test_kernel_report_sets_creation_level_verbose_per_instance() -> None:
    options = build_options({"kernel_report": True, "ninstances": 2}, program="x.py")
    result = plan(options, MACHINE, {"PATH": "/usr/bin"})
    assert result.kernel_report
    assert all(i.env["ONEDNN_VERBOSE"] == "profile_create" for i in result.instances)
    assert not plan(build_options({}, program="x.py"), MACHINE, {}).kernel_report
    config = build_options({}, {"kernel-report": True}, config_source="my.toml", program="x.py")
    assert config.kernel_report
    with pytest.raises(OptionError, match="--kernel-report: expected true or false"):
        build_options({}, {"kernel_report": "yes"}, program="x.py")


@pytest.mark.parametrize("user, kept, note", [
    ({"ONEDNN_VERBOSE": "all"}, "all", "prints a line per execution"),
    ({"ONEDNN_VERBOSE": "none"}, "none", "prints no primitive creation lines"),
    ({"ONEDNN_VERBOSE": "1"}, "1", "prints no primitive creation lines"),
    ({"ONEDNN_VERBOSE": "profile_create,filter=conv"}, "profile_create,filter=conv", "hides the primitives"),
    ({"DNNL_VERBOSE": "1"}, None, "kept your DNNL_VERBOSE=1"),
])
def test_a_users_own_verbose_setting_is_kept_and_explained(user: dict, kept: str | None, note: str) -> None:
    result = plan(build_options({"kernel_report": True}, program="x.py"), MACHINE, user)
    assert result.instances[0].env.get("ONEDNN_VERBOSE") == kept
    assert any(note in warning for warning in result.warnings), result.warnings
    if kept is not None:
        assert f"kept your ONEDNN_VERBOSE={kept} (xlaunch did not override it)" in result.warnings
