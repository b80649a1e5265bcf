"""Host checks (THP, governor, NUMA balancing, SMT) read from machine roots built in tmp_path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xlaunch.machine import Host, load_machine
from xlaunch.machine.host import bracketed, governor_summary, host_checks, host_json, read_host
from xlaunch.machine.report import format_topology, topology_json

REPO = Path(__file__).resolve().parents[2]
CPU = "sys/devices/system/cpu"
THP = "sys/kernel/mm/transparent_hugepage"


def build(root: Path, files: dict[str, str], dirs: tuple[str, ...] = ()) -> str:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    for relative in dirs:
        (root / relative).mkdir(parents=True, exist_ok=True)
    return str(root)


def governors(*names: str) -> dict[str, str]:
    """Per-CPU policies as the kernel shows them: cpuN/cpufreq is a link to cpufreq/policyN."""
    files = {}
    for i, name in enumerate(names):
        files[f"{CPU}/cpufreq/policy{i}/scaling_governor"] = name
        files[f"{CPU}/cpu{i}/cpufreq/scaling_governor"] = name
    return files


SERVER = {
    f"{THP}/enabled": "always madvise [never]",
    f"{THP}/defrag": "[always] defer defer+madvise madvise never",
    **governors("performance", "powersave", "powersave", "performance", "powersave"),
    "proc/sys/kernel/numa_balancing": "1",
    f"{CPU}/smt/control": "on",
    f"{CPU}/smt/active": "1",
}


def checks_by_name(host: Host, cpu_nodes: int = 1):
    return {check.name: check for check in host_checks(host, cpu_nodes)}


@pytest.mark.parametrize("text, word", [
    ("always [madvise] never", "madvise"),
    ("[always] madvise never", "always"),
    ("always defer [defer+madvise] madvise never", "defer+madvise"),
    ("always madvise never", "unknown"),
    ("[]", "unknown"),
    (None, "unknown"),
])
def test_bracketed(text, word):
    assert bracketed(text) == word


def test_a_server_with_settings_that_matter(tmp_path):
    host = read_host(build(tmp_path, SERVER), [0, 1, 2, 3, 4])
    assert host == Host(thp_enabled="never", thp_defrag="always",
                        governors=(("powersave", 3), ("performance", 2)),
                        numa_balancing="1", smt_control="on", smt_active=True)
    assert governor_summary(host) == "mixed"
    checks = checks_by_name(host, cpu_nodes=2)
    assert checks["transparent_hugepage"].value == "enabled never, defrag always"
    assert "'madvise'" in checks["transparent_hugepage"].advice
    assert checks["cpufreq_governor"].value == "mixed: powersave (3 CPUs), performance (2 CPUs)"
    assert "governor powersave" in checks["cpufreq_governor"].advice
    assert "'performance'" in checks["cpufreq_governor"].advice
    assert checks["numa_balancing"].value == "enabled (1)"
    assert "kernel.numa_balancing=0" in checks["numa_balancing"].advice
    assert checks["smt"].value == "on, active" and "--use-logical-cores" in checks["smt"].advice


def test_only_online_cpus_count_for_the_governor(tmp_path):
    host = read_host(build(tmp_path, SERVER), [0, 3])
    assert host.governors == (("performance", 2),)
    assert checks_by_name(host)["cpufreq_governor"].advice is None


def test_numa_balancing_matters_only_with_several_cpu_nodes(tmp_path):
    host = read_host(build(tmp_path, SERVER), [0])
    assert checks_by_name(host, cpu_nodes=1)["numa_balancing"].advice is None
    assert checks_by_name(host, cpu_nodes=2)["numa_balancing"].advice is not None
    tiering = Host(numa_balancing="2")
    assert checks_by_name(tiering, cpu_nodes=2)["numa_balancing"].advice is None
    assert checks_by_name(tiering)["numa_balancing"].value == "memory tiering only (2)"


def test_a_tuned_server_gets_no_advice_but_smt(tmp_path):
    root = build(tmp_path, {
        f"{THP}/enabled": "[always] madvise never",
        f"{THP}/defrag": "always defer [defer+madvise] madvise never",
        **governors("performance", "performance"),
        "proc/sys/kernel/numa_balancing": "0",
        f"{CPU}/smt/control": "off",
        f"{CPU}/smt/active": "0",
    })
    checks = checks_by_name(read_host(root, [0, 1]), cpu_nodes=2)
    assert [c.advice for c in checks.values()] == [None, None, None, None]
    assert checks["cpufreq_governor"].value == "performance"
    assert checks["numa_balancing"].value == "disabled (0)"
    assert checks["smt"].value == "off, inactive"


def test_thp_madvise_advises_asking_for_huge_pages():
    check = checks_by_name(Host(thp_enabled="madvise", thp_defrag="madvise"))["transparent_hugepage"]
    assert "THP_MEM_ALLOC_ENABLE=1" in check.advice


def test_a_vm_without_a_frequency_driver_has_governor_none(tmp_path):
    root = build(tmp_path, {f"{CPU}/smt/control": "notsupported", f"{CPU}/smt/active": "0"},
                 dirs=(f"{CPU}/cpufreq", f"{CPU}/cpu0", f"{CPU}/cpu1"))
    host = read_host(root, [0, 1])
    assert host.governors == (("none", 2),) and governor_summary(host) == "none"
    checks = checks_by_name(host)
    assert checks["cpufreq_governor"].advice is None
    assert checks["cpufreq_governor"].value.startswith("none (no cpufreq")
    assert checks["smt"].value == "notsupported, inactive" and checks["smt"].advice is None


def test_nothing_readable_is_unknown_never_an_error(tmp_path):
    host = read_host(str(tmp_path), [0, 1])
    assert host == Host()
    assert governor_summary(host) == "unknown"
    checks = checks_by_name(host, cpu_nodes=4)
    assert [c.value for c in checks.values()] == [
        "enabled unknown, defrag unknown", "unknown", "unknown", "unknown, active unknown"]
    assert [c.advice for c in checks.values()] == [None, None, None, None]


def test_odd_values_are_unknown(tmp_path):
    root = build(tmp_path, {
        f"{THP}/enabled": "garbage",
        "proc/sys/kernel/numa_balancing": "7",
        f"{CPU}/smt/control": "maybe",
        f"{CPU}/smt/active": "yes",
        f"{CPU}/cpufreq/policy0/scaling_governor": "",
        f"{CPU}/cpu0/cpufreq/scaling_governor": "",
    })
    host = read_host(root, [0, 1])
    assert (host.thp_enabled, host.numa_balancing, host.smt_control, host.smt_active) == (
        "unknown", "unknown", "unknown", None)
    assert host.governors == (("none", 1), ("unknown", 1))      # cpu1 has no cpufreq directory


def test_per_cpu_governors_without_the_cpufreq_directory_are_unknown(tmp_path):
    root = build(tmp_path, {f"{CPU}/cpu0/cpufreq/scaling_governor": "performance"})
    assert read_host(root, [0]).governors == ()


def test_host_json_shape(tmp_path):
    data = json.loads(json.dumps(host_json(read_host(build(tmp_path, SERVER), [0, 1, 2, 3, 4]), 2)))
    assert data["transparent_hugepage"]["enabled"] == "never"
    assert data["transparent_hugepage"]["defrag"] == "always"
    assert data["cpufreq_governor"]["value"] == "mixed"
    assert data["cpufreq_governor"]["cpus"] == {"powersave": 3, "performance": 2}
    assert data["numa_balancing"] == {"value": "1", "meaning": "enabled",
                                      "advice": data["numa_balancing"]["advice"]}
    assert data["smt"]["control"] == "on" and data["smt"]["active"] is True
    assert all(isinstance(data[k]["advice"], str) for k in data)


def test_load_machine_carries_the_host_and_show_topology_prints_it(tmp_path):
    root = build(tmp_path, SERVER)
    machine = load_machine(root)
    assert machine.host == read_host(root, machine.online_cpus)
    assert topology_json(machine)["host"] == host_json(machine.host, 1)
    text = format_topology(machine)
    host_part = text[text.index("\nHost:\n"):]
    assert "  transparent huge pages:    enabled never, defrag always" in host_part
    assert "advice: " in host_part and "SMT:" in host_part


def test_show_topology_json_has_host_from_the_root(tmp_path):
    root = build(tmp_path, SERVER)
    env = {**os.environ, "XLAUNCH_FSROOT": root, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "xlaunch", "--show-topology", "--json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    host = json.loads(run.stdout)["host"]
    assert host["transparent_hugepage"]["enabled"] == "never"
    assert host["smt"] == {"control": "on", "active": True, "advice": host["smt"]["advice"]}
    text = subprocess.run([sys.executable, "-m", "xlaunch", "--show-topology"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert text.returncode == 0 and "automatic NUMA balancing:  enabled (1)" in text.stdout
