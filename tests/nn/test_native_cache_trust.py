"""The build cache of the compiled kernels as another user or a damaged disk could leave it: a library
another user could have planted is never loaded, a truncated one or another library under its name is
one warning and the pure-torch paths (never SIGBUS, never an empty operator namespace)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from xlaunch._native_build import incomplete  # noqa: E402
from xlaunch.nn import native  # noqa: E402
from xlaunch.userfiles import untrusted  # noqa: E402

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[2]
PLANTED = '__attribute__((constructor)) static void planted(void) { remove("%s"); }\n#include <stdio.h>\n'
CHILD = """
import warnings
from xlaunch.nn import native
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    print("ops", native.ops())
for warning in said:
    print("warned", warning.message)
"""


def _level() -> str:
    level = native.LIBRARY.level()
    if level is None:
        pytest.skip("no compiled level for this CPU (not x86-64)")
    return level


def _child(build_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, native.BUILD_DIR_ENV: str(build_dir), "PYTHONPATH": str(REPO)}
    env.pop(native.DISABLE_ENV, None)
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)


def _planted_library(tmp_path: Path, marker: Path) -> bytes:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % marker)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "planted.so"), str(source)], check=True)
    return (tmp_path / "planted.so").read_bytes()


def test_a_library_in_a_folder_others_may_write_is_never_loaded(tmp_path):
    level = _level()
    marker = tmp_path / "still-here"
    marker.write_text("removed by the planted library's constructor if it is ever loaded")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / native.LIBRARY.file_name(level)).write_bytes(_planted_library(tmp_path, marker))
    shared.chmod(0o777)                                   # as XDG_CACHE_HOME under /tmp/everyone
    done = _child(shared)
    assert done.returncode == 0, done.stderr
    assert marker.exists(), "the planted library was loaded"
    assert "ops None" in done.stdout
    warned = [line for line in done.stdout.splitlines() if line.startswith("warned")]
    assert len(warned) == 1 and "another user could have put them there" in warned[0], done.stdout
    assert f"{shared} is owned by uid {os.geteuid()} with mode 777" in warned[0]


def test_a_truncated_library_or_another_one_under_its_name_is_one_warning(tmp_path):
    level = _level()
    built = native.LIBRARY.find(level)
    if built is None:
        pytest.skip("xlaunch.nn's kernels are not built (python -m xlaunch.nn.native)")
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / built.name
    target.write_bytes(built.read_bytes()[:5000])          # a copy cut short (a full disk)
    assert incomplete(target) == "truncated (5000 bytes)" and incomplete(built) is None
    done = _child(cache)
    assert done.returncode == 0, (done.returncode, done.stderr)          # was SIGBUS: exit -7
    assert "ops None" in done.stdout and "do not load (truncated (5000 bytes))" in done.stdout, done.stdout
    target.write_bytes(_planted_library(tmp_path, tmp_path / "unused"))     # a whole library, not this one
    done = _child(cache)
    assert done.returncode == 0, done.stderr
    assert "ops None" in done.stdout and f"it is not the {level} library" in done.stdout, done.stdout


def test_build_refuses_a_folder_others_may_write(monkeypatch, tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(folder))
    with pytest.raises(RuntimeError, match="refusing to build into .*another user could replace"):
        native.LIBRARY.build(echo=lambda line: None, levels=native.LEVELS[:1], force=True)
    assert os.listdir(folder) == []


def test_untrusted_names_what_another_user_could_write(tmp_path):
    folder = tmp_path / "lib"
    folder.mkdir(mode=0o755)
    library = folder / "x.so"
    library.write_bytes(b"\x7fELF")
    library.chmod(0o755)
    assert untrusted(str(library)) is None
    library.chmod(0o757)
    assert untrusted(str(library)) == f"{library} is owned by uid {os.geteuid()} with mode 757"
    library.chmod(0o755)
    folder.chmod(0o1777)                                      # sticky, as /tmp: others cannot replace x.so
    assert untrusted(str(library)) is None
    folder.chmod(0o777)
    assert "its folder" in untrusted(str(library))
    folder.chmod(0o755)
    (folder / "link.so").symlink_to(library)
    assert "a symlink" in untrusted(str(folder / "link.so"))
    if os.geteuid() == 0:
        os.chown(library, 65534, 65534)
        assert untrusted(str(library)) == f"{library} is owned by uid 65534 with mode 755"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755


def test_the_cache_keeps_recent_builds_and_drops_old_keys_and_killed_builds_scratch(tmp_path) -> None:
    """Each source or torch change built a new key beside the old ones (80 libraries here), and a build killed
    before its clean-up left its scratch (775 MB of objects here): a build removes both, never the current
    key's library, a recent build's scratch, a link, or another library's files."""
    import time

    from xlaunch._native_build import KEPT_BUILDS, STALE_SCRATCH_S, tidy_cache

    now = time.time()

    def made(name: str, age: float, size: int = 10) -> Path:
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age, now - age))
        return path

    current = made("ops-avx2-" + "c" * 16 + ".so", 10 * 86400)       # the oldest of all, and still kept
    old = [made(f"ops-avx2-{i:016x}.so", i * 3600) for i in range(1, 7)]   # newest first
    other_level = made("ops-baseline-" + "b" * 16 + ".so", 30 * 86400)
    other_library = made("nn-avx2-" + "d" * 16 + ".so", 30 * 86400)
    (tmp_path / ("ops-avx2-" + "e" * 16 + ".so")).symlink_to(old[-1])
    killed, running = tmp_path / ".build-killed", tmp_path / ".build-running"
    for scratch, age in ((killed, STALE_SCRATCH_S + 60), (running, 60)):
        (scratch / "avx2").mkdir(parents=True)
        (scratch / "avx2" / "a.o").write_bytes(b"o" * 1000)
        for folder in (scratch / "avx2", scratch):
            os.utime(folder, (now - age, now - age))
    removed, freed = tidy_cache(tmp_path, "ops", [current.name])
    left = sorted(p.name for p in tmp_path.iterdir())
    kept_old = [p.name for p in old[:KEPT_BUILDS - 1]]
    assert left == sorted([current.name, *kept_old, other_level.name, other_library.name,
                           "ops-avx2-" + "e" * 16 + ".so", ".build-running"])
    assert removed == len(old) - len(kept_old) + 1 and freed == 10 * (len(old) - len(kept_old)) + 1000
