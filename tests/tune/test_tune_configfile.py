"""The config files the tuner writes (each trial's, best.toml) read back through the launcher's
own config reader into exactly the options that were measured."""
from __future__ import annotations

from pathlib import Path

import pytest

from xlaunch.configs import load_config
from xlaunch.launcher.plan.options import SETTABLE, build_options
from xlaunch.tune import tomlfile
from xlaunch.tune.candidate import MANAGED, config_table


@pytest.mark.parametrize("cli, point", [
    ({}, {}),
    ({"ninstances": "2"}, {"memory-allocator": "jemalloc", "omp-runtime": "default"}),
    ({"no_python": True, "grace_period": "1.5"}, {"cores-list": "0-1", "use-logical-cores": True}),
    ({"auto_optimize": True, "dtype": "bf16"}, {"membind": "interleave", "bind-numa-node": True}),
    ({"latency_mode": True}, {"benchmark": False, "bind-with": "numactl"}),
    ({"keep_going": True, "nodes_list": "0"}, {"ncores-per-instance": 1}),
    ({"membind": "0"}, {"ninstances": 1}),               # numactl's spelling: every instance's memory on node 0
    ({}, {"membind": "0-1"}),
])
def test_written_config_reads_back_to_the_same_options(tmp_path: Path, cli: dict, point: dict) -> None:
    merged = {**cli, **{k.replace("-", "_"): v for k, v in point.items()}}
    options = build_options(merged, {})
    table = config_table(options, point)
    assert not {k.replace("-", "_") for k in table} & MANAGED
    assert set(point) <= set(table)                       # every dimension is written, even at its default
    path = tmp_path / "best.toml"
    tomlfile.write(str(path), table, "a header line\nand another")
    read, source = load_config(str(path))
    again = build_options({}, read, config_source=source)
    for name in (SETTABLE - MANAGED) | {"membind_nodes"}:
        assert getattr(again, name) == getattr(options, name), name
    assert path.read_text().startswith("# a header line\n# and another\n")


def test_toml_values() -> None:
    assert tomlfile.toml_value(True) == "true"
    assert tomlfile.toml_value(3) == "3"
    assert tomlfile.toml_value(1.5) == "1.5"
    assert tomlfile.toml_value('a "quoted" \\ path') == '"a \\"quoted\\" \\\\ path"'
    assert tomlfile.toml_value((0, 2, 3)) == "[0, 2, 3]"
    with pytest.raises(ValueError):
        tomlfile.toml_value(float("nan"))
    with pytest.raises(TypeError):
        tomlfile.toml_value({"a": 1})


def test_a_membind_node_list_is_a_dimension_of_its_own() -> None:
    from xlaunch.tune.space import parse_space

    space = parse_space("[space]\nmembind = ['bind', '1', [0, 1]]\n", "space.toml", fixed={})
    assert space.to_json() == {"membind": ["bind", "1", "0-1"]}    # the nodes kept, not taken for "bind"


def test_a_fixed_membind_node_list_places_every_trial(tmp_path: Path) -> None:
    """``xlaunch-tune --membind 1`` on two nodes: each trial's plan (and so best.toml's) binds every
    instance's memory to node 1, as ``xlaunch --membind 1`` does (the list was dropped: own nodes)."""
    import json

    from machine_trees import machine_tree

    from xlaunch.tune.candidate import Candidate, Program, dry_run, prepare

    environ = {"XLAUNCH_FSROOT": str(machine_tree("xeon-2s-amx")), "PATH": "/usr/bin:/bin"}
    script = tmp_path / "prog.py"
    script.write_text("print('hi')\n")
    program = Program((str(script),), {"membind": "1"}, {}, None, environ)
    candidate = prepare(program, {"ninstances": 2}, str(tmp_path / "trial.toml"))
    assert isinstance(candidate, Candidate), candidate
    code, out, err = dry_run(str(tmp_path / "trial.toml"), [str(script)], environ)
    assert code == 0, err
    assert [i["mem_nodes"] for i in json.loads(out)["instances"]] == [[1], [1]]


def test_best_toml_reads_back_whatever_the_program_arguments_hold(tmp_path: Path) -> None:
    """An argument holding ESC (or another control character TOML refuses in a comment) made best.toml
    unreadable: ``xlaunch --config best.toml`` said it was not valid TOML; a newline split the command."""
    from xlaunch.tune.records import save_best
    from xlaunch.tune.session import TrialRecord

    record = TrialRecord(1, {"ninstances": 1}, {"ninstances": 1}, (0,),
                         [{"status": "ok", "reason": "", "value": 2.0, "instance_values": [2.0], "wall_time": 0.1}])
    path = save_best(str(tmp_path), record, ["prog.py", "\x1b[31mred", "two\nlines\r"], "wall time (s)")
    assert load_config(path)[0] == {"ninstances": 1}
    run_line = next(line for line in Path(path).read_text().splitlines() if "Run it with" in line)
    assert run_line.endswith("prog.py '\\x1b[31mred' 'two\\x0alines\\x0d'"), run_line
