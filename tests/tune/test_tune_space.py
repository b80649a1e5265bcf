"""The [space] parser and the default space: every mistake is one clear error; values are
checked by the launcher's own option validation."""
from __future__ import annotations


import pytest
from machine_trees import machine_tree

from xlaunch.machine import load_machine
from xlaunch.tune.space import SpaceError, default_space, parse_space, point_key



def parse(text: str, fixed=None, base=None):
    return parse_space(text, "space.toml", fixed=fixed or {}, base_config=base)


def test_keys_are_launcher_option_names_in_any_spelling() -> None:
    space = parse('[space]\nninstances = [1, 2]\nncore_per_instance = [1]\n"memory-allocator" = ["JEMALLOC", "default"]\n'
                  'use_logical_cores = [false, true]\ncores-list = ["0-1", [0]]\n')
    assert space.keys == ("ninstances", "ncores-per-instance", "memory-allocator", "use-logical-cores", "cores-list")
    # values come back as the launcher normalised them
    assert space.to_json()["memory-allocator"] == ["jemalloc", "default"]
    assert space.to_json()["cores-list"] == ["0-1", "0"]
    assert space.size == 2 * 1 * 2 * 2 * 2
    points = list(space.points())
    assert len(points) == space.size and len({point_key(p) for p in points}) == space.size
    assert [space.point_at(i) for i in range(space.size)] == points
    assert points[0] == {"ninstances": 1, "ncores-per-instance": 1, "memory-allocator": "jemalloc",
                         "use-logical-cores": False, "cores-list": "0-1"}


@pytest.mark.parametrize("text, message", [
    ("[space]\nninstance = [1, 2]\n", "unknown launcher option 'ninstance' (did you mean 'ninstances'?)"),
    ("[space]\nfrobnicate = [1]\n", "unknown launcher option 'frobnicate'"),
    ("[space]\nlog-dir = ['a']\n", "log-dir cannot be tuned: xlaunch-tune sets it"),
    ("[space]\nsummary_json = ['a', 'b']\n", "summary_json cannot be tuned: xlaunch-tune sets it for every run"),
    ("[space]\nno-python = [true]\n", "no-python cannot be tuned: it describes the program"),
    ("[space]\nninstances = []\n", "ninstances is an empty list"),
    ("[space]\nninstances = 2\n", "ninstances must be a list of values, got 2"),
    ("[space]\nninstances = [1, 0]\n", "ninstances = 0: must be a positive integer, got 0"),
    ("[space]\nninstances = [1, 'two']\n", "ninstances = \"two\": expected an integer, got 'two'"),
    ("[space]\nninstances = [true]\n", "ninstances = true: expected an integer, got True"),
    ("[space]\nmemory-allocator = ['jemalloc', 'mimalloc']\n", "memory-allocator = \"mimalloc\": 'mimalloc' is not one of"),
    ("[space]\nuse-logical-cores = ['yes']\n", "use-logical-cores = \"yes\": expected true or false"),
    ("[space]\nomp-runtime = ['intel', 'INTEL']\n", "omp-runtime = \"INTEL\": duplicate value"),
    ("[space]\nninstances = [1]\nncore-per-instance = [1]\nncores_per_instance = [2]\n", "name the same option"),
    ("[space]\n", "the [space] table is empty"),
    ("ninstances = [1]\n", "unknown top-level key 'ninstances'"),
    ("[tune]\nx = 1\n", "unknown top-level key 'tune'"),
    ("", "no [space] table"),
    ("[space\n", "is not valid TOML"),
])
def test_bad_spaces_are_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(SpaceError) as caught:
        parse(text)
    assert str(caught.value).startswith("space.toml")
    assert message in str(caught.value)


def test_values_are_checked_with_the_fixed_options() -> None:
    with pytest.raises(SpaceError, match=r"ninstances = 2: conflicts with --latency-mode"):
        parse("[space]\nninstances = [2]\n", fixed={"latency_mode": True})
    with pytest.raises(SpaceError, match="ninstances is fixed on the command line and also in the space"):
        parse("[space]\nninstances = [2]\n", fixed={"ninstances": "2"})
    # --dtype needs --auto-optimize: fixed on the command line it makes the values valid
    with pytest.raises(SpaceError, match="only applies with --auto-optimize"):
        parse("[space]\ndtype = ['bf16']\n")
    assert parse("[space]\ndtype = ['bf16', 'fp32']\n", fixed={"auto_optimize": True}).to_json() == {
        "dtype": ["bfloat16", "float32"]}


@pytest.mark.parametrize("tree", ["xeon-2s-amx", "vm-adjacent-smt", "hybrid-laptop", "vm-no-node"])
def test_default_space_follows_the_machine(tree: str) -> None:
    machine = load_machine(str(machine_tree(tree)))
    space = default_space(machine, fixed={})
    dims = space.to_json()
    allowed = set(machine.allowed_cpus) & set(machine.online_cpus)
    cores = [c for c in machine.cores if set(c.cpus) & allowed]
    if machine.is_hybrid:
        cores = [c for c in cores if c.kind == "performance"]
    counts = dims.get("ninstances", [1])
    assert counts[0] == 1 and all(len(cores) % n == 0 for n in counts) and counts[-1] == len(cores)
    smt = any(len(set(c.cpus) & allowed) > 1 for c in cores)
    assert ("use-logical-cores" in dims) == smt
    assert dims.get("memory-allocator", ["default"])[0] == "default"
    assert ("jemalloc" in dims.get("memory-allocator", [])) == (machine.library("jemalloc") is not None)
    assert ("intel" in dims.get("omp-runtime", [])) == (machine.library("iomp") is not None)
    # what is fixed on the command line is not varied
    fixed = default_space(machine, fixed={"ninstances": "1", "use_logical_cores": True})
    assert "ninstances" not in fixed.to_json() and "use-logical-cores" not in fixed.to_json()


def test_duplicates_are_found_without_comparing_every_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each value was compared with every earlier one (a list's `in`): a space file of 140,000 values
    (860 KB, under the 1 MiB cap) took 24 s of CPU before anything ran."""
    from types import SimpleNamespace

    from xlaunch.tune import space as space_module

    compared = []

    class Value(int):
        def __eq__(self, other: object) -> bool:
            compared.append(other)
            return int(self) == other

        __hash__ = int.__hash__

    monkeypatch.setattr(space_module, "build_options",
                        lambda cli, base: SimpleNamespace(ninstances=Value(cli["ninstances"])))
    count = 2000
    space = parse("[space]\nninstances = [" + ", ".join(str(n) for n in range(1, count + 1)) + "]\n")
    assert space.size == count and len(compared) < count
    with pytest.raises(SpaceError, match="ninstances = 7: duplicate value"):
        parse("[space]\nninstances = [" + ", ".join(str(n) for n in range(1, count + 1)) + ", 7]\n")


def test_the_start_line_cuts_a_long_dimension() -> None:
    """The start line printed every value: a space file of 1 MiB made a line of 1 MB on stderr."""
    space = parse("[space]\nninstances = [" + ", ".join(str(n) for n in range(1, 1001)) + "]\nomp-runtime = ['intel']\n")
    assert space.shown() == "ninstances [1, 2, 3, 4, 5, 6, 7, 8, ... (1000 values)], omp-runtime ['intel']"
    assert parse("[space]\nninstances = [1, 2]\n").shown() == "ninstances [1, 2]"


def test_share_imports_is_a_dimension_of_module_lists(tmp_path) -> None:
    """A share-imports dimension was a TypeError traceback (its module names formatted as a CPU list)."""
    from xlaunch.tune.candidate import Candidate, Program, prepare

    space = parse('[space]\nshare-imports = ["json", " json , csv ", ["csv", "json"]]\n', fixed={"ninstances": 1})
    assert space.to_json() == {"share-imports": ["json", "json,csv", "csv,json"]}
    with pytest.raises(SpaceError, match=r'share-imports = \["json"\]: duplicate value'):
        parse('[space]\nshare-imports = ["json", ["json"]]\n', fixed={"ninstances": 1})
    script = tmp_path / "prog.py"
    script.write_text("print('hi')\n")
    candidate = prepare(Program((str(script),), {"ninstances": 1}), space.point_at(1), str(tmp_path / "trial.toml"))
    assert isinstance(candidate, Candidate), candidate
    assert candidate.table["share-imports"] == ["json", "csv"]


def test_nodes_list_minus_one_is_a_point_that_runs(tmp_path) -> None:
    """nodes-list = "-1" (run_cpu's "every node") was kept as None: its point was skipped with
    '--nodes-list: expected a list like 0-3,8, got None'."""
    from xlaunch.tune.candidate import Candidate, Program, prepare

    space = parse('[space]\nnodes-list = ["-1", "0"]\n')
    assert space.to_json() == {"nodes-list": ["-1", "0"]}
    script = tmp_path / "prog.py"
    script.write_text("print('hi')\n")
    every = prepare(Program((str(script),)), space.point_at(0), str(tmp_path / "trial.toml"))
    assert isinstance(every, Candidate) and every.table == {}, every        # the launcher's default: every node
