"""The real CLI: the bad-input table (one stderr line, exit 2, nothing started), --help groups,
--dry-run output, and that the launcher path never imports torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import xlaunch_here  # noqa: F401  (a fixture)
from host_cpus import (ALLOWED, allowed_cores, heavy_imports, main_thread_cpus, need_cores, openmp_places, planned,
                       startup_modules)
from machine_trees import machine_tree
from synthetic_machines import synthetic_machine

from xlaunch.launcher.cli import command as cli, spec as cli_spec

REPO = Path(__file__).resolve().parents[3]


def xlaunch(*argv: str, fsroot: str | None = None, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    environ = dict(os.environ)
    environ.pop("XLAUNCH_FSROOT", None)
    if fsroot:
        environ["XLAUNCH_FSROOT"] = fsroot
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "xlaunch", *argv], capture_output=True, text=True, env=environ,
        cwd=cwd or REPO, timeout=120,
    )


BAD_INPUT = [
    # (argv before PROGRAM, tree or None for this machine, option named, words in the problem)
    (["--cores-list", "999"], None, "--cores-list", "does not exist"),
    (["--cores-list", "3"], "offline-cpus", "--cores-list", "offline"),
    (["--cores-list", "0"], "container-cpuset", "--cores-list", "not allowed"),
    (["--cores-list", "0-"], None, "--cores-list", "malformed"),
    (["--nodes-list", "0,,1"], None, "--nodes-list", "malformed"),
    (["--ninstances", "64", "--ncores-per-instance", "64"], None, "--ninstances", "only"),
    (["--ninstances", "0"], None, "--ninstances", "positive"),
    (["--ncores-per-instance", "-1"], None, "--ncores-per-instance", "positive"),
    (["--ninstances", "two"], None, "--ninstances", "integer"),
    (["--nodes-list", "9"], None, "--nodes-list", "no NUMA node 9"),
    (["--nodes-list", "2"], "memory-only-node", "--nodes-list", "no CPUs"),
    (["--throughput-mode", "--latency-mode"], None, "--latency-mode", "conflicts"),
    (["--latency-mode", "--ninstances", "2"], None, "--ninstances", "conflicts"),
    (["--config", "/nonexistent/conf.toml"], None, "--config", "cannot read"),
    (["--config", "BADTOML"], None, "--config", "not valid TOML"),
    (["--config", "no-such-preset"], None, "--config", "no preset"),
    (["--ninstances", "2", "--instance-idx", "2"], "vm-no-node", "--instance-idx", "out of range"),
    (["--core-type", "efficiency"], "xeon-2s-amx", "--core-type", "no efficiency cores"),
    (["--bogus-option"], None, "--bogus-option", "no such option"),
    (["--log-dir", "/etc/hostname"], None, "--log-dir", "not a directory"),
    (["--ninstances", "2"], "vm-no-node", "XLAUNCH_FSROOT", "add --dry-run"),
    (["--ninstanse", "2"], None, "--ninstanse", "did you mean --ninstances"),
    (["--memory-allocator", "hoard"], None, "--memory-allocator", "not one of"),
    (["--bind-with", "numactl", "--use-logical-cores", "--ncores-per-instance", "3"], "xeon-2s-amx",
     "--ncores-per-instance", "SMT siblings"),
]


@pytest.mark.parametrize("argv, tree, option, words", BAD_INPUT, ids=[" ".join(b[0]) for b in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_nothing_starts(argv, tree, option, words, marker_script, tmp_path,
                                                         xlaunch_here) -> None:
    """In-process: ``cli.run`` parses, plans and refuses (a plan that went on would start the marker
    program from here). The real process's exit 2 and one stderr line: test_program_errors and
    test_bad_fsroot_is_one_line."""
    script, marker = marker_script
    argv = [str(tmp_path / "bad.toml") if a == "BADTOML" else a for a in argv]
    (tmp_path / "bad.toml").write_text("ninstances = = 2\n")
    result = xlaunch_here(*argv, str(script), fsroot=str(machine_tree(tree)) if tree else None)
    out, err = result.stdout, result.stderr
    lines = err.splitlines()
    assert result.returncode == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"xlaunch: error: {option}: "), lines[0]
    assert words in lines[0]
    assert out == ""
    assert not marker.exists()


@pytest.mark.parametrize(
    "argv, option",
    [
        ([], "PROGRAM"),
        (["--ninstances"], "--ninstances"),
        (["missing_program_file.py"], "PROGRAM"),
        (["--no-python", "no-such-program-xyz"], "PROGRAM"),
        (["-m", "no_such_module_xyz"], "PROGRAM"),
    ],
)
def test_program_errors(argv, option) -> None:
    result = xlaunch(*argv)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"xlaunch: error: {option}: ")


def test_bad_fsroot_is_one_line(marker_script) -> None:
    script, marker = marker_script
    result = xlaunch("--dry-run", str(script), fsroot="/nonexistent/root")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("xlaunch: error: XLAUNCH_FSROOT: ")


def test_missing_library_through_the_cli(monkeypatch, capsys, marker_script) -> None:
    script, marker = marker_script
    bare = synthetic_machine(nodes=1, cores_per_l3=2, smt=1, libraries=())
    monkeypatch.setattr("xlaunch.launcher.plan.target.target_machine", lambda environ: bare)
    for argv, option in ((["--memory-allocator", "jemalloc"], "--memory-allocator"),
                         (["--omp-runtime", "intel"], "--omp-runtime")):
        assert cli.run([*argv, str(script)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"xlaunch: error: {option}: ") and "not found" in err and err.count("\n") == 1
    assert not marker.exists()


def test_help_groups_options_like_the_docs() -> None:
    result = xlaunch("--help")
    assert result.returncode == 0
    out = result.stdout
    positions = [out.index(f"{group}:") for group in cli_spec.GROUP_ORDER]
    assert positions == sorted(positions)
    instances = out[positions[0]:positions[1]]
    assert "--ncores-per-instance, --ncore-per-instance" in instances
    assert "--cores-list, --core-list" in instances and "--bind-numa-node, --skip-cross-node-cores" in instances
    assert "--ncores_per_instance" not in out       # underscore spellings accepted, not listed
    doc = (REPO / "docs" / "launcher.md").read_text()
    for group in cli_spec.GROUP_ORDER:
        assert f"## {group}" in doc


def test_dry_run_json_is_one_object_and_starts_nothing(marker_script, xlaunch_here) -> None:
    script, marker = marker_script
    xlaunch = xlaunch_here
    result = xlaunch("--dry-run", "--json", "--ninstances", "2", str(script), "a b", "$HOME",
                     fsroot=str(machine_tree("xeon-2s-amx")), env={"OMP_NUM_THREADS": "3"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [i["index"] for i in data["instances"]] == [0, 1]
    assert data["instances"][0]["argv"][-3:] == [str(script), "a b", "$HOME"]
    assert data["env_kept"] == {"OMP_NUM_THREADS": "3"}
    assert data["machine"]                      # the machine summary is included
    assert "kept your OMP_NUM_THREADS=3" in result.stderr
    assert not marker.exists()
    quiet = xlaunch("-q", "--dry-run", "--json", str(script), env={"OMP_NUM_THREADS": "3"})
    assert quiet.stderr == ""


def test_readable_dry_run(xlaunch_here) -> None:
    result = xlaunch_here("--dry-run", "--ninstances", "2", "--no-python", "true", fsroot=str(machine_tree("epyc-4node-nps4")))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("xlaunch plan: 2 instances")
    assert "[0] cpus 0-31 (32)" in result.stdout and "[1] cpus 32-63 (32)" in result.stdout


def test_launcher_never_imports_torch() -> None:
    """Nor what a plain launch does not need: click, dataclasses, inspect, typing (start-up cost),
    counted beyond what the interpreter imports on its own (some distributions' site start-up
    imports inspect and typing: that costs every program, ours included)."""
    count = str(min(2, allowed_cores()))
    code = (
        "import sys; from xlaunch.launcher import cli\n"
        f"status = cli.run(['--dry-run', '--json', '--ninstances', '{count}', '--no-python', 'true'])\n"
        "assert status == 0, status\n"
        "assert cli.run(['-q', '--ninstances', '1', '--no-python', 'true']) == 0\n"
        "print('modules:', ' '.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    imported = result.stdout.strip().rsplit("modules: ", 1)[1].split()
    heavy = ("torch", "numpy", "rich", "cpuinfo", "click", "dataclasses", "inspect", "typing")
    assert heavy_imports(imported, heavy, startup_modules()) == []


def test_two_instances_really_run_pinned(tmp_path) -> None:
    """The CLI hands the plan to the runner: each instance runs inside its own CPUs."""
    need_cores(2)
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ['XLAUNCH_INSTANCE_INDEX'], sorted(os.sched_getaffinity(0)), sys.argv[1:])\n"
    )
    argv = ["--ninstances", "2", "--ncores-per-instance", "1", "--memory-allocator", "default", str(script), "a b",
            "$HOME"]
    cpus = [inst["cpus"] for inst in planned(argv)]
    result = xlaunch(*argv)
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("["))
    assert lines == [f"[{i}] {i} {cpus[i]} ['a b', '$HOME']" for i in range(2)]


def test_exit_status_of_a_failing_instance_is_returned() -> None:
    result = xlaunch("--no-python", "sh", "-c", "exit 3")
    assert result.returncode == 3


def test_machine_information_flags_dispatch_to_the_reports(xlaunch_here) -> None:
    """In-process (``cli.run``, what ``python -m xlaunch`` runs): these print and return."""
    isa = xlaunch_here("--check-isa", "--json")
    assert isa.returncode == 0, isa.stderr
    flags = json.loads(isa.stdout)["isa"]
    cpuinfo = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    assert flags["avx2"] == ("avx2" in cpuinfo) and flags["fma"] == ("fma" in cpuinfo)
    topo = xlaunch_here("--show-topology", "--json", fsroot=str(machine_tree("container-cpuset")))
    assert topo.returncode == 0, topo.stderr
    assert json.loads(topo.stdout)["allowed_cpulist"] == "4-7,36-39"
    readable = xlaunch_here("--show-topology")
    assert readable.returncode == 0 and "NUMA" in readable.stdout
    for argv, option in ((["--check-isa", "prog.py"], "--check-isa"), (["--torch", "--show-topology"], "--torch"),
                         (["--check-isa", "--show-topology"], "--show-topology")):
        bad = xlaunch_here(*argv)
        assert bad.returncode == 2 and bad.stderr.startswith(f"xlaunch: error: {option}: ")


def test_taskset_restricted_launcher_plans_inside_its_cpu() -> None:
    if 1 not in os.sched_getaffinity(0):
        pytest.skip("CPU 1 not allowed here")
    result = subprocess.run(["taskset", "-c", "1", sys.executable, "-m", "xlaunch", "--dry-run", "--json",
                             "--no-python", "true"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [i["cpus"] for i in json.loads(result.stdout)["instances"]] == [[1]]


PLACES_SCRIPT = """
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1])
places = []
for p in range(lib.omp_get_num_places()):
    ids = (ctypes.c_int * lib.omp_get_place_num_procs(p))()
    lib.omp_get_place_proc_ids(p, ids)
    places.append(list(ids))
print(os.environ["XLAUNCH_INSTANCE_INDEX"], places, sorted(os.sched_getaffinity(0)))
"""


# every binding with one CPU per instance on 2 CPUs; one instance of all of them: several CPUs each
PLACES_CASES = [(2, bind, runtime) for bind in ("native", "none") for runtime in ("intel", "default")] + [
    (1, "native", "intel"), (1, "native", "default")]


@pytest.mark.parametrize("ninstances, bind, runtime", PLACES_CASES)
def test_each_instance_openmp_places_are_its_own_cpus(tmp_path, bind: str, runtime: str, ninstances: int,
                                                      request) -> None:
    """The KMP_AFFINITY/OMP_PLACES clash check: with or without external binding, the OpenMP
    runtime inside instance i sees exactly instance i's CPUs as its places (however many CPUs
    an instance has: one instance is all of them)."""
    need_cores(ninstances)
    library = "libiomp5.so" if runtime == "intel" else "libgomp.so.1"
    if runtime == "intel":
        request.getfixturevalue("iomp_path")
    script = tmp_path / "places.py"
    script.write_text(PLACES_SCRIPT)
    argv = ["--omp-runtime", runtime, "--bind-with", bind, "--memory-allocator", "default",
            "--ninstances", str(ninstances), str(script), library]
    instances = planned(argv)
    result = xlaunch("-q", *argv)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("["))
    # Native binding narrows the mask to the instance before exec. libgomp narrows it further
    # when it initialises (OMP_PROC_BIND=close binds the initial thread to the first place);
    # libiomp5 only binds threads at the first parallel region, so without native binding the
    # mask is still the launcher's here.
    expected = []
    for i, inst in enumerate(instances):
        if runtime == "intel" and bind == "none":
            mask = list(ALLOWED)
        else:
            mask = main_thread_cpus(inst, started=False)
        expected.append(f"[{i}] {i} {openmp_places(inst)} {mask}")
    assert lines == expected
    assert all(set(inst["cpus"]) <= set(ALLOWED) for inst in instances)


def test_which_finds_executables_like_shutil(tmp_path) -> None:
    import shutil

    from xlaunch.launcher.plan.which import which

    (tmp_path / "plain").write_text("")
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    path = f"{tmp_path / 'missing'}{os.pathsep}{tmp_path}"
    for name in ("tool", "plain", "nothing", str(tool), str(tmp_path / "plain")):
        assert which(name, path=path) == shutil.which(name, path=path)
    assert which("sh") == shutil.which("sh")


def test_a_venv_in_a_folder_with_a_space_runs_with_its_intel_openmp_and_no_loader_errors(tmp_path: Path,
                                                                                         iomp_path: str) -> None:
    """A venv under "My Projects" with intel-openmp in its lib/: the loader splits LD_PRELOAD at spaces, so
    xlaunch names libiomp5.so by file name and puts its folder first in LD_LIBRARY_PATH. The instance maps
    that very file, and no "ld.so: object ... cannot be preloaded" line appears."""
    import sysconfig

    venv = tmp_path / "My Projects" / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True,
                          timeout=120)
    if made.returncode != 0:
        pytest.skip(f"python -m venv failed: {made.stderr.strip()[-200:]}")
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, timeout=60).stdout.strip()
    ours = sysconfig.get_path("purelib")        # this venv's packages (xlaunch itself), through a .pth
    Path(site, "xlaunch-tests.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    (venv / "lib" / "libiomp5.so").symlink_to(iomp_path)
    program = tmp_path / "maps.py"
    program.write_text("import os\nprint([l.split(None, 5)[-1].strip() for l in open('/proc/self/maps') if 'libiomp5' in l][:1])\n"
                       "print(os.environ['LD_PRELOAD'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLAUNCH_FSROOT", "VIRTUAL_ENV", "LD_PRELOAD")}
    done = subprocess.run([str(python), "-m", "xlaunch", "--ninstances", "1", "--omp-runtime", "intel", str(program)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0 and "ld.so" not in done.stderr + done.stdout, done.stderr + done.stdout
    lines = [line.split("] ", 1)[1] for line in done.stdout.splitlines()]
    assert lines[0] == repr([os.path.realpath(iomp_path)]), done.stdout
    assert "libiomp5.so" in lines[1].split(":") and " " not in lines[1], lines[1]
