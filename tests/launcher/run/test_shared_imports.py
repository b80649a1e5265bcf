"""``--share-imports``: instances forked from one process that imported the modules once.

Real processes throughout: the instances' parent, threads' affinity and shared pages are read back
from /proc; the options, the plan and the server's framing are checked without starting anything.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import loader_env
import pytest
from host_cpus import need_cores, openmp_places, planned, without_budget_warning
from processes import wait_gone

from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.plan.options import build_options
from xlaunch.launcher.run.shared_imports import program as forkprogram
from xlaunch.launcher.run.shared_imports import server as forkserver

live = pytest.mark.live
# The live tests choose their OpenMP runtime themselves: not again in the libiomp5 rerun.
CHOOSES_ITS_RUNTIME = pytest.mark.skipif(os.environ.get("XLAUNCH_TEST_OMP_KIND") == "iomp",
                                         reason="chooses its OpenMP runtime itself")


clean_env = loader_env.without_openmp_and_preloads


def xlaunch(argv: list[str], *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlaunch", *argv], capture_output=True, text=True, timeout=timeout,
                          env=kwargs.pop("env", clean_env()), **kwargs)


# ------------------------------------------------------------------------------------ options, plan

@pytest.mark.parametrize("value, expected", [
    ("torch", ("torch",)), (" torch , transformers.models.llama ,torch", ("torch", "transformers.models.llama")),
    (["numpy", "torch"], ("numpy", "torch")),
])
def test_modules_are_read_from_the_command_line_and_config_files(value, expected):
    assert build_options({"share_imports": value}, program="app.py").share_imports == expected


@pytest.mark.parametrize("value, problem", [
    ("../evil", "is not a module name"), ("torch,", "is not a module name"), ("os.path/x", "is not a module name"),
    ("a" * 201, "is not a module name"), (",".join(f"m{i}" for i in range(33)), "at most 32"), (7, "expected module"),
])
def test_bad_module_lists_name_the_option(value, problem):
    with pytest.raises(OptionError) as error:
        build_options({"share_imports": value}, program="app.py")
    assert error.value.option == "--share-imports" and problem in str(error.value)


@pytest.mark.parametrize("other, says", [
    ({"no_python": True}, "--no-python"), ({"bind_with": "numactl"}, "--bind-with numactl"),
    ({"bind_with": "taskset"}, "--bind-with taskset"), ({"nproc_per_node": "2"}, "--nproc-per-node"),
])
def test_combinations_that_cannot_share_are_refused(other, says):
    with pytest.raises(OptionError) as error:
        build_options({"share_imports": "torch", **other}, program="app.py")
    assert error.value.option == "--share-imports" and says in str(error.value)


def test_one_server_per_memory_placement_on_a_two_socket_machine(recorded_machine):
    from xlaunch.launcher.plan.planner import plan as make_plan
    from xlaunch.machine import load_machine

    machine = load_machine(str(recorded_machine("xeon-2s-amx")))
    options = build_options({"throughput_mode": True, "share_imports": "torch"}, program="app.py")
    plan = make_plan(options, machine, {"PATH": "/usr/bin"})
    assert len(plan.instances) == 2 and len(plan.import_servers) == 2
    for instance, server in zip(plan.instances, plan.import_servers):
        assert server.indices == (instance.index,)
        assert server.cpus == instance.cpus and server.mem_nodes == instance.mem_nodes
        assert server.membind == instance.membind == "bind"
        placement = {"OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "XLAUNCH_CPUS", "XLAUNCH_INSTANCE_INDEX"}
        assert {k: v for k, v in instance.env.items() if k not in placement} == server.env
    assert plan.to_json()["import_servers"][1]["mem_nodes"] == [1]
    # instances sharing a node share a server; the variables that differ stay with each instance
    options = build_options({"ninstances": 4, "share_imports": "torch,numpy"}, program="app.py")
    plan = make_plan(options, machine, {"PATH": "/usr/bin"})
    assert [s.indices for s in plan.import_servers] == [(0, 1), (2, 3)]
    assert [s.modules for s in plan.import_servers] == [("torch", "numpy")] * 2
    assert all("XLAUNCH_INSTANCE_INDEX" not in s.env and s.env["OMP_NUM_THREADS"] for s in plan.import_servers)


def test_auto_optimize_hooks_are_left_off_the_server_for_each_instance_to_install(recorded_machine):
    from xlaunch.kernels.inject import PACKAGE_PARENT, SITE_DIR
    from xlaunch.launcher.plan.planner import plan as make_plan
    from xlaunch.machine import load_machine

    machine = load_machine(str(recorded_machine("xeon-2s-amx")))
    for user, left in (("/user/lib", ["/user/lib", PACKAGE_PARENT]), ("", [PACKAGE_PARENT])):
        environ = {"PATH": "/usr/bin", **({"PYTHONPATH": user} if user else {})}
        options = build_options({"ninstances": 2, "share_imports": "torch", "auto_optimize": True}, program="app.py")
        plan = make_plan(options, machine, environ)
        assert [i.env["PYTHONPATH"].split(os.pathsep) for i in plan.instances] == [[SITE_DIR, *left]] * 2
        assert [s.env["PYTHONPATH"].split(os.pathsep) for s in plan.import_servers] == [left] * 2   # one a node
        assert plan.import_servers[0].env["XLAUNCH_AUTO_OPTIMIZE"] == "float32"   # harmless without the hooks


def test_the_dry_run_says_where_the_imports_happen(plain):
    result = xlaunch(["--dry-run", "--share-imports", "torch", str(plain)])
    assert result.returncode == 0, result.stderr
    assert "shared imports: torch imported once on cpus" in result.stdout
    assert "--share-imports with one instance shares nothing" in result.stderr


# ------------------------------------------------------------------------------- the server's parts

def test_the_servers_output_is_given_out_once_and_what_passes_the_cap_is_counted_once(tmp_path):
    from xlaunch.launcher.run.shared_imports.client import ForkServer

    with open(tmp_path / "out", "a+b", buffering=0) as output:     # appending, as the server's (O_APPEND) does
        server = ForkServer(spec=None, proc=None, sock=None, output=output, launched=0.0)
        output.write(b"a" * 50)
        assert server.unshown_output(cap=64) == (b"a" * 50, 0)
        output.write(b"b" * 50)
        assert server.unshown_output(cap=64) == (b"b" * 14, 36)
        assert server.unshown_output(cap=64) == (b"", 0)
        output.write(b"c" * 10)
        assert server.unshown_output(cap=64) == (b"", 10)


def test_the_places_are_read_from_the_variables_the_plan_sets():
    assert forkprogram.places_in({"OMP_PLACES": "{4},{5},{6}", "OMP_NUM_THREADS": "2"}) == [(4,), (5,)]
    intel = {"KMP_AFFINITY": "granularity=fine,proclist=[{4,5,6},5,6],explicit"}
    assert forkprogram.places_in(intel) == [(4, 5, 6), (5,), (6,)]
    assert forkprogram.places_in({"OMP_PLACES": "cores"}) is None        # a user's own spelling
    assert forkprogram.places_in({"OMP_PLACES": "{0:4}"}) is None
    assert forkprogram.places_in({}) is None


def test_framing_carries_descriptors_and_refuses_what_is_not_a_message():
    ours, theirs = socket.socketpair()
    read_fd, write_fd = os.pipe()
    forkserver.send_message(ours, {"argv": ["x"], "env": {"A": "\udcff"}}, [write_fd])
    message, fds = forkserver.receive_message(theirs)
    assert message == {"argv": ["x"], "env": {"A": "\udcff"}} and len(fds) == 1
    os.write(fds[0], b"through")
    assert os.read(read_fd, 16) == b"through"
    for fd in (*fds, read_fd, write_fd):
        os.close(fd)
    ours.sendall(struct.pack("!I", forkserver.MAX_MESSAGE + 1))
    with pytest.raises(forkserver.ProtocolError, match="at most"):
        forkserver.receive_message(theirs)
    ours.sendall(struct.pack("!I", 3) + b"[1]")
    with pytest.raises(forkserver.ProtocolError, match="not a JSON object"):
        forkserver.receive_message(theirs)
    ours.sendall(struct.pack("!I", 10) + b"{}")
    ours.close()
    with pytest.raises(forkserver.ProtocolError, match="ended inside"):
        forkserver.receive_message(theirs)
    theirs.close()


# ------------------------------------------------------------------------------------- live: torch

TORCH_PROGRAM = r"""
import json, os, sys, time
imported_before = "torch" in sys.modules
import torch
torch.ones(1 << 22).add_(1)                      # a parallel region: the OpenMP team exists now
threads = {}
for tid in os.listdir("/proc/self/task"):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            threads[tid] = line.split(":")[1].strip()
folder, count = sys.argv[1], int(os.environ["XLAUNCH_NINSTANCES"])
open(os.path.join(folder, os.environ["XLAUNCH_INSTANCE_INDEX"]), "w").close()
deadline = time.monotonic() + 30
while len(os.listdir(folder)) < count and time.monotonic() < deadline:
    time.sleep(0.02)                              # every instance alive: the pages are shared now
memory = {}
for line in open("/proc/self/smaps_rollup"):
    parts = line.split()
    if len(parts) == 3:
        memory[parts[0].rstrip(":")] = int(parts[1])
print(json.dumps({"before": imported_before, "ppid": os.getppid(), "main": threads[str(os.getpid())],
                  "threads": sorted(threads.values()), "anon": memory["Anonymous"], "pss_anon": memory["Pss_Anon"],
                  "name": __name__, "argv": sys.argv[1:], "path0": sys.path[0],
                  "team": torch.get_num_threads()}))
while len(os.listdir(folder)) < 2 * count and time.monotonic() < deadline + 30:
    open(os.path.join(folder, "done-" + os.environ["XLAUNCH_INSTANCE_INDEX"]), "w").close()
    time.sleep(0.02)
"""


@live
@CHOOSES_ITS_RUNTIME
@pytest.mark.parametrize("omp", ["default", "intel"])
@pytest.mark.parametrize("shape", [("--ninstances", "2"), ("--ninstances", "1", "--ncores-per-instance", "2")],
                         ids=["2-instances", "1-instance-2-cores"])
def test_instances_are_forked_pinned_and_share_torch(omp, shape, tmp_path, request):
    pytest.importorskip("torch")
    need_cores(2)
    if omp == "intel":
        request.getfixturevalue("iomp_path")
    script = tmp_path / "program.py"
    script.write_text(TORCH_PROGRAM)
    (tmp_path / "marks").mkdir()
    argv = ["-q", *shape, "--omp-runtime", omp, "--share-imports", "torch", str(script), str(tmp_path / "marks")]
    instances = planned(argv, clean_env())
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env())
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert without_budget_warning(err) == "", out + err
    assert all(line.startswith(("[0] {", "[1] {")) for line in out.splitlines()), out
    seen = {int(line[1:line.index("]")]): json.loads(line.split("] ", 1)[1]) for line in out.splitlines()}
    assert sorted(seen) == [i["index"] for i in instances]
    for instance in instances:
        got = seen[instance["index"]]
        got["planned"] = instance["cpus"], openmp_places(instance)    # shown when an assertion fails
        assert got["before"] is True, got
        assert got["ppid"] == proc.pid, got          # adopted by xlaunch, not the server's child
        assert (got["name"], got["argv"], got["path0"]) == ("__main__", [str(tmp_path / "marks")], str(tmp_path)), got
        places = openmp_places(instance)
        assert got["team"] == len(places), got
        from xlaunch.cpulist import format_cpulist, parse_cpulist

        assert got["main"] == format_cpulist(places[0]), got
        for place in places:             # each team thread on its place, every thread inside the instance
            assert format_cpulist(place) in got["threads"], got
        assert all(set(parse_cpulist(mask)) <= set(instance["cpus"]) for mask in got["threads"]), got
    if len(instances) > 1:               # the server's imported pages, shared by the instances
        assert all(got["anon"] - got["pss_anon"] > 20 * 1024 for got in seen.values()), seen


# ------------------------------------------------------------------------- live: no torch (cheap)

PLAIN_PROGRAM = r"""
import os, sys
print("shared" if "json" in sys.modules and "marker_module" in sys.modules else "alone", __name__, sys.argv[1:],
      os.environ["XLAUNCH_INSTANCE_INDEX"], flush=True)
if sys.argv[1:2] == ["fail"] and os.environ["XLAUNCH_INSTANCE_INDEX"] == "1":
    raise ValueError("instance one fails")
"""


@pytest.fixture()
def plain(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_PROGRAM)
    (tmp_path / "marker_module.py").write_text("VALUE = 1\n")
    return script


AUTO_OPTIMIZED = r"""
import json, os
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
x = torch.randn(4, 8)
reference = torch.relu(x @ model[0].weight.T + model[0].bias) @ model[2].weight.T + model[2].bias
with torch.no_grad():
    out = model(x)
print(json.dumps({"sgd": torch.optim.SGD.__name__, "close": bool(torch.allclose(out, reference, atol=1e-5)),
                  "index": os.environ["XLAUNCH_INSTANCE_INDEX"]}), flush=True)
"""


@live
@CHOOSES_ITS_RUNTIME
def test_auto_optimize_runs_its_hooks_in_each_forked_instance(tmp_path):
    """The server imports torch without the hooks; each instance installs them from its own environment:
    its own messages, its fused optimizers, its model optimized, its engines in its own record."""
    pytest.importorskip("torch")
    need_cores(2)
    script, summary = tmp_path / "auto.py", tmp_path / "summary.json"
    script.write_text(AUTO_OPTIMIZED)
    result = xlaunch(["--ninstances", "2", "--ncores-per-instance", "1", "--share-imports", "torch", "--auto-optimize",
                      "--auto-optimize-verbose", "--summary-json", str(summary), str(script)],
                     env={**clean_env(), "XLAUNCH_AUTO_OPTIMIZE_BACKEND": "torch"})
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    for index in (0, 1):
        mine = [line for line in lines if line.startswith(f"[{index}] ")]
        assert sum("optimizers SGD, Adagrad, Adam, AdamW -> xlaunch fused" in line for line in mine) == 1, lines
        assert sum("Sequential optimized" in line for line in mine) == 1, lines
        [row] = [json.loads(line[4:]) for line in mine if line[4:].startswith("{")]
        assert row == {"sgd": "FusedSGD", "close": True, "index": str(index)}
    assert [line for line in lines if not line.startswith(("[0] ", "[1] ", "xlaunch: "))] == []
    report = json.loads(summary.read_text())
    assert [[e["module"] for e in i["engines"]] for i in report["instances"]] == [["Sequential"]] * 2
    [served] = report["import_servers"]
    assert served["instances"] == [0, 1] and "unavailable" not in served


@live
def test_a_program_without_torch_runs_the_same_many_times(plain, tmp_path):
    need_cores(2)
    for _ in range(4):
        result = xlaunch(["-q", "--ninstances", "2", "--share-imports", "json,marker_module",
                          "--summary-json", str(tmp_path / "summary.json"), str(plain), "a b"])
        assert result.returncode == 0 and without_budget_warning(result.stderr) == "", result.stderr
        assert sorted(result.stdout.splitlines()) == ["[0] shared __main__ ['a b'] 0", "[1] shared __main__ ['a b'] 1"]
        [served] = json.loads((tmp_path / "summary.json").read_text())["import_servers"]
        assert served["modules"] == ["json", "marker_module"] and served["instances"] == [0, 1]
        assert served["import_s"] >= 0 and "unavailable" not in served


@live
def test_a_failing_instance_reports_as_python_would_and_stops_the_others(plain, tmp_path):
    need_cores(2)
    result = xlaunch(["--ninstances", "2", "--share-imports", "marker_module,json", str(plain), "fail"])
    assert result.returncode == 1
    assert ": allocator " in result.stderr and ", forked from 1 process that imported marker_module,json\n" in result.stderr
    assert "[1] ValueError: instance one fails" in result.stdout
    assert "shared_imports" not in result.stdout, "the server's own frames are not the program's traceback"
    assert 'File "' + str(plain) + '", line 6, in <module>' in result.stdout


@live
def test_a_module_program_gets_stdin_and_its_own_main(tmp_path):
    """As ``python -u -m echo_main`` has them: ``__main__``, ``sys.argv``, ``sys.orig_argv``, stdin, and a
    ``sys.path`` without the folder the server found xlaunch in."""
    repo = str(Path(__file__).resolve().parents[3])
    (tmp_path / "echo_main.py").write_text(
        "import sys\nprint(__name__, sys.argv, getattr(sys, 'orig_argv', ['', 'none'])[1:], sys.argv[1] in sys.path,\n"
        "      sys.stdin.read().strip())\n")
    result = xlaunch(["-q", "--share-imports", "json", "-m", "echo_main", repo], input="from stdin\n", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plain = subprocess.run([sys.executable, "-u", "-m", "echo_main", repo], input="from stdin\n", capture_output=True,
                           text=True, cwd=tmp_path, env=clean_env())
    assert plain.stdout.startswith(f"__main__ {[str(tmp_path / 'echo_main.py'), repo]} "), plain.stderr
    assert result.stdout == f"[0] {plain.stdout}"


@live
def test_ps_shows_the_program_not_the_server(plain):
    """What ``ps``/``pgrep -f`` read (``/proc/PID/cmdline``): the instance's command line, setproctitle-style."""
    script = plain.with_name("cmdline.py")
    script.write_text("print(open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0').decode())\n")
    result = xlaunch(["-q", "--share-imports", "json", str(script), "an argument"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"[0] {sys.executable} -u {script} an argument\n"


NOISY_MODULE = r"""
import atexit, os, shutil, sys, tempfile, warnings
print("noisy: to stdout", sys.argv)
sys.stderr.write("noisy: to stderr\n")
warnings.warn("noisy: a warning at import")
SCRATCH = tempfile.mkdtemp(prefix="xlaunch-test-scratch-")
atexit.register(shutil.rmtree, SCRATCH, True)
atexit.register(print, "noisy: exit handler ran")
"""
USES_NOISY = r"""
import os, time, noisy
time.sleep(0.5)                       # the server has ended by now
print("scratch folder there:", os.path.isdir(noisy.SCRATCH), flush=True)
print(noisy.SCRATCH, flush=True)
"""


@live
def test_what_the_imports_print_is_shown_once_and_their_exit_handlers_are_the_instances(tmp_path):
    """The server's output (its imports' prints and warnings) is shown once, prefixed with the instances it
    serves; the imports see the program's ``sys.argv``, as in a plain interpreter; the server leaves without running the imports' exit handlers, so a scratch folder a module made
    at import is still there for the instance, which runs them at its own exit."""
    (tmp_path / "noisy.py").write_text(NOISY_MODULE)
    script = tmp_path / "uses_noisy.py"
    script.write_text(USES_NOISY)
    result = xlaunch(["-q", "--ninstances", "1", "--share-imports", "noisy", str(script), "an argument"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [f"[imports 0] noisy: to stdout {[str(script), 'an argument']}", "[imports 0] noisy: to stderr",
                         f"[imports 0] {tmp_path / 'noisy.py'}:5: UserWarning: noisy: a warning at import"], lines
    assert lines[4] == "[0] scratch folder there: True" and lines[6:] == ["[0] noisy: exit handler ran"], lines
    assert not Path(lines[5][4:]).exists()             # removed at the instance's exit


@live
@pytest.mark.parametrize("module, says", [
    ("no_such_module_here", "import no_such_module_here: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("json,starts_a_thread", "importing starts_a_thread (1) started thread(s) that a fork would leave behind "
                             "(leave it out of --share-imports)"),
    ("json+sitecustomize", "the interpreter's start-up (a sitecustomize or .pth file) started 1 thread(s) that a "
                           "fork would leave behind"),
])
def test_a_server_that_cannot_serve_is_told_once_and_the_instances_start_alone(module, says, plain, tmp_path):
    need_cores(2)
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    env = clean_env()
    if module == "json+sitecustomize":         # a thread from the interpreter's own start-up, before any import
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text((tmp_path / "starts_a_thread.py").read_text())
        env["PYTHONPATH"], module = str(tmp_path / "site"), "json"
    result = xlaunch(["--ninstances", "2", "--share-imports", module, str(plain)], env=env)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "--share-imports" in line]
    assert warnings == [f"xlaunch: warning: --share-imports: {says}; instances 0,1 start on their own"]
    assert sorted(result.stdout.splitlines()) == ["[0] alone __main__ [] 0", "[1] alone __main__ [] 1"]


@live
def test_numpy_draws_fresh_random_numbers_in_each_instance(tmp_path):
    pytest.importorskip("numpy")
    need_cores(2)
    script = tmp_path / "draw.py"
    script.write_text("import numpy\nprint(numpy.random.rand())\n")
    result = xlaunch(["-q", "--ninstances", "2", "--share-imports", "numpy", str(script)])
    assert result.returncode == 0, result.stderr
    draws = {line.split("] ")[1] for line in result.stdout.splitlines()}
    assert len(draws) == 2, result.stdout


@live
def test_killing_xlaunch_leaves_no_forked_instance(tmp_path):
    need_cores(2)
    script = tmp_path / "wait.py"
    token = f"xl-shared-{os.getpid()}-{time.monotonic_ns()}"
    script.write_text(f"import os, time\nprint('up', os.getpid(), flush=True)\ntime.sleep(60)  # {token}\n")
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "-q", "--ninstances", "2", "--share-imports", "json",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert wait_gone(pids, timeout=15) == []
    proc.stdout.close()
    proc.stderr.close()


def test_without_a_child_subreaper_the_instances_start_alone(plain, monkeypatch, capsys):
    """xlaunch could not adopt forked instances: said once, and they start as without the option."""
    need_cores(2)
    from xlaunch.launcher.cli.command import run
    from xlaunch.launcher.run import binding

    def refuse(enabled: bool) -> bool:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(binding, "set_child_subreaper", refuse)
    code = run(["--ninstances", "2", "--share-imports", "json", str(plain)], clean_env())
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert ("xlaunch: warning: --share-imports: xlaunch cannot adopt forked instances here (no child subreaper); "
            "instances 0,1 start on their own") in captured.err


SIBLING_MODULE = r"""
import os, time
folder = os.environ["SIBLING_DIR"]
open(os.path.join(folder, str(os.getpid())), "w").close()
deadline = time.monotonic() + 10
while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
SAW = len(os.listdir(folder)) >= 2          # the other server was importing at the same time
"""


@live
def test_every_server_imports_at_once(tmp_path, capfd):
    """Two memory placements, two servers: both are started before either is waited for (a module that
    waits at import for the other server's to start would otherwise wait 10 s and say so)."""
    from host_cpus import ALLOWED

    from xlaunch.launcher.plan.records import Instance, Plan
    from xlaunch.launcher.plan.shared import import_servers
    from xlaunch.launcher.run.runner import run_plan

    (tmp_path / "sibling_wait.py").write_text(SIBLING_MODULE)
    (tmp_path / "siblings").mkdir()
    script = tmp_path / "report.py"
    script.write_text("import sys\nshared = 'sibling_wait' in sys.modules\nimport sibling_wait\n"
                      "print('saw', sibling_wait.SAW, shared)\n")
    env = {**clean_env(), "SIBLING_DIR": str(tmp_path / "siblings")}
    instances = tuple(Instance(index=i, cpus=(ALLOWED[i % len(ALLOWED)],), mem_nodes=(0,), env=env,
                               argv=(sys.executable, "-u", str(script)), membind=policy)
                      for i, policy in enumerate(("bind", "preferred")))
    plan = Plan(instances, import_servers=import_servers(instances, ("sibling_wait",)))
    assert len(plan.import_servers) == 2
    summary = tmp_path / "summary.json"
    assert run_plan(plan, quiet=True, summary_json=str(summary)) == 0, capfd.readouterr()
    out, _ = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[0] saw True True", "[1] saw True True"]
    served = json.loads(summary.read_text())["import_servers"]
    assert len({entry["pid"] for entry in served}) == 2 and all(entry["import_s"] < 9 for entry in served)
