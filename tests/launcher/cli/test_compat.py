"""ipexrun and run_cpu command lines, as their documentation and tests write them, give the plan
they meant (on recorded machines), or one line saying what to use instead.

The behaviours checked are those of IPEX's launcher docs/tests and torch's
``test/backends/xeon/test_launch.py``: core lists per node (physical vs logical), instance
shapes, instance selection (``--rank``/``--instance-idx``), allocator and OpenMP switches,
binding switches, log directory; plus a real multi-instance run with run_cpu's test line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from machine_trees import machine_tree

from xlaunch.launcher.cli import command as cli
from xlaunch.launcher.cli.compat import SPELLINGS, flags

REPO = Path(__file__).resolve().parents[3]
XEON = "xeon-2s-amx"            # 2 sockets x 56 cores, SMT: node 0 = 0-55,112-167; node 1 = 56-111,168-223
NODE0_CORES, NODE1_CORES = list(range(0, 56)), list(range(56, 112))


def plan(capsys, *argv: str, tree: str = XEON) -> dict:
    environ = {"PATH": os.environ.get("PATH", ""), "XLAUNCH_FSROOT": str(machine_tree(tree))}
    status = cli.run(["--dry-run", "--json", *argv, "--no-python", "true"], environ)
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


def refused(capsys, *argv: str) -> str:  # noqa: D103 - one line, exit 2, nothing printed
    environ = {"PATH": os.environ.get("PATH", ""), "XLAUNCH_FSROOT": str(machine_tree(XEON))}
    status = cli.run(["--dry-run", *argv, "--no-python", "true"], environ)
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1, err
    return err


def cpus(result: dict) -> list[list[int]]:
    return [i["cpus"] for i in result["instances"]]


# ---------------------------------------------------------------- run_cpu's documented lines

def test_run_cpu_throughput_mode_is_one_instance_per_node_on_physical_cores(capsys) -> None:
    assert cpus(plan(capsys, "--throughput-mode")) == [NODE0_CORES, NODE1_CORES]


def test_run_cpu_multi_instance_defaults_to_one_per_node(capsys) -> None:
    assert cpus(plan(capsys, "--multi-instance")) == [NODE0_CORES, NODE1_CORES]
    assert len(cpus(plan(capsys, "--multi-instance", "--ninstances", "4"))) == 4


def test_run_cpu_ninstances_and_cores(capsys) -> None:
    shape = cpus(plan(capsys, "--ninstances", "14", "--ncores-per-instance", "4"))
    assert shape[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(shape) == 14


def test_run_cpu_rank_runs_one_instance_of_the_split(capsys) -> None:
    result = plan(capsys, "--ninstances", "2", "--rank", "1")
    assert [i["index"] for i in result["instances"]] == [1]
    assert cpus(result) == [NODE1_CORES]
    assert len(plan(capsys, "--ninstances", "2", "--rank", "-1")["instances"]) == 2


def test_run_cpu_core_list_with_spaces_and_rank(capsys) -> None:
    result = plan(capsys, "--core-list", "0, 1, 2, 3", "--ninstances", "2", "--ncores-per-instance", "2", "--rank", "0")
    assert cpus(result) == [[0, 1]]


def test_run_cpu_node_id_and_logical_cores(capsys) -> None:
    assert cpus(plan(capsys, "--node-id", "1")) == [NODE1_CORES]
    assert cpus(plan(capsys, "--node-id", "0", "--use-logical-core")) == [NODE0_CORES + list(range(112, 168))]
    assert len(plan(capsys, "--node-id", "-1", "--throughput-mode")["instances"]) == 2   # -1: every node


def test_run_cpu_latency_mode_and_skip_cross_node(capsys) -> None:
    latency = cpus(plan(capsys, "--latency-mode"))
    assert len(latency) == 28 and all(len(c) == 4 for c in latency)
    for slice_ in cpus(plan(capsys, "--skip-cross-node-cores", "--ncores-per-instance", "10")):
        assert set(slice_) <= set(NODE0_CORES) or set(slice_) <= set(NODE1_CORES)


def test_run_cpu_allocator_and_openmp_switches(capsys) -> None:
    assert plan(capsys, "--enable-jemalloc")["allocator"] == "jemalloc"
    assert plan(capsys, "--enable-tcmalloc")["allocator"].startswith("tcmalloc")
    assert plan(capsys, "--use-default-allocator")["allocator"] in ("default", "glibc")
    assert plan(capsys, "--disable-iomp")["openmp"] == "gnu"
    preload = plan(capsys, "--disable-iomp")["instances"][0]["env"].get("LD_PRELOAD", "")
    assert "libiomp5" not in preload


def test_run_cpu_binding_switches(capsys) -> None:
    numa_off = plan(capsys, "--disable-numactl")["instances"][0]
    assert numa_off["bind"] == "native" and numa_off["membind"] == "none"       # CPUs still pinned
    both_off = plan(capsys, "--disable-numactl", "--disable-taskset")["instances"][0]
    assert both_off["bind"] == "none"
    assert plan(capsys, "--disable-taskset")["instances"][0]["bind"] == "native"


# ---------------------------------------------------------------- ipexrun's documented lines

def test_ipexrun_instance_idx_and_cores_list(capsys) -> None:
    assert cpus(plan(capsys, "--ninstances", "2", "--instance-idx", "0")) == [NODE0_CORES]
    assert len(plan(capsys, "--ninstances", "2", "--instance-idx", "-1")["instances"]) == 2
    assert cpus(plan(capsys, "--cores-list", "0-3", "--ninstances", "2", "--ncores-per-instance", "2",
                     "--instance-idx", "0")) == [[0, 1]]


def test_ipexrun_nodes_list_allocator_runtime(capsys) -> None:
    result = plan(capsys, "--nodes-list", "1", "--memory-allocator", "jemalloc", "--omp-runtime", "default", "--benchmark")
    assert cpus(result) == [NODE1_CORES]
    assert result["allocator"] == "jemalloc" and result["openmp"] == "gnu"
    assert "dirty_decay_ms:-1" in result["instances"][0]["env"]["MALLOC_CONF"]


def test_ipexrun_multi_task_manager(capsys) -> None:
    taskset = plan(capsys, "--multi-task-manager", "taskset")["instances"][0]
    assert taskset["bind"] == "taskset" and os.path.basename(taskset["argv"][0]) == "taskset"
    assert plan(capsys, "--multi-task-manager", "none")["instances"][0]["bind"] == "none"
    assert "not one of" in refused(capsys, "--multi-task-manager", "hwloc")


def test_ipexrun_use_e_cores_takes_efficiency_cores_too(capsys) -> None:
    default = sum(len(c) for c in cpus(plan(capsys, tree="hybrid-laptop")))
    with_e = sum(len(c) for c in cpus(plan(capsys, "--use-e-cores", tree="hybrid-laptop")))
    assert with_e > default


def test_numactl_style_membind_node_list(capsys) -> None:
    result = plan(capsys, "--ninstances", "2", "--membind", "1")
    assert [i["mem_nodes"] for i in result["instances"]] == [[1], [1]]
    assert [i["membind"] for i in result["instances"]] == ["bind", "bind"]
    assert "no NUMA node 7" in refused(capsys, "--membind", "7")
    assert plan(capsys, "--membind", "interleave")["instances"][0]["membind"] == "interleave"


def test_ipexrun_distributed_spellings(capsys) -> None:
    result = plan(capsys, "--nprocs-per-node", "2", "--ccl-worker-count", "1")
    assert len(result["instances"]) == 2
    assert all(i["env"]["XLAUNCH_RESERVED_CPUS"] for i in result["instances"])
    assert "--reserve-cores" in refused(capsys, "--logical-cores-for-ccl")


# ---------------------------------------------------------------- refusals and contradictions

@pytest.mark.parametrize("argv, words", [
    (["--enable-profiling"], "torch.profiler"),
    (["--hostfile", "hosts"], "--per-rank"),
    (["--extra-mpi-params", "-x A"], "mpirun"),
    (["--distributed"], "--nproc-per-node"),
    (["--disable-ipex-graph-mode"], "XLAUNCH_AUTO_OPTIMIZE_FREEZE=none"),
    (["--enable-jemalloc", "--memory-allocator", "tcmalloc"], "conflicts"),
    (["--enable-jemalloc", "--enable-tcmalloc"], "conflicts"),
    (["--disable-iomp", "--omp-runtime", "intel"], "conflicts"),
    (["--multi-task-manager", "numactl", "--disable-numactl", "--disable-taskset"], "conflicts"),
])
def test_refused_spellings_say_what_to_use(capsys, argv, words) -> None:
    err = refused(capsys, *argv)
    assert err.startswith(f"xlaunch: error: {argv[0] if 'conflicts' not in words else ''}".rstrip())
    assert words in err


def test_every_spelling_is_accepted_or_explained(capsys) -> None:
    """No spelling in the table is a 'no such option'."""
    for spelling in SPELLINGS:
        for flag in flags(spelling):
            argv = [flag, "0"] if spelling.takes_value and spelling.name != "multi_task_manager" else [flag]
            if spelling.name == "multi_task_manager":
                argv = [flag, "auto"]
            if spelling.name == "auto_ipex_verbose":
                argv = ["--auto-ipex", flag]
            environ = {"PATH": os.environ.get("PATH", ""), "XLAUNCH_FSROOT": str(machine_tree(XEON))}
            status = cli.run(["--dry-run", *argv, "--no-python", "true"], environ)
            _out, err = capsys.readouterr()
            assert "no such option" not in err, (flag, err)
            assert status in (0, 2), (flag, err)
            if status == 2:
                assert spelling.to_options is None or "conflicts" in err, (flag, err)


# ---------------------------------------------------------------- real runs

def test_run_cpu_test_launch_line_really_starts_the_instances(tmp_path) -> None:
    """torch's test_launch.py line, on this machine's core count: every instance runs and logs."""
    count = min(4, len(os.sched_getaffinity(0)))
    result = subprocess.run(
        [sys.executable, "-m", "xlaunch", "--ninstances", str(count), "--use-default-allocator", "--disable-iomp",
         "--disable-numactl", "--disable-taskset", "--log-path", str(tmp_path), "--no-python", "pwd"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.endswith(str(tmp_path))]
    assert len(lines) == count
    assert sorted(p.name for p in tmp_path.glob("xlaunch_instance_*.log")) == [
        f"xlaunch_instance_{i}.log" for i in range(count)]


# ---------------------------------------------------------------- --check-isa --probe wiring

def test_check_isa_probe_adds_the_measurement(capsys, monkeypatch) -> None:
    from xlaunch.launcher.observe import probe

    measured = {"torch": "2.13.0", "cases": [], "advice": ["keep fp32"]}
    monkeypatch.setattr(probe, "run_probe", lambda **_progress: dict(measured))
    monkeypatch.setattr(probe, "format_probe", lambda result: "PROBE TABLE")
    assert cli.run(["--check-isa", "--probe", "--json"], {"PATH": os.environ.get("PATH", "")}) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["probe"] == measured and "isa" in data
    assert cli.run(["--check-isa", "--probe"], {"PATH": os.environ.get("PATH", "")}) == 0
    assert capsys.readouterr().out.rstrip().endswith("PROBE TABLE")

    def fails(**_progress):
        raise probe.ProbeError("the probe child exited with status 1: no torch")

    monkeypatch.setattr(probe, "run_probe", fails)
    assert cli.run(["--check-isa", "--probe"], {"PATH": os.environ.get("PATH", "")}) == 1
    assert capsys.readouterr().err == "xlaunch: error: --probe: the probe child exited with status 1: no torch\n"


def test_probe_and_int8_refusals(capsys) -> None:
    assert "only applies with --check-isa" in refused(capsys, "--probe")
    assert "xlaunch.quantize(" in refused(capsys, "--auto-optimize", "--dtype", "int8")


# ---------------------------------------------------------------- notes, and errors as typed

@pytest.mark.parametrize("argv, note", [
    (["--ncore_per_instance", "4"], "--ncore_per_instance (ipexrun 1.x) means --ncores-per-instance"),
    (["--node-id", "1"], "--node-id (run_cpu) means --nodes-list"),
    (["--node-id", "-1"], "--node-id -1 (run_cpu) means every node"),
    (["--nodes-list", "-1"], "--nodes-list -1 (run_cpu) means every node"),
    (["--ninstances", "2", "--instance-idx", "-1"], "--instance-idx -1 (ipexrun) means every instance"),
    (["--ninstances", "2", "--instance-idx=-1"], "--instance-idx -1 (ipexrun) means every instance"),
    (["--core-list", "0-3"], "--core-list (run_cpu) means --cores-list"),
    (["--skip-cross-node-cores"], "--skip-cross-node-cores (run_cpu, ipexrun 1.x) means --bind-numa-node"),
    (["--nprocs-per-node", "2"], "--nprocs-per-node (ipexrun) means --nproc-per-node"),
    (["--nprocs-per-node", "2", "--ccl-worker-count", "1"], "--ccl-worker-count (ipexrun) means --reserve-cores"),
])
def test_every_old_spelling_prints_its_note(capsys, argv: list[str], note: str) -> None:
    environ = {"PATH": os.environ.get("PATH", ""), "XLAUNCH_FSROOT": str(machine_tree(XEON))}
    assert cli.run(["--dry-run", *argv, "--no-python", "true"], environ) == 0
    err = capsys.readouterr().err
    assert f"xlaunch: note: {note}" in err, err
    assert cli.run(["--dry-run", "--ncores-per-instance", "4", "--no-python", "true"], environ) == 0
    assert "note:" not in capsys.readouterr().err            # the option's own spelling: no note


@pytest.mark.parametrize("argv, option", [
    (["--ccl-worker-count", "56", "--ninstances", "2"], "--ccl-worker-count"),   # the slices have 56 cores
    (["--reserve-cores", "56", "--ninstances", "2"], "--reserve-cores"),
    (["--ncore_per_instance", "0"], "--ncore_per_instance"),
    (["--node-id", "9"], "--node-id"),
])
def test_errors_name_the_option_as_typed(capsys, argv: list[str], option: str) -> None:
    assert refused(capsys, *argv).startswith(f"xlaunch: error: {option}: ")


def test_help_says_membind_takes_a_node_list(capsys) -> None:
    assert cli.run(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--membind [bind|preferred|interleave|none|NODES]" in text and "node list" in text
