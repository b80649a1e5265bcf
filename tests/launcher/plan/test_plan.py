"""The planner on synthetic machines: shapes, selections, memory nodes, binding, errors."""
from __future__ import annotations

import pytest
from synthetic_machines import synthetic_machine

from xlaunch.launcher.errors import PlanError
from xlaunch.launcher.plan.options import Options
from xlaunch.launcher.plan.planner import plan


def cpus_of(p):
    return [list(i.cpus) for i in p.instances]


def test_default_is_one_instance_on_every_physical_core() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=2)
    p = plan(Options(program="x.py"), m)
    assert cpus_of(p) == [list(range(8))]
    assert p.idle_cpus == tuple(range(8, 16))          # the SMT siblings
    assert p.instances[0].mem_nodes == (0, 1)
    assert p.instances[0].env["OMP_NUM_THREADS"] == "8"


def test_ninstances_alone_splits_evenly_and_reports_idle_cores() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=1)
    p = plan(Options(program="x.py", ninstances=3), m)
    assert cpus_of(p) == [[0, 1], [2, 3], [4, 5]]
    assert p.idle_cpus == (6, 7)
    assert any("2 of 8 cores stay idle" in w for w in p.warnings)


def test_ninstances_two_on_two_nodes_gives_one_node_each() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=2)
    p = plan(Options(program="x.py", ninstances=2), m)
    assert cpus_of(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [i.mem_nodes for i in p.instances] == [(0,), (1,)]
    assert [i.env["XLAUNCH_INSTANCE_INDEX"] for i in p.instances] == ["0", "1"]
    assert all(i.env["XLAUNCH_NINSTANCES"] == "2" for i in p.instances)
    assert [i.env["XLAUNCH_CPUS"] for i in p.instances] == ["0-3", "4-7"]


def test_cores_alone_fit_inside_nodes_when_the_count_allows() -> None:
    # 8 cores, 3 per instance: 2 fit in total, and 2 fit without crossing a node -> take those
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=1)
    p = plan(Options(program="x.py", ncores_per_instance=3), m)
    assert cpus_of(p) == [[0, 1, 2], [4, 5, 6]]


def test_instances_stay_inside_l3_domains_when_possible() -> None:
    # 1 node, 2 L3 domains of 3 cores; C=2 -> 3 fit in total but only 2 inside L3s
    m = synthetic_machine(nodes=1, l3_per_node=2, cores_per_l3=3, smt=1)
    p = plan(Options(program="x.py", ncores_per_instance=3), m)
    assert cpus_of(p) == [[0, 1, 2], [3, 4, 5]]
    p2 = plan(Options(program="x.py", ncores_per_instance=2), m)
    assert cpus_of(p2) == [[0, 1], [2, 3], [4, 5]]     # count first: 3 instances, some span L3


def test_both_counts_exact_or_error() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=1)
    p = plan(Options(program="x.py", ninstances=2, ncores_per_instance=2), m)
    assert cpus_of(p) == [[0, 1], [2, 3]]
    with pytest.raises(PlanError) as err:
        plan(Options(program="x.py", ninstances=3, ncores_per_instance=3), m)
    assert err.value.option == "--ninstances" and "9" in err.value.problem


def test_large_instance_spans_nodes_unless_bind_numa_node() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=1)
    p = plan(Options(program="x.py", ncores_per_instance=6), m)
    assert cpus_of(p) == [[0, 1, 2, 3, 4, 5]] and p.instances[0].mem_nodes == (0, 1)
    with pytest.raises(PlanError) as err:
        plan(Options(program="x.py", ncores_per_instance=6, bind_numa_node=True), m)
    assert err.value.option == "--bind-numa-node"


def test_bind_numa_node_shrinks_instances_to_fit_nodes() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=3, smt=1)
    p = plan(Options(program="x.py", ninstances=4, bind_numa_node=True), m)
    assert all(len({c // 3 for c in inst.cpus}) == 1 for inst in p.instances)
    assert len(p.instances) == 4


def _ranges(p) -> list[str]:
    from xlaunch.cpulist import format_cpulist

    return [format_cpulist(i.cpus) for i in p.instances]


def test_bind_numa_node_shares_nodes_out_without_idle_cores() -> None:
    """IPEX's launcher tests with --bind-numa-node (2 x 28 cores, SMT; 4 x 14): instances per node in
    proportion to its cores, every core of a node with an instance used (xlaunch used 42 of 56)."""
    two = synthetic_machine(nodes=2, cores_per_l3=28, smt=2)
    p = plan(Options(program="x.py", ninstances=3, bind_numa_node=True), two)
    assert _ranges(p) == ["0-27", "28-41", "42-55"] and p.idle_cpus == tuple(range(56, 112))
    assert [i.mem_nodes for i in p.instances] == [(0,), (1,), (1,)]
    assert not any("stay idle" in w for w in p.warnings)
    logical = plan(Options(program="x.py", ninstances=7, bind_numa_node=True, use_logical_cores=True), two)
    assert _ranges(logical) == ["0-9,56-65", "10-18,66-74", "19-27,75-83", "28-34,84-90", "35-41,91-97",
                                "42-48,98-104", "49-55,105-111"]
    assert not logical.idle_cpus
    # unlike ipexrun (18/18/18 and 2 idle), node 0's leftover CPUs go to its first instance: the plan says so
    assert "--bind-numa-node: node 0's 56 CPUs go to its 3 instances as 20/18/18 (ipexrun gives each 18 and leaves " \
           "2 idle): xlaunch leaves no CPU idle" in logical.warnings
    assert not any("ipexrun gives" in w for w in p.warnings)       # 28 and 14/14: nothing differs
    four = synthetic_machine(nodes=4, cores_per_l3=14, smt=2)
    some = plan(Options(program="x.py", ninstances=3, bind_numa_node=True, use_logical_cores=True,
                        nodes_list=(1, 2)), four)
    assert _ranges(some) == ["14-27,70-83", "28-34,84-90", "35-41,91-97"]
    # an explicit size keeps equal instances (and says what idles)
    sized = plan(Options(program="x.py", ncores_per_instance=12, bind_numa_node=True), two)
    assert [len(i.cpus) for i in sized.instances] == [12, 12, 12, 12]


def test_throughput_mode_one_instance_per_node_with_cpus() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=2, memory_only_nodes=1)
    p = plan(Options(program="x.py", throughput_mode=True), m)
    assert cpus_of(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [i.mem_nodes for i in p.instances] == [(0,), (1,)]


def test_latency_mode_four_cores_each() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=6, smt=1)
    p = plan(Options(program="x.py", latency_mode=True), m)
    assert [len(i.cpus) for i in p.instances] == [4, 4, 4]
    bound = plan(Options(program="x.py", latency_mode=True, bind_numa_node=True), m)
    assert cpus_of(bound) == [[0, 1, 2, 3], [6, 7, 8, 9]]
    small = plan(Options(program="x.py", latency_mode=True), synthetic_machine(nodes=1, cores_per_l3=2))
    assert cpus_of(small) == [[0, 1]]


def test_nodes_list_and_its_errors() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=1, memory_only_nodes=1)
    assert cpus_of(plan(Options(program="x.py", nodes_list=(1,)), m)) == [[4, 5, 6, 7]]
    with pytest.raises(PlanError, match="no NUMA node 7"):
        plan(Options(program="x.py", nodes_list=(7,)), m)
    with pytest.raises(PlanError, match="memory only"):
        plan(Options(program="x.py", nodes_list=(2,)), m)


def test_cores_list_maps_cpus_to_physical_cores() -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=4, smt=2)   # siblings k, k+4
    p = plan(Options(program="x.py", cores_list=(0, 1, 4)), m)
    assert cpus_of(p) == [[0, 1]]
    assert any("SMT sibling" in w for w in p.warnings)
    logical = plan(Options(program="x.py", cores_list=(0, 1, 4), use_logical_cores=True), m)
    assert cpus_of(logical) == [[0, 1, 4]]


@pytest.mark.parametrize(
    "cores, message",
    [((99,), "CPU 99 does not exist"), ((3,), "CPU 3 is offline"), ((5,), "CPU 5 is not allowed")],
)
def test_cores_list_rejects_unknown_offline_and_disallowed_cpus(cores, message) -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=8, smt=1, offline=(3,), allowed=(0, 1, 2, 3, 4))
    with pytest.raises(PlanError, match=message) as err:
        plan(Options(program="x.py", cores_list=cores), m)
    assert err.value.option == "--cores-list"


def test_cores_list_may_name_isolated_cpus_outside_the_affinity() -> None:
    """isolcpus= CPUs are in no process's default affinity, yet sched_setaffinity may name them (as
    taskset -c does): --cores-list naming them plans on them, with a note on what isolation means.
    Other CPUs outside the affinity (a taskset restriction) stay refused."""
    from xlaunch._records import replace

    m = replace(synthetic_machine(nodes=1, cores_per_l3=8, smt=1, allowed=(0, 1, 2, 3)), isolated_cpus=(6, 7))
    p = plan(Options(program="x.py", cores_list=(6, 7), ninstances=2), m)
    assert cpus_of(p) == [[6], [7]]
    assert any(w.startswith("--cores-list: CPUs 6-7 are isolated (isolcpus=): used because they are listed")
               for w in p.warnings), p.warnings
    assert not any("isolated" in w for w in plan(Options(program="x.py"), m).warnings)
    assert cpus_of(plan(Options(program="x.py"), m)) == [[0, 1, 2, 3]]     # never chosen unasked
    with pytest.raises(PlanError, match="CPU 5 is not allowed") as err:
        plan(Options(program="x.py", cores_list=(5, 6)), m)
    assert err.value.option == "--cores-list"


def test_logical_cores_keep_siblings_together() -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=4, smt=2, numbering="adjacent")
    p = plan(Options(program="x.py", use_logical_cores=True, ncores_per_instance=4), m)
    assert cpus_of(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    n = plan(Options(program="x.py", use_logical_cores=True, ninstances=2), m)
    assert cpus_of(n) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(PlanError, match="split a core's SMT siblings"):
        plan(Options(program="x.py", use_logical_cores=True, ncores_per_instance=3), m)


def test_hybrid_core_types() -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=2, smt=2, efficiency_cores=4)   # P: 0/2, 1/3; E: 4-7
    assert cpus_of(plan(Options(program="x.py"), m)) == [[0, 1]]
    assert cpus_of(plan(Options(program="x.py", core_type="efficiency"), m)) == [[4, 5, 6, 7]]
    assert cpus_of(plan(Options(program="x.py", core_type="all"), m)) == [[0, 1, 4, 5, 6, 7]]
    # an explicit --cores-list names the cores to use, whatever their type
    assert cpus_of(plan(Options(program="x.py", cores_list=(1, 4)), m)) == [[1, 4]]
    with pytest.raises(PlanError, match="no efficiency cores"):
        plan(Options(program="x.py", core_type="efficiency"), synthetic_machine())


def test_instance_idx_selects_and_checks_range() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=2, smt=1)
    p = plan(Options(program="x.py", ninstances=4, instance_idx=(1, 3)), m)
    assert [i.index for i in p.instances] == [1, 3]
    assert cpus_of(p) == [[1], [3]]
    assert all(i.env["XLAUNCH_NINSTANCES"] == "4" for i in p.instances)
    assert p.idle_cpus == (0, 2)
    with pytest.raises(PlanError, match="index 4 out of range") as err:
        plan(Options(program="x.py", ninstances=4, instance_idx=(4,)), m)
    assert err.value.option == "--instance-idx"


def test_only_allowed_cpus_are_used() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=4, smt=2, allowed=(2, 3, 10))
    p = plan(Options(program="x.py", use_logical_cores=True), m)
    assert cpus_of(p) == [[2, 3, 10]]
    assert p.instances[0].mem_nodes == (0,)


def test_mem_nodes_are_cpu_nodes_within_allowed_mems() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=2, smt=1, allowed_mems=(1,))
    p = plan(Options(program="x.py", ninstances=2), m)
    assert [i.mem_nodes for i in p.instances] == [(), (1,)]
    assert [i.membind for i in p.instances] == ["none", "bind"]


def test_numactl_and_taskset_prefix_the_command() -> None:
    m = synthetic_machine(nodes=2, cores_per_l3=2, smt=1)
    which = {"numactl": "/usr/bin/numactl", "taskset": "/usr/bin/taskset"}.get
    p = plan(Options(program="x.py", args=("a b",), ninstances=2, bind_with="numactl", python="/py"), m, which=which)
    assert p.instances[1].argv == ("/usr/bin/numactl", "--physcpubind=2-3", "--membind=1", "--", "/py", "-u", "x.py", "a b")
    assert p.instances[1].bind == "numactl"
    t = plan(Options(program="x.py", bind_with="taskset", membind="none", python="/py"), m, which=which)
    assert t.instances[0].argv == ("/usr/bin/taskset", "-c", "0-3", "/py", "-u", "x.py")
    with pytest.raises(PlanError, match="numactl not found") as err:
        plan(Options(program="x.py", bind_with="numactl"), m, which=lambda name: None)
    assert err.value.option == "--bind-with"


def test_command_forms() -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=1, smt=1)
    assert plan(Options(program="m", module=True, args=("-x",), python="/py"), m).instances[0].argv == (
        "/py", "-u", "-m", "m", "-x")
    assert plan(Options(program="/bin/true", no_python=True, args=("$HOME",)), m).instances[0].argv == (
        "/bin/true", "$HOME")
    assert plan(Options(dry_run=True), m).instances[0].argv == ()


def test_cpu_budget_warning() -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=4, smt=1, cpu_budget=2.0)
    p = plan(Options(program="x.py"), m)
    assert any("CPU budget is 2 CPUs" in w for w in p.warnings)


def test_json_schema() -> None:
    m = synthetic_machine(nodes=1, cores_per_l3=2, smt=1)
    data = plan(Options(program="x.py", ninstances=2), m, {"HOME": "/h"}).to_json()
    inst = data["instances"][0]
    assert set(inst) >= {"index", "cpus", "mem_nodes", "env", "argv"}
    assert inst["cpus"] == [0] and inst["env"]["HOME"] == "/h"
    assert {"warnings", "idle_cpus", "env_set", "env_kept", "machine"} <= set(data)
