"""Plans for every recorded machine tree x every mode, checked against the tree's own facts;
a few through the real CLI (``XLAUNCH_FSROOT=... python -m xlaunch --dry-run --json``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from machine_trees import MACHINE_NAMES, machine_tree

from xlaunch.machine import load_machine
from xlaunch.launcher.plan.options import Options
from xlaunch.launcher.plan.planner import plan

TREES = MACHINE_NAMES

MODES = {
    "default": {},
    "ninstances-2": {"ninstances": 2},
    "ncores-2": {"ncores_per_instance": 2},
    "2x2": {"ninstances": 2, "ncores_per_instance": 2},
    "throughput": {"throughput_mode": True},
    "latency": {"latency_mode": True},
    "logical": {"use_logical_cores": True},
    "logical-ncores-2": {"use_logical_cores": True, "ncores_per_instance": 2},
    "bind-numa-node-ncores-2": {"bind_numa_node": True, "ncores_per_instance": 2},
    "bind-numa-node-ninstances-2": {"bind_numa_node": True, "ninstances": 2},
    "core-type-all": {"core_type": "all"},
    "first-node": {"nodes_list": "FIRST_NODE"},
    "first-two-cpus": {"cores_list": "FIRST_TWO"},
    "instance-idx": {"ncores_per_instance": 1, "instance_idx": (0, 1)},
    "numactl": {"ninstances": 2, "bind_with": "numactl"},
}

_machines: dict = {}


def machine_of(tree: str):
    if tree not in _machines:
        _machines[tree] = load_machine(str(machine_tree(tree)))
    return _machines[tree]


def options_for(mode: str, machine) -> Options:
    values = dict(MODES[mode])
    if values.get("nodes_list") == "FIRST_NODE":
        values["nodes_list"] = (next(n.id for n in machine.nodes if set(n.cpus) & set(machine.allowed_cpus)),)
    if values.get("cores_list") == "FIRST_TWO":
        values["cores_list"] = tuple(machine.allowed_cpus[:2])
    return Options(program="infer.py", python="/py", **values)


def test_trees_are_there() -> None:
    assert len(TREES) >= 8, TREES


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("tree", TREES)
def test_plan_on_recorded_tree(tree: str, mode: str) -> None:
    m = machine_of(tree)
    o = options_for(mode, m)
    p = plan(o, m, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    allowed = set(m.allowed_cpus) & set(m.online_cpus)
    seen: list[int] = []
    for inst in p.instances:
        assert inst.cpus, inst
        seen.extend(inst.cpus)
        assert set(inst.cpus) <= allowed
        cpu_nodes = {m.cpu(c).node for c in inst.cpus} - {None}
        assert set(inst.mem_nodes) == cpu_nodes & set(m.allowed_mems)
        assert inst.env["OMP_NUM_THREADS"] == str(len(inst.cpus))
        assert inst.env["XLAUNCH_INSTANCE_INDEX"] == str(inst.index)
        if not o.use_logical_cores:      # one CPU per physical core
            assert len({m.core_of(c).index for c in inst.cpus}) == len(inst.cpus)
        else:                            # siblings together
            for c in inst.cpus:
                assert set(m.core_of(c).cpus) & allowed <= set(inst.cpus)
        if o.bind_numa_node or o.throughput_mode:
            assert len(cpu_nodes) <= 1
        if o.bind_with == "numactl":
            assert inst.argv[0].endswith("numactl") and inst.argv[-3:] == ("/py", "-u", "infer.py")
    assert len(seen) == len(set(seen)), "a CPU is in two instances"
    assert set(p.idle_cpus) == allowed - set(seen)
    sizes = [len(i.cpus) for i in p.instances]
    if o.ncores_per_instance is not None:
        assert set(sizes) == {o.ncores_per_instance}
    if o.ninstances is not None:
        assert len(p.instances) == o.ninstances
    if o.instance_idx is not None:
        assert [i.index for i in p.instances] == list(o.instance_idx)
    if o.latency_mode:
        assert max(sizes) <= 4
    if o.throughput_mode:
        nodes_with_cpus = {m.core_of(c).node for c in allowed}
        assert len(p.instances) == len(nodes_with_cpus)
    if mode == "default" and m.is_hybrid:
        assert all(m.core_of(c).kind == "performance" for c in seen)


@pytest.mark.parametrize("tree, argv, expect", [
    ("xeon-2s-amx", ["--throughput-mode"], [56, 56]),
    ("epyc-4node-nps4", ["--ncores-per-instance", "8", "--bind-numa-node"], [8] * 8),
    ("hybrid-laptop", ["--core-type", "efficiency"], [8]),
    ("container-cpuset", ["--use-logical-cores", "--ninstances", "2"], [4, 4]),
])
def test_dry_run_json_on_trees_through_the_cli(tree: str, argv: list[str], expect: list[int]) -> None:
    env = dict(os.environ, XLAUNCH_FSROOT=str(machine_tree(tree)))
    result = subprocess.run([sys.executable, "-m", "xlaunch", "--dry-run", "--json", *argv, "--no-python", "true"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [len(i["cpus"]) for i in data["instances"]] == expect
    m = machine_of(tree)
    for inst in data["instances"]:
        assert set(inst["cpus"]) <= set(m.allowed_cpus)
