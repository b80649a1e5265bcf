"""The synthetic machines of tests/synthetic_machines.py are what they claim."""
from __future__ import annotations

from synthetic_machines import synthetic_machine


def test_synthetic_machine_is_consistent() -> None:
    m = synthetic_machine(nodes=2, l3_per_node=2, cores_per_l3=3, smt=2)
    assert len(m.cpus) == 24 and len(m.cores) == 12
    assert m.core_of(12).cpus == (0, 12)
    assert [c.node for c in m.cores] == [0] * 6 + [1] * 6
    adjacent = synthetic_machine(nodes=1, cores_per_l3=2, numbering="adjacent")
    assert [c.cpus for c in adjacent.cores] == [(0, 1), (2, 3)]
    hybrid = synthetic_machine(nodes=1, cores_per_l3=2, efficiency_cores=4)
    assert hybrid.is_hybrid and len(hybrid.cores) == 6
