"""Option parsing: spellings and aliases, config merge, validation (through the click layer)."""
from __future__ import annotations

import pytest

from xlaunch.configs import ConfigError, load_config, parse_toml, preset_names
from xlaunch.configs import _parse_flat_toml as parse_flat
from xlaunch.launcher.cli import command as cli
from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.plan.options import Options, build_options, canonical_name


def parse(*argv: str, environ=None) -> Options:
    """Options exactly as the CLI builds them (click parsing, config merge, program check)."""
    return cli.options_from(cli.parse_command_line(argv), environ or {"PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize(
    "spelling",
    ["--ncores-per-instance", "--ncores_per_instance", "--ncore_per_instance", "--ncore-per-instance"],
)
def test_cores_per_instance_spellings(spelling: str) -> None:
    assert parse(spelling, "3", "--dry-run").ncores_per_instance == 3


@pytest.mark.parametrize(
    "argv, field, value",
    [
        (["--core-list", "0-7,16"], "cores_list", (0, 1, 2, 3, 4, 5, 6, 7, 16)),
        (["--cores_list", "1"], "cores_list", (1,)),
        (["--node-id", "0,2-3"], "nodes_list", (0, 2, 3)),
        (["--node_id", "1"], "nodes_list", (1,)),
        (["--skip-cross-node-cores"], "bind_numa_node", True),
        (["--skip_cross_node_cores"], "bind_numa_node", True),
        (["--bind_numa_node"], "bind_numa_node", True),
        (["--use_logical_cores"], "use_logical_cores", True),
        (["--memory_allocator", "JEMALLOC"], "memory_allocator", "jemalloc"),
        (["--omp-runtime", "intel"], "omp_runtime", "intel"),
        (["--bind-with", "taskset"], "bind_with", "taskset"),
        (["--instance_idx", "0,2-3"], "instance_idx", (0, 2, 3)),
        (["--grace-period", "0.5"], "grace_period", 0.5),
        (["--log_file_prefix", "run"], "log_file_prefix", "run"),
        (["-vv"], "verbosity", 2),
        (["-v", "-q", "-q"], "verbosity", -1),
    ],
)
def test_values_and_aliases(argv, field, value) -> None:
    assert getattr(parse(*argv, "--dry-run"), field) == value


def test_program_and_args_pass_through_untouched(tmp_path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    o = parse("--ninstances", "2", str(script), "--ninstances", "9", "a b", "$HOME", "--", "-m")
    assert o.ninstances == 2
    assert o.program == str(script) and o.args == ("--ninstances", "9", "a b", "$HOME", "--", "-m")
    assert parse("--", str(script), "-x").args == ("-x",)


def test_no_python_resolves_on_path_and_module_is_checked() -> None:
    o = parse("--no-python", "true", environ={"PATH": "/usr/bin:/bin"})
    assert o.program.endswith("/true") and o.program.startswith("/")
    assert parse("-m", "json.tool").program == "json.tool"
    with pytest.raises(OptionError, match="no module named"):
        parse("-m", "surely_no_such_module_xyz")
    with pytest.raises(OptionError, match="not found on PATH"):
        parse("--no-python", "surely-no-such-program-xyz")


def test_canonical_names() -> None:
    assert canonical_name("--ncore_per_instance") == "ncores_per_instance"
    assert canonical_name("node-id") == "nodes_list"
    assert canonical_name("nope") is None


def test_config_is_merged_under_the_command_line(tmp_path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('ncore_per_instance = 2\nmemory-allocator = "tcmalloc"\ncores-list = "0-3"\nbenchmark = true\n')
    o = parse("--config", str(conf), "--memory-allocator", "default", "--dry-run")
    assert (o.ncores_per_instance, o.memory_allocator, o.cores_list, o.benchmark) == (2, "default", (0, 1, 2, 3), True)
    assert o.config == str(conf)


def test_command_line_shape_replaces_the_presets_mode() -> None:
    o = parse("--config", "throughput", "--ninstances", "3", "--dry-run")
    assert o.ninstances == 3 and not o.throughput_mode and o.bind_numa_node
    assert parse("--config", "throughput", "--dry-run").throughput_mode


def test_presets_exist_and_are_valid() -> None:
    names = preset_names()
    assert {"throughput", "latency", "single"} <= set(names)
    for name in names:
        table, source = load_config(name)
        assert source == f"preset:{name}"
        build_options({}, table, config_source=source)      # valid option names and values


@pytest.mark.parametrize(
    "content, message",
    [
        ("ninstances = ", "not valid TOML"),
        ("bogus = 1\n", "unknown option 'bogus'"),
        ("ninstances = 0\n", "--ninstances: must be a positive integer"),
        ("use-logical-cores = \"yes\"\n", "--use-logical-cores: expected true or false"),
        ("cores-list = [1, -2]\n", "--cores-list: expected non-negative integers"),
        # the last spelling won without a word (TOML sees two keys)
        ("ncores-per-instance = 1\nncores_per_instance = 2\n",
         "--config: 'ncores-per-instance' and 'ncores_per_instance' name the same option in"),
        ("'--memory-allocator' = 'jemalloc'\nmemory_allocator = 'default'\n", "name the same option"),
        # no command line holds a NUL: a log directory with one was ValueError's traceback when it ran
        ('log-dir = "a\\u0000b"\n', "'log-dir' holds a NUL character"),
        ('log-file-prefix = ["a", "b\\u0000"]\n', "'log-file-prefix' holds a NUL character"),
    ],
)
def test_bad_config_files(tmp_path, content: str, message: str) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text(content)
    with pytest.raises(OptionError) as err:
        parse("--config", str(conf), "--dry-run")
    assert message in str(err.value)


def test_a_config_with_a_nul_is_one_line_and_nothing_runs(tmp_path) -> None:
    import subprocess
    import sys

    (tmp_path / "c.toml").write_text('log-file-prefix = "a\\u0000b"\nlog-dir = "logs"\n')
    (tmp_path / "prog.py").write_text("open('started', 'w')\n")
    done = subprocess.run([sys.executable, "-m", "xlaunch", "--config", "c.toml", "prog.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert (done.returncode, done.stderr) == (2, "xlaunch: error: --config: c.toml: 'log-file-prefix' holds a NUL "
                                                 "character\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "prog.py"]


def test_a_presets_name_is_the_preset_unless_a_file_here_has_it(tmp_path, monkeypatch) -> None:
    """A folder named throughput (a results folder) made --config throughput 'a directory, not a
    regular file'; a file named latency here was read instead of the preset, without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "throughput").mkdir()
    table, source = load_config("throughput")
    assert source == "preset:throughput" and table["throughput-mode"] is True
    (tmp_path / "latency").write_text("ninstances = 1\n")
    with pytest.raises(ConfigError, match=r"'latency' names a preset and the file latency here: write ./latency"):
        load_config("latency")
    assert load_config("./latency") == ({"ninstances": 1}, "./latency")
    (tmp_path / "mine").write_text("ninstances = 2\n")          # a name no preset has: the file
    assert load_config("mine") == ({"ninstances": 2}, "mine")


def test_missing_config_and_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/x.toml")
    with pytest.raises(ConfigError, match="no preset named 'turbo'"):
        load_config("turbo")


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--ninstances", "0"], "--ninstances"),
        (["--ninstances", "-2"], "--ninstances"),
        (["--ncores-per-instance", "x"], "--ncores-per-instance"),
        (["--cores-list", "3-1"], "--cores-list"),
        (["--nodes-list", "a"], "--nodes-list"),
        (["--throughput-mode", "--latency-mode"], "--latency-mode"),
        (["--throughput-mode", "--ninstances", "2"], "--ninstances"),
        (["--latency-mode", "--ncores-per-instance", "2"], "--ncores-per-instance"),
        (["-m", "--no-python"], "--no-python"),
        (["--memory-allocator", "mimalloc"], "--memory-allocator"),
        (["--grace-period", "-1"], "--grace-period"),
        (["--dtype", "bfloat16"], "--dtype"),
        (["--json"], "--json"),
        (["--log-file-prefix", "a/b"], "--log-file-prefix"),
    ],
)
def test_invalid_values_name_the_option(argv, option: str) -> None:
    extra = [] if "--json" in argv else ["--dry-run"]
    with pytest.raises(OptionError) as err:
        parse(*argv, *extra)
    assert err.value.option == option


def test_flat_toml_fallback_reader() -> None:
    text = '# c\nninstances = 2\nmemory-allocator = "jemalloc" # x\nbenchmark = true\ncores = [1, 2]\ng = 0.5\n'
    assert parse_flat(text) == parse_toml(text) == {
        "ninstances": 2, "memory-allocator": "jemalloc", "benchmark": True, "cores": [1, 2], "g": 0.5}
    with pytest.raises(ValueError):
        parse_flat("novalue\n")
