"""The machine model against this machine: affinity, /proc/cpuinfo, taskset, no torch import."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from host_cpus import heavy_imports, startup_modules
from machine_trees import machine_tree

from xlaunch.cpulist import parse_cpulist
from xlaunch.machine import ISA_FLAGS, load_machine

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLAUNCH_FSROOT", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=run_env(), cwd=str(REPO), **kwargs)


def cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    return set()


def test_allowed_cpus_equal_sched_getaffinity():
    assert load_machine("/").allowed_cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_allowed_cpus_follow_a_changed_affinity():
    original = os.sched_getaffinity(0)
    target = {min(original)}
    try:
        os.sched_setaffinity(0, target)
        assert load_machine().allowed_cpus == tuple(target)
    finally:
        os.sched_setaffinity(0, original)


def test_status_file_agrees_with_affinity():
    # The recorded-tree path (Cpus_allowed_list) and the live path give the same answer here.
    live = load_machine("/")
    as_recorded = load_machine("/", live=False)
    assert as_recorded.allowed_cpus == live.allowed_cpus
    assert as_recorded.isa.amx_permitted is None


def test_isa_flags_equal_proc_cpuinfo():
    flags = cpuinfo_flags()
    machine = load_machine()
    assert {f: machine.isa.has(f) for f in ISA_FLAGS} == {f: f in flags for f in ISA_FLAGS}
    assert machine.isa.flags == frozenset(flags)


def test_amx_permission_is_asked_live():
    machine = load_machine()
    if "amx_tile" in cpuinfo_flags():
        assert machine.isa.amx_permitted in (True, False)
    else:
        assert machine.isa.amx_permitted is False


def test_topology_matches_the_kernel_lists():
    machine = load_machine()
    with open("/sys/devices/system/cpu/online") as handle:
        assert machine.online_cpus == parse_cpulist(handle.read())
    assert len(machine.online_cpus) == os.cpu_count()
    assert sorted(c for core in machine.cores for c in core.cpus) == list(machine.online_cpus)


def test_found_libraries_exist():
    for lib in load_machine().libraries:
        assert os.path.isfile(lib.path), lib


# the last allowed CPU, alone: a narrower set than this process's (CPU 1 is not always allowed)
LAST = max(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 allowed CPUs to narrow them to one")


@needs_two
def test_taskset_report_functions_see_only_the_last_cpu():
    taskset = shutil.which("taskset")
    if taskset is None:
        pytest.skip("taskset not installed")
    code = ("import json; from xlaunch.machine import load_machine; "
            "from xlaunch.machine.report import topology_json; "
            "print(json.dumps(topology_json(load_machine())))")
    result = run([taskset, "-c", str(LAST), PY, "-c", code])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["allowed_cpus"] == [LAST] and data["allowed_cpulist"] == str(LAST)


@needs_two
def test_taskset_cli_show_topology_json_reports_only_the_last_cpu():
    taskset = shutil.which("taskset")
    if taskset is None:
        pytest.skip("taskset not installed")
    result = run([taskset, "-c", str(LAST), PY, "-m", "xlaunch", "--show-topology", "--json"])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["allowed_cpus"] == [LAST]
    assert set(data["online_cpus"]) == set(load_machine().online_cpus)


def test_cli_missing_fsroot_is_one_line_and_status_2(tmp_path):
    env_root = str(tmp_path / "missing")
    result = subprocess.run([PY, "-m", "xlaunch", "--show-topology"], capture_output=True, text=True,
                            timeout=120, cwd=str(REPO),
                            env={**os.environ, "XLAUNCH_FSROOT": env_root,
                                 "PYTHONPATH": str(REPO)})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "XLAUNCH_FSROOT" in lines[0] and env_root in lines[0]


def test_loading_the_machine_imports_no_torch_or_cpuinfo():
    code = ("import sys; from xlaunch.machine import load_machine; "
            "from xlaunch.machine.report import topology_json, isa_report, format_isa, format_topology; "
            "m = load_machine(); topology_json(m); format_topology(m); format_isa(isa_report(m)); "
            "print(' '.join(sorted(sys.modules)))")
    result = run([PY, "-c", code])
    assert result.returncode == 0, result.stderr
    # beyond what the interpreter imports on its own (`python -c pass`, same environment)
    baseline = startup_modules(PY, run_env(), REPO)
    assert heavy_imports(result.stdout.split(), ("torch", "cpuinfo", "numpy", "rich", "subprocess"), baseline) == []


def test_recorded_root_from_env_in_a_subprocess():
    code = ("import json; from xlaunch.machine import load_machine; "
            "m = load_machine(); print(json.dumps([m.root, list(m.allowed_cpus), m.cpu_budget]))")
    env = {**os.environ, "XLAUNCH_FSROOT": str(machine_tree("container-cpuset")),
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    root, allowed, budget = json.loads(result.stdout)
    assert allowed == [4, 5, 6, 7, 36, 37, 38, 39] and budget == 2.5
