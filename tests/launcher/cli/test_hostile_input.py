"""Hostile input (issue 23), each case a real ``xlaunch`` process: exit status 2, exactly one
stderr line naming the option, within a timeout (a FIFO must not hang it), in bounded memory,
nothing started (the program would create a marker file) and nothing written where it should
not be (the work directory is unchanged, a device node is still a device). The device is a
private copy of /dev/null made with mknod: a regression must not replace the real one."""
from __future__ import annotations

import gzip
import os
import resource
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FULLWIDTH_TWO, ARABIC_INDIC_ZERO, FULLWIDTH_ZERO = "\uff12", "\u0660", "\uff10"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hostile files, made once: a FIFO with no writer, 5,000 nested brackets, a 2 MiB config,
    a gzip archive of 600 MiB (in 600 one-MiB members: 600 KB on disk), and the program."""
    work = tmp_path_factory.mktemp("hostile")
    os.mkfifo(work / "fifo.toml")
    os.mkfifo(work / "fifo.tar.xz")
    try:
        os.mknod(work / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:           # not root: a FIFO stands in for the device
        os.mkfifo(work / "null")
    (work / "deep.toml").write_text("a = " + "[" * 5000 + "\n")
    (work / "big.toml").write_text("# padding\n" * 210_000)
    header = tarfile.TarInfo("sys/huge")
    header.size = 600 << 20
    zeros = gzip.compress(bytes(1 << 20), compresslevel=1)
    with open(work / "bomb.tar.gz", "wb") as out:
        out.write(gzip.compress(header.tobuf(format=tarfile.USTAR_FORMAT)))
        for _ in range(600):
            out.write(zeros)
    (work / "prog.py").write_text("open('started', 'a').write('x')\n")
    return work


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


CASES = [
    # id, argv, extra environment, option named, words in the message
    ("config-deep", ["--config", "deep.toml"], {}, "--config", "nested 33 deep"),
    ("config-dev-zero", ["--config", "/dev/zero"], {}, "--config", "character device, not a regular file"),
    ("config-fifo", ["--config", "fifo.toml"], {}, "--config", "FIFO, not a regular file"),
    ("config-2MiB", ["--config", "big.toml"], {}, "--config", "files over 1048576 bytes are not read"),
    ("summary-device", ["--summary-json", "null"], {}, "--summary-json", "not a regular file (never replaced)"),
    ("summary-fifo", ["--summary-json", "fifo.toml"], {}, "--summary-json", "FIFO"),
    ("summary-empty", ["--summary-json", ""], {}, "--summary-json", "empty path"),
    ("summary-proc", ["--summary-json", "/proc/x.json"], {}, "--summary-json", "cannot write '/proc/x.json'"),
    ("summary-sys", ["--summary-json", "/sys/x.json"], {}, "--summary-json", "cannot write '/sys/x.json'"),
    ("ninstances-underscore", ["--ninstances", "0_2"], {}, "--ninstances", "expected an integer, got '0_2'"),
    ("ncores-fullwidth", ["--ncores-per-instance", FULLWIDTH_TWO], {}, "--ncores-per-instance", "expected an integer"),
    ("grace-fullwidth", ["--grace-period", FULLWIDTH_TWO], {}, "--grace-period", "expected a number of seconds"),
    ("grace-underscore", ["--grace-period", "1_0"], {}, "--grace-period", "expected a number of seconds"),
    ("grace-nan", ["--grace-period", "nan"], {}, "--grace-period", "expected a number of seconds"),
    ("port-underscore", ["--nproc-per-node", "1", "--master-port", "29_500"], {}, "--master-port", "integer"),
    ("nnodes-fullwidth", ["--nproc-per-node", "1", "--nnodes", FULLWIDTH_TWO], {}, "--nnodes", "MIN:MAX"),
    ("local-rank-arabic-indic", ["--per-rank"], {"LOCAL_RANK": ARABIC_INDIC_ZERO, "LOCAL_WORLD_SIZE": "1"},
     "--per-rank", "is not a non-negative integer"),
    ("local-rank-fullwidth", ["--per-rank"], {"LOCAL_RANK": FULLWIDTH_ZERO, "LOCAL_WORLD_SIZE": "1"},
     "--per-rank", "is not a non-negative integer"),
    ("local-rank-underscore", ["--per-rank"], {"LOCAL_RANK": "0_1", "LOCAL_WORLD_SIZE": "2"},
     "--per-rank", "LOCAL_RANK='0_1' is not a non-negative integer"),
    ("world-size-fullwidth", ["--per-rank"], {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": FULLWIDTH_TWO},
     "--per-rank", "is not a positive integer"),
    ("slurm-trillion", ["--per-rank"], {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x1000000000000)"},
     "--per-rank", "is not a Slurm task count list"),
    ("slurm-node-beyond", ["--per-rank"], {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x100000000),1",
                                           "SLURM_NODEID": "100000001"}, "--per-rank", "100000001 nodes"),
    ("fsroot-bomb", ["--dry-run"], {"XLAUNCH_FSROOT": "bomb.tar.gz"}, "XLAUNCH_FSROOT", "expands to more than 128 MiB"),
    ("fsroot-fifo-archive", ["--dry-run"], {"XLAUNCH_FSROOT": "fifo.tar.xz"}, "XLAUNCH_FSROOT", "is not a directory"),
    ("python-as-program", ["--", "python"], {}, "PROGRAM", "drop 'python'"),
    ("program-fifo", ["--", "fifo.toml"], {}, "PROGRAM", "'fifo.toml' is not a regular file"),
    ("program-device", ["--", "null"], {}, "PROGRAM", "'null' is not a regular file"),
]


@pytest.mark.parametrize("argv, env, option, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_is_one_line_and_nothing_else(work: Path, argv: list[str], env: dict, option: str,
                                                    words: str) -> None:
    before = listing(work)
    environ = {k: v for k, v in os.environ.items() if k not in ("XLAUNCH_FSROOT", "LOCAL_RANK", "SLURM_LOCALID")}
    environ.update(env, XDG_CACHE_HOME=str(work / "cache"))

    def half_a_gib() -> None:     # decompressing the bomb into memory, or Slurm's list, would need more
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    program = [] if "--" in argv else ["prog.py"]
    result = subprocess.run([sys.executable, "-m", "xlaunch", *argv, *program], capture_output=True, text=True,
                            cwd=work, env=environ, timeout=60, preexec_fn=half_a_gib)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"xlaunch: error: {option}: ") and words in lines[0], lines[0]
    assert result.stdout == ""
    cache = work / "cache"
    assert listing(work) == before or set(listing(work)) - set(before) <= {"cache", "cache/xlaunch",
                                                                           "cache/xlaunch/machines"}
    assert not cache.exists() or not any((cache / "xlaunch" / "machines").iterdir())   # nothing half-unpacked
    assert not stat.S_ISREG(os.stat(work / "null").st_mode) and stat.S_ISFIFO(os.stat(work / "fifo.toml").st_mode)


def test_programs_named_like_options_run_as_files(work: Path, tmp_path: Path) -> None:
    """``xlaunch -- -weird.py`` ran ``python -u -weird.py`` ("Unknown option"); a file named ``-``
    ran whatever came on stdin."""
    (tmp_path / "-weird.py").write_text("print('weird ran')\n")
    (tmp_path / "-").write_text("print('dash file ran')\n")
    weird = subprocess.run([sys.executable, "-m", "xlaunch", "-q", "--", "-weird.py"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=60)
    dash = subprocess.run([sys.executable, "-m", "xlaunch", "-q", "--", "-"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, input="print('stdin ran')\n")
    assert (weird.returncode, weird.stdout, weird.stderr) == (0, "[0] weird ran\n", "")
    assert (dash.returncode, dash.stdout, dash.stderr) == (0, "[0] dash file ran\n", "")


def test_summary_json_may_go_in_the_log_dir_it_creates(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "xlaunch", "-q", "--log-dir", "logs", "--summary-json",
                             "logs/summary.json", "--no-python", "true"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert '"exit_status": 0' in (tmp_path / "logs" / "summary.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]          # no stray temporary file


@pytest.mark.parametrize("on_path", [True, False], ids=["on-path", "not-on-path"])
def test_an_interpreter_as_program_is_told_to_go_whether_or_not_path_has_it(tmp_path: Path, on_path: bool) -> None:
    """``xlaunch python3 app.py``: drop it; --no-python is offered only where PATH has one (a Debian user's
    PATH has python3 and no python: that once gave "no such file 'python'" and nothing more)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    if on_path:
        (folder / "python3").symlink_to(sys.executable)
    (tmp_path / "app.py").write_text("open('ran', 'w')\n")
    result = subprocess.run([sys.executable, "-m", "xlaunch", "python3", "app.py"], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PATH": str(folder)}, timeout=60)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("xlaunch: error: PROGRAM: no such file 'python3' (xlaunch runs a Python PROGRAM "
                                    "with its own interpreter: drop 'python3'"), result.stderr
    assert ("--no-python" in result.stderr) == on_path, result.stderr
    assert not (tmp_path / "ran").exists()
