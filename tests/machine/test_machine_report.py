"""report.py: --show-topology and --check-isa views of recorded machines."""
from __future__ import annotations

import json

import pytest
from machine_trees import MACHINE_NAMES, machine_tree

from xlaunch._records import replace
from xlaunch.machine import ISA_FLAGS, load_machine
from xlaunch.machine.report import (
    format_isa,
    format_topology,
    isa_report,
    machine_summary,
    topology_json,
)

NAMES = MACHINE_NAMES


@pytest.fixture(autouse=True)
def _no_onednn_ceiling(monkeypatch):
    """The dtype advice follows oneDNN's ceiling: these tests read the recorded machines' own flags."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)


def load(name: str):
    return load_machine(str(machine_tree(name)))


@pytest.mark.parametrize("name", NAMES)
def test_topology_json_round_trips_through_json_and_matches_the_model(name):
    m = load(name)
    data = json.loads(json.dumps(topology_json(m)))
    assert [c["cpus"] for c in data["cores"]] == [list(c.cpus) for c in m.cores]
    assert [n["id"] for n in data["nodes"]] == [n.id for n in m.nodes]
    assert [d["cpus"] for d in data["l3_domains"]] == [list(d.cpus) for d in m.l3_domains]
    assert data["allowed_cpus"] == list(m.allowed_cpus)
    assert data["allowed_mems"] == list(m.allowed_mems)
    assert data["cpu_budget"] == m.cpu_budget
    assert set(data["isa"]) == set(ISA_FLAGS)
    assert sum(data["core_types"].values()) == len(m.cores)
    assert len(data["cpus"]) == len(m.cpus)


@pytest.mark.parametrize("name", NAMES)
def test_format_topology_names_every_node_and_core(name):
    m = load(name)
    text = format_topology(m)
    for node in m.nodes:
        assert f"node {node.id:>3}:" in text
    assert text.count("package") >= len(m.cores)
    assert "Allowed CPUs:" in text and "CPU budget:" in text and "Libraries:" in text


def test_format_topology_details():
    container = format_topology(load("container-cpuset"))
    assert "Allowed CPUs: 4-7,36-39 (8)" in container
    assert "CPU budget: 2.5 CPUs" in container
    hbm = format_topology(load("memory-only-node"))
    assert "node   2: cpus no CPUs (memory only)" in hbm
    hybrid = format_topology(load("hybrid-laptop"))
    assert "8 efficiency, 4 performance (hybrid)" in hybrid
    offline = format_topology(load("offline-cpus"))
    assert "offline: 3,5,13" in offline
    no_node = format_topology(load("vm-no-node"))
    assert "Notes:" in no_node


def test_l3_sizes_that_are_not_whole_mib_are_shown_in_kib():
    """A 1.5 MiB L3 (small Arm SoCs) read '1 MiB', a 512 KiB one '0 MiB'."""
    m = load("vm-adjacent-smt")
    for size, shown in ((1536, "1536 KiB"), (512, "512 KiB"), (32768, "32 MiB")):
        page = format_topology(replace(m, l3_domains=(replace(m.l3_domains[0], size_kib=size),)))
        assert f"L3 0: cpus 0-7 ({shown})" in page


def test_machine_summary():
    summary = machine_summary(load("container-cpuset"))
    assert summary["cpus_online"] == 64 and summary["cpus_allowed"] == 8
    assert summary["allowed_cpulist"] == "4-7,36-39" and summary["cpu_budget"] == 2.5
    assert summary["nodes"] == [0] and summary["cores"] == 32
    json.dumps(summary)


@pytest.mark.parametrize("name, fast", [
    ("xeon-2s-amx", {"fp32": True, "bf16": True, "fp16": True, "int8": True}),
    ("epyc-4node-nps4", {"fp32": True, "bf16": False, "fp16": False, "int8": True}),   # AVX2 int8 (measured)
    ("hybrid-laptop", {"fp32": True, "bf16": False, "fp16": False, "int8": True}),
    ("vm-adjacent-smt", {"fp32": True, "bf16": False, "fp16": False, "int8": True}),
])
def test_dtype_advice(name, fast):
    report = isa_report(load(name))
    assert {dtype: v["fast"] for dtype, v in report["advice"].items()} == fast


def test_advice_reasons():
    assert isa_report(load("xeon-2s-amx"))["advice"]["bf16"]["why"].startswith("AMX-BF16")
    assert "AVX_VNNI" in isa_report(load("hybrid-laptop"))["advice"]["int8"]["why"]
    assert "AVX512_VNNI" in isa_report(load("vm-adjacent-smt"))["advice"]["int8"]["why"]
    avx2_only = isa_report(load("epyc-4node-nps4"))["advice"]["int8"]["why"]
    assert avx2_only.startswith("AVX2 integer multiply-adds, no VNNI") and "--probe" in avx2_only
    sse = load("epyc-4node-nps4")
    sse = replace(sse, isa=replace(sse.isa, flags=sse.isa.flags - {"avx2", "fma"}))
    assert isa_report(sse)["advice"]["int8"] == {
        "fast": False, "why": "no AMX_INT8, VNNI or AVX2: int8 matmuls run on SSE paths, rarely faster than fp32"}


def test_amx_not_granted_falls_back_to_avx512_paths():
    m = load("xeon-2s-amx")
    denied = replace(m, isa=replace(m.isa, amx_permitted=False))
    advice = isa_report(denied)["advice"]
    assert advice["bf16"] == {"fast": True, "why": "AVX512_BF16 dot products"}
    assert advice["int8"] == {"fast": True, "why": "AVX512_VNNI dot products"}
    assert "AMX granted to this process: no" in format_isa(isa_report(denied))


def test_isa_report_shape_and_table():
    report = isa_report(load("xeon-2s-amx"))
    assert list(report["isa"]) == list(ISA_FLAGS)
    assert report["isa"]["amx_tile"] is True and report["isa"]["amx_fp16"] is False
    assert report["vendor"] == "GenuineIntel" and report["amx_permitted"] is None
    assert "torch" not in report
    table = format_isa(report)
    assert "amx_fp16     no" in table and "amx_bf16     yes" in table
    assert "not checked" in table
    json.dumps(report)


def test_isa_report_with_torch():
    torch = pytest.importorskip("torch")
    report = isa_report(load_machine(), with_torch=True)
    info = report["torch"]
    assert info["available"] and info["version"] == torch.__version__
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["onednn_version"] and info["onednn_version"][0].isdigit()
    assert "cpu capability" in format_isa(report)


@pytest.mark.parametrize("cap, level, nn, llm", [("", "amx", "avx512", "avx512_bf16"),
                                                  ("avx2", "avx2", "avx2", "avx2"),
                                                  ("baseline", "baseline", "baseline", "baseline")])
def test_check_isa_says_which_level_the_kernels_run_at(monkeypatch, cap, level, nn, llm):
    monkeypatch.setenv("XLAUNCH_CPU_ISA", cap)
    report = isa_report(load("xeon-2s-amx"))
    assert report["kernels"] == {"level": level, "cap": cap or None, "error": None,
                                 "libraries": {"xlaunch.nn": nn, "xlaunch.llm": llm}}
    assert f"xlaunch kernels: {level} level (xlaunch.nn {nn}, xlaunch.llm {llm}; " in format_isa(report)
    capped = "the capped kernels do not use it: xlaunch.llm widens bf16 to fp32 and defaults to fp32 activations"
    assert (capped in format_isa(report)) is (cap in ("avx2", "baseline")), format_isa(report)


def test_check_isa_on_cascade_lake_runs_llm_vnni_kernels(monkeypatch):
    """A VNNI CPU without AVX512_BF16 (the recorded Cascade Lake VM): xlaunch.llm's avx512_vnni level, whose
    INT8/INT4 kernels use vpdpbusd; xlaunch.nn has nothing VNNI-specific and runs avx512."""
    monkeypatch.delenv("XLAUNCH_CPU_ISA", raising=False)
    report = isa_report(load("vm-adjacent-smt"))
    assert report["kernels"] == {"level": "avx512_vnni", "cap": None, "error": None,
                                 "libraries": {"xlaunch.nn": "avx512", "xlaunch.llm": "avx512_vnni"}}


def test_check_isa_names_a_cap_above_the_cpu_in_one_line(monkeypatch):
    m = load("xeon-2s-amx")
    no_avx512 = replace(m, isa=replace(m.isa, flags=frozenset(f for f in m.isa.flags if not f.startswith("avx512"))))
    monkeypatch.setenv("XLAUNCH_CPU_ISA", "avx512")
    assert ("xlaunch kernels: XLAUNCH_CPU_ISA=avx512: this CPU cannot execute it; it runs: baseline, avx2"
            in format_isa(isa_report(no_avx512)).splitlines())


def test_dtype_advice_follows_the_onednn_ceiling():
    """``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX machine: oneDNN's bf16, fp16 and int8 are AVX2's (the table said
    "bf16 yes: AMX-BF16 tiles"); fp32 GEMMs are MKL's, not capped; each changed verdict names the ceiling."""
    m = load("xeon-2s-amx")
    advice = isa_report(m, environ={"DNNL_MAX_CPU_ISA": "AVX2"})["advice"]
    assert {dtype: v["fast"] for dtype, v in advice.items()} == {"fp32": True, "bf16": False, "fp16": False,
                                                                  "int8": True}
    assert advice["fp32"]["why"] == "AVX-512 FMA (avx512f)"
    assert advice["bf16"]["why"].endswith("(under DNNL_MAX_CPU_ISA=AVX2; the CPU has: AMX-BF16 tiles)")
    assert advice["int8"]["why"].startswith("AVX2 integer multiply-adds")
    vnni = isa_report(m, environ={"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"})["advice"]
    assert vnni["int8"] == {"fast": True, "why": "AVX512_VNNI dot products (under ONEDNN_MAX_CPU_ISA=avx512_core_vnni; "
                                                 "the CPU has: AMX-INT8 tiles)"}
    assert isa_report(m, environ={"ONEDNN_MAX_CPU_ISA": "ALL"})["advice"] == isa_report(m, environ={})["advice"]


def test_check_isa_reads_the_ceiling_from_its_environment():
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLAUNCH_FSROOT": str(machine_tree("xeon-2s-amx")), "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-m", "xlaunch", "--check-isa", "--json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["advice"]["bf16"]["fast"] is False


@pytest.mark.parametrize("flag, does", [("--probe", "measures"), ("--torch", "asks torch about")])
def test_probe_and_torch_refuse_a_recorded_machine(flag, does):
    """--probe measured this machine and showed it as the recording's (a Xeon 8480+ "measured 0.03x fp32 (fp16)"
    on this host); --torch showed this host's torch capability under the recording's CPU."""
    import os
    import subprocess
    import sys

    tree = str(machine_tree("xeon-2s-amx"))
    done = subprocess.run([sys.executable, "-m", "xlaunch", "--check-isa", flag],
                          env={**os.environ, "XLAUNCH_FSROOT": tree}, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"xlaunch: error: {flag}: {does} this machine, not the recorded one in "
                           f"XLAUNCH_FSROOT={tree} (unset XLAUNCH_FSROOT for this one)\n")


@pytest.mark.parametrize("argv, flag", [
    (["--check-isa"], "--check-isa"), (["--show-topology"], "--show-topology"), (["--show-cache"], "--show-cache"),
    (["--help"], "--help"), (["--version"], "--version"), (["-q", "--dry-run", "--no-python", "true"], "--dry-run"),
    (["-q", "--dry-run", "--json", "--no-python", "true"], "--dry-run"),
    (["-q", "--nproc-per-node", "1", "--dry-run", "--no-python", "true"], "--dry-run")],
    ids=["check-isa", "show-topology", "show-cache", "help", "version", "dry-run", "dry-run-json", "nproc-dry-run"])
def test_a_page_that_cannot_be_written_is_one_line_and_status_1(argv, flag, tmp_path):
    """Stdout on a full disk (/dev/full): the page is the whole job, so its loss is said in one line (it was
    OSError's traceback)."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "xlaunch", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60, env={**os.environ, "XLAUNCH_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr == f"xlaunch: error: {flag}: cannot write to stdout: No space left on device\n"
