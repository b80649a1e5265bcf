"""Adversarial input: every case is exit 2, one stderr line naming the option, nothing started,
nothing left behind; parsing stays within bounded memory; logs are never clobbered or followed."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import xlaunch_here  # noqa: F401  (a fixture)
from machine_trees import machine_tree

REPO = Path(__file__).resolve().parents[3]


def xlaunch(*argv: str, env: dict | None = None, memory_limit: int | None = None, cwd=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "XLAUNCH_FSROOT"}
    environ.update(env or {})

    def limit() -> None:
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    return subprocess.run([sys.executable, "-m", "xlaunch", *argv], capture_output=True, text=True, env=environ,
                          cwd=cwd or REPO, timeout=60, preexec_fn=limit)


def one_line_error(result: subprocess.CompletedProcess, option: str) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"xlaunch: error: {option}: "), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


HUGE = [                    # an error names the option as typed (--core-list), not its canonical name
    (["--core-list", "0-1000000000000"], "--core-list"),
    (["--cores-list", "5-99999999999999999999"], "--cores-list"),
    (["--node-id", "0-1000000000000"], "--node-id"),
    (["--nodes-list", "0-1000000000:1"], "--nodes-list"),
    (["--ninstances", "2", "--instance-idx", "0-1000000000000"], "--instance-idx"),
]


@pytest.mark.parametrize("argv, option", HUGE, ids=[" ".join(a) for a, _ in HUGE])
def test_huge_lists_are_refused_in_bounded_memory(argv, option, marker_script) -> None:
    script, marker = marker_script
    # 1 GiB of address space: expanding any of these lists would need far more
    result = xlaunch("--dry-run", *argv, str(script), memory_limit=1 << 30)
    assert "larger than any CPU or node number" in one_line_error(result, option)


@pytest.mark.parametrize("value", ["²", "١", "٣-٤", "0-³", "𝟙"])
def test_non_ascii_digits_are_malformed(value, marker_script, xlaunch_here) -> None:
    script, marker = marker_script
    assert "malformed" in one_line_error(xlaunch_here("--core-list", value, str(script)), "--core-list")
    assert "integer" in one_line_error(xlaunch_here("--ninstances", value, str(script)), "--ninstances")
    assert not marker.exists()


@pytest.mark.parametrize("log_dir", ["/proc/xlaunch-test", "/sys/xlaunch-test", "/proc/self/status/x"])
def test_unwritable_log_dirs(log_dir, marker_script) -> None:
    script, marker = marker_script
    one_line_error(xlaunch("--log-dir", log_dir, str(script)), "--log-dir")
    assert not marker.exists()


def test_a_plan_with_warnings_still_refuses_a_bad_log_dir_in_one_line(tmp_path, marker_script) -> None:
    """The plan's warnings (here a kept variable; in a container, its CPU quota) and the options' notes
    wait for the log files: the refused --log-dir is the only line, and a good one shows them."""
    script, marker = marker_script
    (tmp_path / "logs" / "xlaunch_instance_0.log").mkdir(parents=True)
    kept = {"OMP_NUM_THREADS": "999"}         # planned whatever the OpenMP runtime: kept, with a warning
    line = one_line_error(xlaunch("--log-dir", str(tmp_path / "logs"), str(script), env=kept), "--log-dir")
    assert "is a directory" in line and not marker.exists()
    done = xlaunch("--log-dir", str(tmp_path / "fine"), str(script), env=kept)
    assert done.returncode == 0 and marker.exists(), done.stderr
    warning = "xlaunch: warning: kept your OMP_NUM_THREADS=999 (xlaunch did not override it)"
    lines = done.stderr.splitlines()
    assert warning in lines and lines.index(warning) < next(i for i, t in enumerate(lines) if "starting" in t)
    assert "plan warning: kept your OMP_NUM_THREADS=999" in (tmp_path / "fine" / "xlaunch_launcher.log").read_text()


def test_log_file_path_that_is_a_directory(tmp_path, marker_script) -> None:
    script, marker = marker_script
    (tmp_path / "logs" / "xlaunch_instance_0.log").mkdir(parents=True)
    line = one_line_error(xlaunch("--log-dir", str(tmp_path / "logs"), str(script)), "--log-dir")
    assert "is a directory" in line
    assert not marker.exists()


def test_too_long_prefix_refused_before_the_log_dir_is_created(tmp_path, marker_script) -> None:
    script, marker = marker_script
    logs = tmp_path / "new" / "logs"
    one_line_error(xlaunch("--log-dir", str(logs), "--log-file-prefix", "p" * 250, str(script)), "--log-file-prefix")
    assert not (tmp_path / "new").exists()
    assert not marker.exists()


def test_log_dir_created_then_refused_is_removed_again(tmp_path) -> None:
    """A failure after creating the directories (here: the launcher log's path is a directory)
    leaves no directory this run created."""
    from xlaunch.launcher.errors import OptionError
    from xlaunch.launcher.run.logfiles import open_log_files

    with pytest.raises(OptionError, match="is a directory"):
        # the launcher log is opened last; make its path a directory inside a fresh tree
        target = tmp_path / "a" / "b"
        real_mkdir = os.mkdir

        def mkdir_then_plant(path, mode=0o777):
            real_mkdir(path, mode)
            if Path(path) == target:
                (target / "x_launcher.log").mkdir()

        os.mkdir = mkdir_then_plant
        try:
            open_log_files(str(target), "x", [0, 1])
        finally:
            os.mkdir = real_mkdir
    assert not (tmp_path / "a" / "b" / "x_instance_0.log").exists()
    # a/b held the planted directory, so it stays; nothing else was left behind
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["x_launcher.log"]


def test_log_files_never_follow_symlinks_and_keep_earlier_logs(tmp_path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, logs / "xlaunch_instance_0.log")
    (logs / "xlaunch_launcher.log").write_text("earlier run\n")
    result = xlaunch("--log-dir", str(logs), "--no-python", "echo", "hello")
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious\n"                         # not truncated, not written
    assert (logs / "xlaunch_instance_0.log").read_text() == "hello\n"  # a new regular file
    assert not (logs / "xlaunch_instance_0.log").is_symlink()
    kept = sorted(p.name for p in logs.iterdir() if ".log." in p.name)
    assert len(kept) == 2, kept
    assert any((logs / k).is_symlink() for k in kept)                  # the link itself moved aside
    assert "earlier run\n" in [(logs / k).read_text() for k in kept if not (logs / k).is_symlink()]
    assert "earlier logs kept as" in result.stderr


def test_empty_or_nonsense_fsroot_is_refused(tmp_path, marker_script, xlaunch_here) -> None:
    script, marker = marker_script
    (tmp_path / "nonsense" / "etc").mkdir(parents=True)
    (tmp_path / "nonsense" / "etc" / "motd").write_text("hi\n")
    (tmp_path / "empty-cpu-dir" / "sys" / "devices" / "system" / "cpu").mkdir(parents=True)
    for root in ("empty", "nonsense", "empty-cpu-dir"):
        (tmp_path / root).mkdir(exist_ok=True)
        for flag in ("--dry-run", "--show-topology"):
            args = [flag, str(script)] if flag == "--dry-run" else [flag]
            result = xlaunch_here(*args, env={"XLAUNCH_FSROOT": str(tmp_path / root)})
            assert "not a recorded machine" in one_line_error(result, "XLAUNCH_FSROOT") or "lists no CPUs" in result.stderr


def test_dry_run_json_prints_no_inherited_secrets(marker_script) -> None:
    script, _marker = marker_script
    secret = "hunter2-do-not-print"
    # a recorded machine: the plan's shape must not depend on how many CPUs this process may use
    result = xlaunch("--dry-run", "--json", "--ninstances", "2", "--ncores-per-instance", "1", str(script),
                     env={"AWS_SECRET_ACCESS_KEY": secret, "OMP_NUM_THREADS": "", "LD_PRELOAD": "",
                          "XLAUNCH_FSROOT": str(machine_tree("xeon-2s-amx"))})
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout
    plan = json.loads(result.stdout)
    for instance in plan["instances"]:
        assert "AWS_SECRET_ACCESS_KEY" not in instance["env"]
        assert instance["env"]["XLAUNCH_INSTANCE_INDEX"] == str(instance["index"])


def test_argv_too_long_for_the_instance_is_an_input_error(tmp_path, marker_script) -> None:
    """Fits xlaunch's own exec, but not the instance's once xlaunch adds its variables."""
    script, marker = marker_script
    limit = os.sysconf("SC_ARG_MAX")
    env = {k: v for k, v in os.environ.items() if k != "XLAUNCH_FSROOT"}
    size = lambda s: len(s.encode()) + 1 + 8          # the string, its NUL, its pointer
    argv = [sys.executable, "-m", "xlaunch", str(script)]
    used = sum(size(a) for a in argv) + sum(size(f"{k}={v}") for k, v in env.items()) + 16
    room = limit - used - 200    # xlaunch's own exec fits with 200 bytes to spare; it adds more than that
    chunk = "a" * 60000
    args = [chunk] * (room // size(chunk))
    args.append("b" * (room - sum(size(a) for a in args) - 9))
    result = xlaunch(str(script), *args)
    assert "ARGS" in result.stderr and "exec allows" in one_line_error(result, "ARGS")
    assert not marker.exists()


def test_missing_submodule_is_refused_and_present_one_is_found(tmp_path, marker_script) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "tool.py").write_text("print('tool ran')\n")
    assert "no module named 'pkg.missing_sub'" in one_line_error(xlaunch("-m", "pkg.missing_sub", cwd=tmp_path), "PROGRAM")
    assert "no module named 'pkg.sub.nope'" in one_line_error(xlaunch("-m", "pkg.sub.nope", cwd=tmp_path), "PROGRAM")
    assert "not a package" in one_line_error(xlaunch("-m", "pkg.sub.tool.x", cwd=tmp_path), "PROGRAM")
    done = xlaunch("-q", "-m", "pkg.sub.tool", cwd=tmp_path)
    assert done.returncode == 0 and "tool ran" in done.stdout, done.stderr
    # namespace packages (no __init__.py) are followed too
    (tmp_path / "ns" / "inner").mkdir(parents=True)
    (tmp_path / "ns" / "inner" / "mod.py").write_text("print('ns ran')\n")
    done = xlaunch("-q", "-m", "ns.inner.mod", cwd=tmp_path)
    assert done.returncode == 0 and "ns ran" in done.stdout, done.stderr


def test_summary_json_path_checked_before_start(tmp_path, marker_script, xlaunch_here) -> None:
    script, marker = marker_script
    one_line_error(xlaunch_here("--summary-json", str(tmp_path / "nodir" / "s.json"), str(script)), "--summary-json")
    one_line_error(xlaunch_here("--summary-json", str(tmp_path), str(script)), "--summary-json")
    assert not marker.exists()


def _without_dac_override() -> None:
    """In the child, before exec: root loses the capabilities that let it read any file
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so mode 000 means unreadable, as for any user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:          # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_program_is_refused_before_anything_starts(marker_script) -> None:
    """chmod 000: refused with exit 2 and one line naming the file and why, nothing started. Root
    reads any file (and so would root's instances: it is not refused then), so as root the check
    runs without the capabilities that allow it."""
    script, marker = marker_script
    script.chmod(0o000)
    environ = {k: v for k, v in os.environ.items() if k != "XLAUNCH_FSROOT"}
    try:
        result = subprocess.run([sys.executable, "-m", "xlaunch", str(script)], capture_output=True, text=True,
                                env=environ, cwd=REPO, timeout=60,
                                preexec_fn=_without_dac_override if os.geteuid() == 0 else None)
    except subprocess.SubprocessError as error:
        pytest.skip(f"cannot drop root's file capabilities here ({error})")
    line = one_line_error(result, "PROGRAM")
    assert line == f"xlaunch: error: PROGRAM: cannot read {str(script)!r}: permission denied"
    assert not marker.exists()
    if os.geteuid() == 0:       # root with its capabilities reads it, and runs it
        assert xlaunch(str(script)).returncode == 0 and marker.exists()


def test_recorded_tree_plans_but_never_runs(marker_script) -> None:
    script, marker = marker_script
    result = xlaunch(str(script), env={"XLAUNCH_FSROOT": str(machine_tree("xeon-2s-amx"))})
    assert "add --dry-run" in one_line_error(result, "XLAUNCH_FSROOT")
    assert not marker.exists()


def test_a_binary_or_another_interpreters_script_without_no_python_is_refused(tmp_path) -> None:
    """Python was handed an ELF binary (SyntaxError: Non-UTF-8 code ... in every instance) or a shell
    script: one line saying to add --no-python, nothing started. A #! naming Python (through env,
    with options) is a Python script; with --no-python the shell script runs."""
    marker = tmp_path / "ran"
    shell = tmp_path / "job.sh"
    shell.write_text(f"#!/bin/sh\ntouch {marker}\n")
    shell.chmod(0o755)
    binary = os.path.realpath(sys.executable)
    assert open(binary, "rb").read(4) == b"\x7fELF"
    line = one_line_error(xlaunch("--dry-run", binary), "PROGRAM")
    assert line == (f"xlaunch: error: PROGRAM: {binary!r} is an executable binary (ELF), not a Python script: "
                    "add --no-python to run it")
    line = one_line_error(xlaunch(str(shell)), "PROGRAM")
    assert line.endswith("starts with #! naming 'sh', not Python: add --no-python to run it with its own interpreter")
    assert not marker.exists()
    env_shell = tmp_path / "env.sh"
    env_shell.write_text("#!/usr/bin/env -S LC_ALL=C bash -e\necho no\n")
    assert "naming 'bash'" in one_line_error(xlaunch("--dry-run", str(env_shell)), "PROGRAM")
    python = tmp_path / "tool.py"
    python.write_text("#!/usr/bin/env -S python3 -u\r\nprint('python ran')\n")
    ran = xlaunch("-q", "--ninstances", "1", str(python))
    assert ran.returncode == 0 and "python ran" in ran.stdout, ran.stderr
    ran = xlaunch("-q", "--ninstances", "1", "--no-python", str(shell))
    assert ran.returncode == 0 and marker.exists(), ran.stderr
