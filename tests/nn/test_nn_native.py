"""The compiled kernels: where they are built, when they are used, the fallback when they are
missing, and a child process running every kernel on two threads that exits cleanly."""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import require

torch = pytest.importorskip("torch")

from xlaunch import _isa_levels as isa  # noqa: E402
from xlaunch import _native_build  # noqa: E402
from xlaunch._native_build import SHARED_SOURCES  # noqa: E402
from xlaunch.nn import native  # noqa: E402
from xlaunch.llm import native as llm_native  # noqa: E402

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[2]


def test_the_library_is_keyed_by_its_sources_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(tmp_path / "builds"))
    path = native.library_path()
    assert path.parent == tmp_path / "builds" and path.name.startswith("xlaunch_nn_ops-") and path.suffix == ".so"
    monkeypatch.delenv(native.BUILD_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "xlaunch" / "nn"
    changed = tmp_path / "csrc"
    changed.mkdir()
    own = [name for name in (*native.SOURCES, *native.HEADERS) if name not in SHARED_SOURCES]
    for name in own:
        (changed / name).write_bytes((native.CSRC / name).read_bytes())
    monkeypatch.setattr(native.LIBRARY, "csrc", changed)
    same = native.build_key()
    (changed / native.SOURCES[0]).write_bytes((changed / native.SOURCES[0]).read_bytes() + b"\n// changed\n")
    assert native.build_key() != same
    assert len({native.build_key(level) for level in native.LEVELS}) == len(native.LEVELS)


def test_the_shared_source_is_one_file_in_both_libraries_keys(monkeypatch, tmp_path):
    from xlaunch.llm import native as llm_native

    for library in (native.LIBRARY, llm_native.LIBRARY):
        assert set(SHARED_SOURCES) <= set(library.sources())
        assert not any((library.csrc / name).exists() for name in SHARED_SOURCES), "a shared source has a twin"
    before = (native.build_key(), llm_native.LIBRARY.build_key())
    shared = tmp_path / "_csrc"
    shared.mkdir()
    for name in SHARED_SOURCES:
        (shared / name).write_bytes((_native_build.SHARED_CSRC / name).read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(_native_build, "SHARED_CSRC", shared)
    after = (native.build_key(), llm_native.LIBRARY.build_key())
    assert after[0] != before[0] and after[1] != before[1]


def test_the_key_holds_no_cpu_flags(monkeypatch):
    before = {level: native.build_key(level) for level in native.LEVELS}
    monkeypatch.setattr(isa, "_host", {"levels": isa.host_levels({"sse2"})})
    assert native.runnable_levels() == ("baseline",)
    assert {level: native.build_key(level) for level in native.LEVELS} == before


ZEN3 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 abm movbe".split()
SKX = [*ZEN3, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"]
SPR = [*SKX, "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]


@pytest.mark.parametrize("flags, levels", [
    (["sse2"], ("baseline",)), (ZEN3, ("baseline", "avx2")), (["avx512f", "avx512bw", "avx512vl", "avx512dq",
                                                             "avx512cd"], ("baseline",)),
    (SKX, ("baseline", "avx2", "avx512")), (SPR, isa.LEVELS), ([*SKX, "avx512_bf16"], ("baseline", "avx2", "avx512")),
    ([*SKX, "avx512_vnni"], ("baseline", "avx2", "avx512", "avx512_vnni")),   # Cascade Lake, Ice Lake
])
def test_the_levels_a_cpu_runs_need_every_level_below(flags, levels):
    assert isa.host_levels(flags) == levels


def test_the_cap_picks_a_level_and_says_what_is_wrong_in_one_line():
    assert isa.chosen_level(SPR, "") == "amx" and isa.chosen_level(ZEN3, "") == "avx2"
    assert isa.chosen_level(SPR, "AVX2") == "avx2"
    assert isa.library_level("amx", native.LEVELS) == "avx512"
    assert isa.library_level("avx512_bf16", ("baseline", "avx2", "avx512", "avx512_bf16")) == "avx512_bf16"
    assert isa.library_level("avx512_vnni", llm_native.LEVELS) == "avx512_vnni"
    assert isa.library_level("avx512_vnni", native.LEVELS) == "avx512"
    with pytest.raises(ValueError, match=r"^XLAUNCH_CPU_ISA=avx512: this CPU cannot execute it; it runs: baseline, "
                                         r"avx2$"):
        isa.chosen_level(ZEN3, "avx512")
    with pytest.raises(ValueError, match=r"^XLAUNCH_CPU_ISA=sse9: unknown ISA level; valid: baseline, avx2, avx512, "
                                         r"avx512_vnni, avx512_bf16, amx$"):
        isa.chosen_level(ZEN3, "sse9")


def test_the_cap_chooses_the_kernels_a_process_runs(monkeypatch):
    runnable = native.runnable_levels()
    for level in runnable:
        require(f"xlaunch.nn's compiled {level} kernels", str(native.library_path(level)) if native.available(level)
                else None)
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    monkeypatch.delenv(isa.CAP_ENV, raising=False)
    best = isa.chosen_level()
    assert native.level() == isa.library_level(best, native.LEVELS)
    assert native.ops().compiled_isa() == native.level()
    for level in runnable:
        monkeypatch.setenv(isa.CAP_ENV, level)
        assert native.level() == level and native.ops().compiled_isa() == level
    for level in set(native.LEVELS) - set(runnable):                  # never loaded here
        with pytest.raises(RuntimeError, match=f"cannot execute the {level} kernels"):
            native.ops_at(level)


def test_build_keeps_an_existing_build_and_refuses_a_symlinked_dir(monkeypatch, tmp_path):
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(tmp_path / "link"))
    with pytest.raises(RuntimeError, match="symlink"):
        native.build(echo=lambda line: None)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(real))
    whole_elf = Path(os.path.realpath(sys.executable)).read_bytes()     # a whole ELF file stands for a build
    for level in native.LEVELS:
        native.library_path(level).write_bytes(whole_elf)
    said = []
    assert native.build(echo=said.append) == native.library_path()          # nothing compiled
    assert said == [f"xlaunch.nn: native kernels already built at {', '.join(native.LEVELS)}: {real}"]


def test_missing_or_disabled_kernels_mean_the_torch_paths(monkeypatch, tmp_path):
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)                # the suite may run with it set
    monkeypatch.setattr(native.LIBRARY, "loaded_levels", {})
    monkeypatch.setattr(native.LIBRARY, "warned", False)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(tmp_path))              # nothing built there
    with pytest.warns(RuntimeWarning, match="native kernels not built here") as said:
        assert native.LIBRARY.ops() is None          # one xlaunch frame fewer than native.ops()
    assert said[0].filename == __file__, said[0]    # the warning points at the caller's line, not xlaunch's
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                     # said once per process
        assert native.ops() is None
    monkeypatch.setattr(native.LIBRARY, "loaded_levels", {})
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.ops() is None
    with native.prefer_native(False):
        assert native.ops() is None



def test_prefer_native_is_per_thread_and_interleaved_blocks_restore_their_own():
    """Thread A's prefer_native(False) never reaches thread B, and blocks of two threads that end in
    the opposite order leave each thread (and the process) as it was (a process-wide setting left
    every thread on the pure-torch path after both blocks, and B's level block on another level)."""
    import threading

    library, seen = native.LIBRARY, {}
    entered, chose, left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with native.prefer_native(False):
            entered.set()
            assert chose.wait(30)
            seen["first"] = library.preference
        left.set()

    def second() -> None:
        assert entered.wait(30)
        seen["before"] = library.preference
        with native.prefer_native(native.LEVELS[0]):
            chose.set()
            assert left.wait(30)
            seen["inside"] = library.preference
        seen["after"] = library.preference

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {"first": False, "before": None, "inside": native.LEVELS[0], "after": None}
    assert library.preference is None


CHILD = r"""
import torch, xlaunch.nn as xnn
from xlaunch.nn import native
assert native.ops() is not None
torch.set_num_threads(2)
torch.manual_seed(0)
tables = [torch.nn.EmbeddingBag(500, 16, mode="mean") for _ in range(4)]
merged = xnn.MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=0.1)
indices = [torch.randint(0, 500, (256 * 8,)) for _ in tables]
offsets = [torch.arange(0, 256 * 8, 8) for _ in tables]
for _ in range(3):
    out = merged(indices, offsets)
    xnn.interaction(torch.randn(256, 16), *out).sum().backward()
image = torch.randn(2, 32, 20, 20, requires_grad=True).contiguous(memory_format=torch.channels_last)
boxes = torch.tensor([[0, 1.0, 1.0, 15.0, 15.0], [1, 2.0, 3.0, 19.0, 12.0]] * 20)
xnn.roi_align(image, boxes, 7, 1.0, 0, True).sum().backward()
print("done", torch.get_num_threads())
"""


@pytest.mark.live
def test_a_child_running_the_kernels_on_two_threads_exits_cleanly():
    require("xlaunch.nn's compiled kernels (python -m xlaunch.nn.native)",
            str(native.library_path()) if native.available() else None)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", native.DISABLE_ENV)}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "done 2\n")


@pytest.mark.live
def test_the_dlrm_example_trains_under_xlaunch_auto_optimize():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", native.DISABLE_ENV)}
    done = subprocess.run([sys.executable, "-m", "xlaunch", "--ninstances", "1", "--ncore_per_instance", "1",
                           "--auto-optimize", str(REPO / "examples" / "dlrm.py"), "--steps", "16", "--tables", "6",
                           "--infer-steps", "2"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    train = next(line for line in done.stdout.splitlines() if "train:" in line)
    first, last = (float(word) for word in train.split("loss ")[1].split(" -> "))
    assert last < first - 0.05, train
    assert "infer:" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.live
def test_the_dlrm_example_refuses_bad_arguments_in_one_line():
    # --steps 0 was a TypeError traceback after the model was built, --bag 0 torch's "step must be
    # nonzero", --batch-size 0 a nan loss, --infer-steps 0 a made-up time per batch.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "dlrm.py"), "--steps", "0"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == "dlrm.py: error: argument --steps: must be a positive integer, not '0'"
    spec = importlib.util.spec_from_file_location("dlrm_example", REPO / "examples" / "dlrm.py")
    dlrm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dlrm)
    assert dlrm.positive("3") == 3 and dlrm.learning_rate("0.5") == 0.5
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
            dlrm.positive(bad)
    for bad in ("-0.1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number >= 0"):
            dlrm.learning_rate(bad)
