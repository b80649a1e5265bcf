"""The runner with real processes: pinning, allocator, statuses, signals, output, logs.

Each test builds a Plan directly and runs ``run_plan`` in a fresh launcher process (a small
harness script), so signals and process trees are real and pytest's own process is untouched.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from xlaunch.cpulist import parse_cpulist
from xlaunch.launcher.plan.planner import Instance, Plan

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable
ALLOWED = sorted(os.sched_getaffinity(0))

HARNESS = r"""
import json, sys
from xlaunch.launcher.plan.planner import Instance, Plan
from xlaunch.launcher.run.runner import run_plan
spec = json.load(open(sys.argv[1]))
instances = tuple(
    Instance(index=d["index"], cpus=tuple(d["cpus"]), mem_nodes=tuple(d["mem_nodes"]), env=d["env"],
             argv=tuple(d["argv"]), bind=d["bind"], membind=d["membind"])
    for d in spec["plan"]["instances"])
sys.exit(run_plan(Plan(instances), **spec["options"]))
"""


def instance(index: int, argv: list[str], *, cpus: tuple[int, ...] | None = None, env: dict | None = None,
             bind: str = "native", membind: str = "bind", mem_nodes: tuple[int, ...] = (0,)) -> Instance:
    if cpus is None:
        cpus = (ALLOWED[index % len(ALLOWED)],)
    child_env = dict(os.environ)
    child_env.update(env or {})
    return Instance(index=index, cpus=cpus, mem_nodes=mem_nodes, env=child_env, argv=tuple(argv),
                    bind=bind, membind=membind)


def py(index: int, code: str, *args: str, **kwargs) -> Instance:
    """A Python instance; ``-S``: its code needs the standard library only (no site-packages to scan)."""
    return instance(index, [PY, "-S", "-c", code, *args], **kwargs)


def start_launcher(tmp_path: Path, instances: list[Instance], **options) -> subprocess.Popen:
    spec = tmp_path / f"plan_{time.monotonic_ns()}.json"
    spec.write_text(json.dumps({"plan": Plan(tuple(instances)).to_json(), "options": options}))
    return subprocess.Popen([PY, "-c", HARNESS, str(spec)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_default_signals)


def _default_signals() -> None:
    """The launcher starts with SIGINT/SIGHUP/SIGTERM at their defaults, however the suite was started:
    a background job inherits SIGINT ignored, and xlaunch keeps an inherited SIG_IGN (by design)."""
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


def launch(tmp_path: Path, instances: list[Instance], timeout: float = 60, **options):
    """Run a plan to the end; return (status, stdout bytes, stderr text)."""
    proc = start_launcher(tmp_path, instances, **options)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err.decode(errors="replace")


def lines_of(out: bytes, index: int) -> list[bytes]:
    prefix = f"[{index}] ".encode()
    return [line[len(prefix):] for line in out.split(b"\n") if line.startswith(prefix)]


def field(status_text: str, name: str) -> str:
    for line in status_text.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{name} not in {status_text!r}")


# ------------------------------------------------------------------------------------ binding

SHOW_STATUS = "import sys; sys.stdout.write(open('/proc/self/status').read()); " \
              "sys.stdout.write(open('/proc/self/numa_maps').readline())"


def test_native_binding_pins_each_instance_to_its_cpus_and_memory(tmp_path: Path) -> None:
    instances = [py(i, SHOW_STATUS, cpus=(cpu,)) for i, cpu in enumerate(ALLOWED[:2])]
    status, out, err = launch(tmp_path, instances)
    assert status == 0, err
    for i, cpu in enumerate(ALLOWED[:2]):
        text = b"\n".join(lines_of(out, i)).decode()
        assert parse_cpulist(field(text, "Cpus_allowed_list")) == (cpu,)
        assert " bind:0 " in text.splitlines()[-1] + " ", text.splitlines()[-1]


@pytest.mark.parametrize("membind, shown", [("interleave", "interleave:0"), ("preferred", "prefer:0"),
                                            ("none", "default")])
def test_membind_modes_visible_in_numa_maps(tmp_path: Path, membind: str, shown: str) -> None:
    status, out, err = launch(tmp_path, [py(0, SHOW_STATUS, membind=membind)])
    assert status == 0, err
    assert lines_of(out, 0)[-1].split()[1].decode() == shown


def test_affinity_read_from_outside_while_instances_run(tmp_path: Path) -> None:
    code = "import time; print('ready', flush=True); time.sleep(30)"
    instances = [py(i, code, cpus=(cpu,)) for i, cpu in enumerate(ALLOWED[:2])]
    proc = start_launcher(tmp_path, instances, grace_period=1.0, quiet=True)
    try:
        assert proc.stdout is not None
        for _ in instances:
            assert b"ready" in proc.stdout.readline()
        # instances lead their own sessions; so does the watchdog (xlaunch's other child: watchdog.py)
        children = sorted((c for c in psutil.Process(proc.pid).children() if os.getsid(c.pid) == c.pid
                           and not any(part.endswith("watchdog.py") for part in c.cmdline())),
                          key=lambda p: p.create_time())
        assert len(children) == len(instances)
        seen = {}
        for child in children:
            text = Path(f"/proc/{child.pid}/status").read_text()
            seen[child.pid] = parse_cpulist(field(text, "Cpus_allowed_list"))
            assert os.getpgid(child.pid) == child.pid, "each instance leads its own process group"
            assert os.getsid(child.pid) == child.pid
        assert sorted(seen.values()) == [(cpu,) for cpu in ALLOWED[:2]]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM


def test_refused_memory_policy_falls_back_to_cpu_binding_with_one_warning(tmp_path: Path) -> None:
    # Node 63 is not allowed (no such node), so set_mempolicy fails with EINVAL.
    instances = [py(i, SHOW_STATUS, cpus=(cpu,), mem_nodes=(63,)) for i, cpu in enumerate(ALLOWED[:2])]
    status, out, err = launch(tmp_path, instances)
    assert status == 0, err
    assert err.count("memory policy refused") == 1, err
    for i, cpu in enumerate(ALLOWED[:2]):
        text = b"\n".join(lines_of(out, i)).decode()
        assert parse_cpulist(field(text, "Cpus_allowed_list")) == (cpu,)
        assert text.splitlines()[-1].split()[1] == "default"


def test_bind_none_leaves_affinity_alone(tmp_path: Path) -> None:
    status, out, err = launch(tmp_path, [py(0, SHOW_STATUS, cpus=(ALLOWED[0],), bind="none")])
    assert status == 0, err
    text = b"\n".join(lines_of(out, 0)).decode()
    assert parse_cpulist(field(text, "Cpus_allowed_list")) == tuple(ALLOWED)


@pytest.mark.parametrize("fixture", ["jemalloc_path", "tcmalloc_path"])
def test_allocator_preload_is_mapped(tmp_path: Path, fixture: str, request: pytest.FixtureRequest) -> None:
    library = request.getfixturevalue(fixture)
    code = "import sys; sys.stdout.write(open('/proc/self/maps').read())"
    status, out, err = launch(tmp_path, [py(0, code, env={"LD_PRELOAD": library})])
    assert status == 0, err
    mapped = {line.split()[-1] for line in lines_of(out, 0) if line.count(b" ") >= 5}
    assert os.path.realpath(library).encode() in mapped


# ------------------------------------------------------------------------------------ statuses

@pytest.mark.parametrize("code, expected, text", [
    ("import sys; sys.exit(3)", 3, "exit 3"),
    ("import os; os.kill(os.getpid(), 11)", 139, "killed by SIGSEGV"),
    ("import os; os.kill(os.getpid(), 9)", 137, "killed by SIGKILL"),
])
def test_failure_status_propagates_and_stops_the_others(tmp_path: Path, code: str, expected: int,
                                                         text: str) -> None:
    sleeper = "import time; print('up', flush=True); time.sleep(60); print('not stopped')"
    failing = "import time; time.sleep(0.3); " + code
    started = time.monotonic()
    status, out, err = launch(tmp_path, [py(0, sleeper), py(1, failing)], grace_period=2.0)
    assert status == expected, err
    assert time.monotonic() - started < 30
    assert b"not stopped" not in out
    assert text in err
    assert "killed by SIGTERM" in err  # instance 0, stopped by xlaunch


def test_keep_going_waits_for_all_and_returns_the_first_failure(tmp_path: Path) -> None:
    instances = [
        py(0, "import sys; sys.exit(5)"),
        py(1, "import sys, time; time.sleep(0.8); print('finished'); sys.exit(7)"),
        py(2, "import time; time.sleep(0.4); print('done')"),
    ]
    status, out, err = launch(tmp_path, instances, keep_going=True)
    assert status == 5, err
    assert lines_of(out, 1) == [b"finished"]
    assert lines_of(out, 2) == [b"done"]
    assert "exit 7" in err and "exit 5" in err


def test_fail_fast_is_the_default(tmp_path: Path) -> None:
    instances = [py(0, "import sys; sys.exit(5)"),
                 py(1, "import time; time.sleep(20); print('finished')")]
    status, out, err = launch(tmp_path, instances, grace_period=1.0)
    assert status == 5
    assert lines_of(out, 1) == []


def test_missing_program_is_127_and_stops_the_others(tmp_path: Path) -> None:
    instances = [py(0, "import time; time.sleep(20)"), instance(1, ["/nonexistent/program"])]
    status, out, err = launch(tmp_path, instances, grace_period=1.0)
    assert status == 127
    assert "/nonexistent/program: command not found" in err



def test_a_script_whose_interpreter_is_missing_says_so_not_command_not_found(tmp_path: Path) -> None:
    """The script is there; the interpreter its #! line names is not: "command not found" named the script."""
    script = tmp_path / "bad.sh"
    script.write_text("#!/nonexistent/interpreter\necho hi\n")
    script.chmod(0o755)
    status, _, err = launch(tmp_path, [instance(0, [str(script)])], grace_period=1.0)
    assert status == 127
    assert f"{script}: its interpreter (the #! line) was not found ('/nonexistent/interpreter')" in err


def test_a_script_with_windows_line_ends_says_so(tmp_path: Path) -> None:
    """``#!/bin/sh\\r``: /bin/sh is there, the kernel looks for '/bin/sh\\r'; "interpreter not found" alone
    left the user looking at a /bin/sh that exists."""
    script = tmp_path / "crlf.sh"
    script.write_bytes(b"#!/bin/sh\r\necho hi\r\n")
    script.chmod(0o755)
    status, _, err = launch(tmp_path, [instance(0, [str(script)])], grace_period=1.0)
    assert status == 127
    assert f"{script}: its interpreter (the #! line) was not found ('/bin/sh\\r': the file has Windows line " \
           "ends, \\r\\n)" in err, err

def test_success_and_summary(tmp_path: Path) -> None:
    status, out, err = launch(tmp_path, [instance(0, ["true"]), instance(1, ["true"])])
    assert status == 0
    lines = [line for line in err.splitlines() if line.startswith("xlaunch: ")]
    assert lines[0] == "xlaunch: starting 2 instances on 2 CPUs: allocator default, OpenMP gnu"
    summary = lines[1:]
    assert summary[0].split()[1:] == ["instance", "cpus", "status", "wall"]
    assert summary[1].split()[1:4] == ["0", str(ALLOWED[0]), "exit"]
    assert summary[-1] == "xlaunch: exit status 0"
    status, out, err = launch(tmp_path, [instance(0, ["true"])], quiet=True)
    assert status == 0 and err == ""


# ------------------------------------------------------------------------------------ signals

def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Processes still alive (zombies count as alive) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running()]
        time.sleep(0.05)
    return alive


# instance: starts two sleeping grandchildren, optionally ignores the forwarded signals, says ready
TREE = """
import signal, subprocess, sys, time
if sys.argv[1] == 'stubborn':
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])
subprocess.Popen(['sleep', '300'])
print('ready', flush=True)
time.sleep(300)
"""


def _wait_ready(proc: subprocess.Popen, count: int) -> None:
    assert proc.stdout is not None
    for _ in range(count):
        line = proc.stdout.readline()
        assert b"ready" in line, line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_launcher_leaves_no_process_behind(tmp_path: Path, sig: int) -> None:
    instances = [py(0, TREE, "polite"), py(1, TREE, "stubborn")]
    proc = start_launcher(tmp_path, instances, grace_period=1.0, log_dir=str(tmp_path / "logs"))
    _wait_ready(proc, 2)
    tree = _descendants(proc.pid)
    assert len(tree) >= 6  # 2 instances x (itself + 2 grandchildren)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err.decode()
    assert _gone(tree, 5.0) == []
    launcher_log = (tmp_path / "logs" / "xlaunch_launcher.log").read_text()
    assert f"received {signal.Signals(sig).name}" in launcher_log
    assert "grace period over, SIGKILL" in launcher_log  # the stubborn instance needed it


def test_sigkill_to_launcher_terminates_instances(tmp_path: Path) -> None:
    code = "import time; print('ready', flush=True); time.sleep(300)"
    proc = start_launcher(tmp_path, [py(0, code), py(1, code)])
    _wait_ready(proc, 2)
    instances = _descendants(proc.pid)
    proc.kill()
    proc.communicate(timeout=10)
    alive = [p for p in _gone(instances, 5.0) if p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_orphans_of_a_finished_instance_are_stopped(tmp_path: Path) -> None:
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(300)']); print(p.pid, flush=True)")
    started = time.monotonic()
    status, out, err = launch(tmp_path, [py(0, code)], grace_period=1.0)
    assert status == 0, err
    orphan = int(lines_of(out, 0)[0])
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - started < 20


# ------------------------------------------------------------------------------------ output

def test_two_instances_50000_lines_each_every_line_once(tmp_path: Path) -> None:
    count = 50_000
    code = ("import sys\nw = sys.stdout.write\nfor n in range(%d): w(f'{sys.argv[1]} line {n}\\n')\n"
            "sys.stdout.flush(); sys.stderr.write(sys.argv[1] + ' stderr line\\n')" % count)
    instances = [py(i, code, f"inst{i}") for i in range(2)]
    status, out, err = launch(tmp_path, instances, log_dir=str(tmp_path / "logs"), log_file_prefix="run")
    assert status == 0, err
    all_lines = out.split(b"\n")
    assert all_lines[-1] == b""
    assert all(line.startswith((b"[0] ", b"[1] ")) for line in all_lines[:-1])
    for i in range(2):
        expected = [f"inst{i} line {n}".encode() for n in range(count)] + [f"inst{i} stderr line".encode()]
        assert lines_of(out, i) == expected
        log = (tmp_path / "logs" / f"run_instance_{i}.log").read_bytes()
        assert log.split(b"\n")[:-1] == expected
    launcher_log = (tmp_path / "logs" / "run_launcher.log").read_text()
    assert "instance 0 started" in launcher_log and "exit status 0" in launcher_log


def test_odd_output_partial_binary_and_long_lines(tmp_path: Path) -> None:
    long_line = b"x" * (3 << 20)
    # os.write until done: under PYTHONUNBUFFERED=1 sys.stdout.buffer is the raw file, whose write may
    # stop short when a signal (a profiler's ptrace stop) interrupts it, and the rest was never written
    code = ("import os, time\ndef w(data):\n    view = memoryview(data)\n    while view: view = view[os.write(1, view):]\n"
            "w(b'half'); time.sleep(0.2)\n"
            "w(b' line\\n\\xff\\xfe binary \\x00 bytes\\n'); w(b'x' * (3 << 20) + b'\\n')\n"
            "w(b'no newline at end')")
    status, out, err = launch(tmp_path, [py(0, code)], log_dir=str(tmp_path))
    assert status == 0, err
    got = lines_of(out, 0)
    assert got[0] == b"half line"
    assert got[1] == b"\xff\xfe binary \x00 bytes"
    assert b"".join(got[2:-1]) == long_line  # cut into bounded pieces on the console
    assert all(len(piece) <= 1 << 20 for piece in got[2:-1])
    assert got[-1] == b"no newline at end"
    assert out.endswith(b"no newline at end\n")
    log = (tmp_path / "xlaunch_instance_0.log").read_bytes()
    assert log == b"half line\n\xff\xfe binary \x00 bytes\n" + long_line + b"\nno newline at end"


def test_arguments_arrive_intact(tmp_path: Path) -> None:
    args = ["hello world", "$HOME", "a'b\"c", "*", "", "`id`", "; echo hacked"]
    code = "import json, sys; print(json.dumps(sys.argv[1:]))"
    status, out, err = launch(tmp_path, [py(0, code, *args), instance(1, ["printf", "%s|", *args])])
    assert status == 0, err
    assert json.loads(lines_of(out, 0)[0]) == args
    assert lines_of(out, 1) == ["|".join(args).encode() + b"|"]


def test_environment_is_exactly_the_instance_env(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XLAUNCH_INSTANCE_INDEX": "0", "ODD": "$HOME x"}
    inst = Instance(index=0, cpus=(ALLOWED[0],), mem_nodes=(0,), env=env, argv=("env",))
    status, out, err = launch(tmp_path, [inst])
    assert status == 0, err
    assert sorted(lines_of(out, 0)) == sorted(f"{k}={v}".encode() for k, v in env.items())


def test_launcher_under_taskset_runs_its_instance_inside_that_cpu() -> None:
    """``taskset -c <cpu> xlaunch ...``: the plan and the running instance stay on that CPU."""
    import shutil

    taskset = shutil.which("taskset")
    if taskset is None:
        pytest.skip("taskset not installed")
    cpu = ALLOWED[-1]
    result = subprocess.run([taskset, "-c", str(cpu), PY, "-m", "xlaunch", "-q", "--no-python",
                             "cat", "/proc/self/status"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    allowed = [line.split(":", 1)[1].strip() for line in result.stdout.splitlines()
               if line.startswith("[0] Cpus_allowed_list:")]
    assert allowed == [str(cpu)]


# calls the preloaded OpenMP once (it registers this process in /dev/shm), says where, then kills itself
KILLED_OPENMP_PROGRAM = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).omp_get_max_threads()
path = f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_{os.getuid()}"
print("registration", path, os.path.exists(path), flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_an_instance_killed_leaves_no_openmp_registration_in_dev_shm(tmp_path: Path, how: str, iomp_path) -> None:
    """Intel's OpenMP (which xlaunch preloads) removes its ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>``
    at a normal exit only: every instance ended by SIGTERM or SIGKILL left one (673 here in a day)."""
    program = tmp_path / "killed.py"
    program.write_text(KILLED_OPENMP_PROGRAM)
    done = subprocess.run([sys.executable, "-m", "xlaunch", "--ninstances", "1", "--omp-runtime", "intel",
                           str(program), how], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 128 + getattr(signal, how), done.stderr
    line = next(line for line in done.stdout.splitlines() if "registration" in line)
    path, registered = line.split()[-2:]
    assert registered == "True", line                   # the runtime did register: the test can fail
    assert not os.path.exists(path), f"{path} left behind"


def test_only_a_dead_processes_openmp_registration_is_removed(tmp_path: Path) -> None:
    """A live pid's file, another text, or a link is never removed."""
    from xlaunch.launcher.run.child import OPENMP_REGISTRATION, remove_openmp_registration

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    paths = [OPENMP_REGISTRATION.format(pid=pid, uid=os.getuid()) for pid in (alive.pid, dead.pid)]
    try:
        text = b"0x7f66cc252750-cafec3d3-libiomp5.so" + b" " * 989
        Path(paths[0]).write_bytes(text)
        assert not remove_openmp_registration(alive.pid) and os.path.exists(paths[0])
        Path(paths[1]).write_bytes(b"someone else's file")
        assert not remove_openmp_registration(dead.pid) and os.path.exists(paths[1])
        os.unlink(paths[1])
        (tmp_path / "target").write_bytes(text)
        os.symlink(tmp_path / "target", paths[1])
        assert not remove_openmp_registration(dead.pid) and os.path.islink(paths[1])
        os.unlink(paths[1])
        Path(paths[1]).write_bytes(text)
        assert remove_openmp_registration(dead.pid) and not os.path.exists(paths[1])
    finally:
        alive.kill()
        alive.wait()
        for path in paths:
            if os.path.lexists(path):
                os.unlink(path)
