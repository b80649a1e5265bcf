"""Property tests for the planner on random machines and options (hypothesis)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic_machines import synthetic_machine

from xlaunch.launcher.errors import PlanError
from xlaunch.launcher.plan.options import Options
from xlaunch.launcher.plan.planner import plan


@st.composite
def machines(draw):
    nodes = draw(st.integers(1, 4))
    l3 = draw(st.integers(1, 3))
    per_l3 = draw(st.integers(1, 6))
    smt = draw(st.integers(1, 2))
    ncpus = nodes * l3 * per_l3 * smt
    efficiency = draw(st.sampled_from([0, 0, 0, 4]))
    total = ncpus + efficiency
    offline = draw(st.sets(st.integers(1, total - 1), max_size=total // 4)) if total > 1 else set()
    allowed = draw(st.one_of(st.none(), st.sets(st.integers(0, total - 1), min_size=1)))
    if allowed is not None and not (set(allowed) - offline):
        allowed = None
    return synthetic_machine(
        nodes=nodes, l3_per_node=l3, cores_per_l3=per_l3, smt=smt,
        numbering=draw(st.sampled_from(["plus_n", "adjacent"])),
        offline=offline, allowed=allowed, efficiency_cores=efficiency,
    )


@st.composite
def options(draw):
    mode = draw(st.sampled_from(["counts", "counts", "throughput", "latency"]))
    values: dict = {}
    if mode == "counts":
        values["ninstances"] = draw(st.one_of(st.none(), st.integers(1, 12)))
        values["ncores_per_instance"] = draw(st.one_of(st.none(), st.integers(1, 12)))
    else:
        values[f"{mode}_mode"] = True
    values["use_logical_cores"] = draw(st.booleans())
    values["bind_numa_node"] = draw(st.booleans())
    values["core_type"] = draw(st.sampled_from([None, "all"]))
    return Options(program="p.py", python="/py", **values)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=machines(), o=options())
def test_plan_properties(m, o) -> None:
    try:
        p = plan(o, m)
    except PlanError as err:
        assert err.option.startswith("--")
        # a single physical core per instance always fits when asked for at most the cores there are
        usable = {core.index for core in m.cores if set(core.cpus) & set(m.allowed_cpus)}
        assert not (o.ninstances and not o.ncores_per_instance and not o.use_logical_cores
                    and not o.bind_numa_node and not m.is_hybrid and o.ninstances <= len(usable))
        return
    allowed = set(m.allowed_cpus) & set(m.online_cpus)
    used = [c for inst in p.instances for c in inst.cpus]
    assert len(used) == len(set(used)), "no CPU in two instances"
    assert set(used) <= allowed, "only allowed CPUs"
    assert set(p.idle_cpus) == allowed - set(used)
    assert [i.index for i in p.instances] == list(range(len(p.instances)))
    for inst in p.instances:
        assert inst.cpus and list(inst.cpus) == sorted(inst.cpus)
        nodes = {m.cpu(c).node for c in inst.cpus}
        if o.bind_numa_node or o.throughput_mode:
            assert len(nodes) == 1, "no instance spans nodes"
        cores = [m.core_of(c) for c in inst.cpus]
        if o.use_logical_cores:
            for core in cores:
                assert set(core.cpus) & allowed <= set(inst.cpus), "siblings stay together"
        else:
            assert len({c.index for c in cores}) == len(inst.cpus), "one CPU per physical core"
    sizes = [len(i.cpus) for i in p.instances]
    if o.ncores_per_instance is not None:
        assert set(sizes) == {o.ncores_per_instance}, "sizes as asked"
    if o.ninstances is not None:
        assert len(p.instances) == o.ninstances, "count as asked"
        if o.ncores_per_instance is None and not o.use_logical_cores and not o.bind_numa_node:
            assert len(set(sizes)) == 1, "even split"
        if o.ncores_per_instance is None and o.bind_numa_node:
            # ipexrun's split: no core of a node that has an instance idles, a node's instances
            # differ by at most one core
            for node in {m.cpu(i.cpus[0]).node for i in p.instances}:
                mine = [i for i in p.instances if m.cpu(i.cpus[0]).node == node]
                cores = [len({m.core_of(c).index for c in i.cpus}) for i in mine]
                assert max(cores) - min(cores) <= 1, "a node's instances differ by one core at most"
                assert not {c for c in p.idle_cpus if m.cpu(c).node == node
                            and (o.use_logical_cores or c == m.core_of(c).cpus[0])
                            and (m.core_of(c).kind == "performance" or not m.is_hybrid or o.core_type == "all")
                            }, "no core of the node idles"
    if o.latency_mode:   # 4 physical cores each (fewer only when fewer exist)
        assert max(len({m.core_of(c).index for c in i.cpus}) for i in p.instances) <= 4
    if o.ncores_per_instance is not None and o.ninstances is None and not o.use_logical_cores \
            and not o.bind_numa_node:
        assert len(p.instances) == len({m.core_of(c).index for c in allowed
                                         if not m.is_hybrid or o.core_type == "all"
                                         or m.core_of(c).kind == "performance"}) // o.ncores_per_instance, \
            "as many as fit"
