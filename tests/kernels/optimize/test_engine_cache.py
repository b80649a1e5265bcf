"""The engine cache: an entry written by one process is loaded by the next; two processes asking
for one entry at once build it once; a corrupt entry is rebuilt with a warning; entries are read
without following symlinks, from regular files only, within their declared sizes."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xlaunch.kernels.optimize.engines.cache import ENTRY, Cache, CorruptEntry, cache_dir

KEY = "0" * 40


def test_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    assert cache_dir({"XLAUNCH_CACHE_DIR": str(tmp_path / "c")}) == str(tmp_path / "c")
    assert cache_dir({"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}) == "/x/cache/xlaunch"
    assert cache_dir({"HOME": "/home/u"}) == "/home/u/.cache/xlaunch"


def test_an_entry_round_trips_and_a_second_writer_loses(tmp_path: Path) -> None:
    store = Cache(str(tmp_path))
    assert store.read(KEY) is None
    assert store.write(KEY, "onnxruntime", {"a": 1}, {"backend": "onnxruntime"}, {"model.onnx": b"bytes"})
    assert not store.write(KEY, "onnxruntime", {}, {}, {"model.onnx": b"other"})   # first one stays
    entry, files = store.read(KEY)
    assert entry["route"] == "onnxruntime" and entry["state"] == {"a": 1} and files == {"model.onnx": b"bytes"}
    assert sorted(p.name for p in Path(store.root).iterdir()) == [KEY]   # no temporary folder left
    assert oct(os.stat(store.path(KEY)).st_mode & 0o777) == "0o700"


def corrupt(store: Cache, how: str) -> None:
    path = Path(store.path(KEY))
    if how == "bytes":
        (path / "model.onnx").write_bytes(b"BYTES")
    elif how == "json":
        (path / ENTRY).write_text("{not json")
    elif how == "symlink_file":
        os.unlink(path / "model.onnx")
        (Path(store.root) / "elsewhere").write_bytes(b"bytes")
        os.symlink(Path(store.root) / "elsewhere", path / "model.onnx")
    elif how == "fifo":
        os.unlink(path / "model.onnx")
        os.mkfifo(path / "model.onnx")
    elif how == "oversize":
        entry = json.loads((path / ENTRY).read_text())
        entry["files"]["model.onnx"]["size"] = 1 << 40
        (path / ENTRY).write_text(json.dumps(entry))
    elif how == "bad_name":
        entry = json.loads((path / ENTRY).read_text())
        entry["files"] = {"../../etc/passwd": {"size": 1, "sha256": "x"}}
        (path / ENTRY).write_text(json.dumps(entry))
    elif how == "symlink_dir":
        real = Path(store.root) / "real"
        path.rename(real)
        os.symlink(real, path)


@pytest.mark.parametrize("how", ["bytes", "json", "symlink_file", "fifo", "oversize", "bad_name", "symlink_dir"])
def test_a_bad_entry_is_corrupt_never_followed(tmp_path: Path, how: str) -> None:
    store = Cache(str(tmp_path))
    store.write(KEY, "onnxruntime", {}, {}, {"model.onnx": b"bytes"})
    corrupt(store, how)
    with pytest.raises(CorruptEntry):
        store.read(KEY)
    store.remove(KEY)
    assert not os.path.lexists(store.path(KEY))
    if how == "symlink_dir":   # the link was removed, not what it pointed to
        assert (Path(store.root) / "real" / "model.onnx").read_bytes() == b"bytes"


CACHE_SCRIPT = r"""
import json, sys, warnings
import torch
from torch import nn
from xlaunch import optimize

def ask():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    x = torch.randn(6, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = optimize(model, sample_input=x, backend="onnxruntime", progress=False)
        with torch.no_grad():
            ok = all(torch.allclose(fast(v), model(v), atol=1e-5) for v in (x, torch.randn(3, 32)))
    return {"cache": fast.report.cache, "backend": fast.report.backend, "ok": ok,
            "warnings": [str(w.message) for w in caught], "path": fast.report.cache_path}

if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]))    # the test process's: the thread count is part of the key
    print(json.dumps(ask()))
"""


def ask_here() -> dict:
    """CACHE_SCRIPT's request, made in the test process (torch and onnxruntime are loaded here already)."""
    namespace: dict = {"__name__": "here"}
    exec(CACHE_SCRIPT, namespace)
    return namespace["ask"]()


def lock_is_held(cache: Path) -> bool:
    """Whether another process holds an entry's lock (a probe that gets it lets it go at once)."""
    import fcntl

    for path in cache.glob("engines/v*/*.lock"):
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def test_two_processes_asking_at_once_build_once_and_share_the_entry(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The other process builds; this one asks while it holds the entry's lock (seen from here), waits
    for it and loads what it wrote: one build for both."""
    pytest.importorskip("onnxruntime")
    import torch

    cache = tmp_path / "cache"
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(cache))
    other = subprocess.Popen([sys.executable, "-c", CACHE_SCRIPT, str(torch.get_num_threads())],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
                             cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 240
        while not lock_is_held(cache):
            assert other.poll() is None, f"it ended before this process saw its lock: {other.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the other process never took the entry's lock"
            time.sleep(0.01)
        here = ask_here()
        out, err = other.communicate(timeout=300)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert other.returncode == 0, err[-3000:]
    assert err == "", err[-3000:]                  # engines' and exporters' noise stays quiet
    other_result = json.loads(out.strip().splitlines()[-1])
    assert (other_result["cache"], here["cache"]) == ("miss", "hit"), (other_result, here)
    results = [other_result, here]
    assert all(r["ok"] and r["backend"] == "onnxruntime" and r["warnings"] == [] for r in results)
    entry_dir = Path(results[0]["path"])
    assert results[1]["path"] == str(entry_dir)
    root = entry_dir.parent
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [entry_dir.name]
    assert sorted(p.name for p in entry_dir.iterdir()) == ["entry.json", "model.onnx"]
    entry = json.loads((entry_dir / "entry.json").read_text())
    onnx = entry_dir / "model.onnx"
    assert entry["files"]["model.onnx"]["sha256"] == hashlib.sha256(onnx.read_bytes()).hexdigest()


class FileRoute:
    """A route whose artifact is the weights (torch.save bytes): the cache path of an engine,
    in-process (no engine threads). Counts its builds and loads."""

    cached_files = True
    needs: tuple = ()
    builds = loads = 0

    def __init__(self, name: str) -> None:
        self.name = name

    def missing(self):
        return None

    def _runner(self, model, data: bytes):
        import copy
        import io

        import torch

        copy_ = copy.deepcopy(model)
        copy_.load_state_dict(torch.load(io.BytesIO(data)))
        return copy_

    def build(self, model, sample, context):
        import io

        import torch

        from xlaunch.kernels.optimize.engines.base import Built

        type(self).builds += 1
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        return Built(self._runner(model, buffer.getvalue()), files={"weights.pt": buffer.getvalue()})

    def load(self, model, sample, context, files, state):
        from xlaunch.kernels.optimize.engines.base import Built

        type(self).loads += 1
        return Built(self._runner(model, files["weights.pt"]), files=files)


def _file_route_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(model, x, run): a small model whose onnxruntime route is :class:`FileRoute`, cached in ``tmp_path``;
    ``run()`` optimizes it again."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from xlaunch.kernels.optimize.engines import api
    from xlaunch.kernels.optimize.pipeline import optimize

    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(api, "ROUTES_BY_NAME", {**api.ROUTES_BY_NAME, "onnxruntime": FileRoute("onnxruntime")})
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval(), torch.randn(3, 8)
    return model, x, lambda: optimize(model, sample_input=x, backend="onnxruntime", progress=False)


def test_a_corrupt_entry_is_rebuilt_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from xlaunch.kernels.optimize.notes import OptimizeWarning

    model, x, run = _file_route_model(tmp_path, monkeypatch)
    torch = pytest.importorskip("torch")
    assert run().report.cache == "miss" and (FileRoute.builds, FileRoute.loads) == (1, 0)
    hit = run()
    assert hit.report.cache == "hit" and (FileRoute.builds, FileRoute.loads) == (1, 1)
    artifact = next(tmp_path.glob("engines/v*/*/weights.pt"))
    artifact.write_bytes(artifact.read_bytes()[:-7] + b"garbage")
    with pytest.warns(OptimizeWarning, match="is corrupt .*weights.pt does not match its recorded size and sha256"
                                             ".*rebuilding it") as caught:
        rebuilt = run()
    assert len([w for w in caught if "corrupt" in str(w.message)]) == 1
    assert rebuilt.report.cache == "miss" and (FileRoute.builds, FileRoute.loads) == (2, 1)
    with torch.no_grad():
        assert torch.allclose(rebuilt(x), model(x))
    assert run().report.cache == "hit"   # the rebuilt entry is good


@pytest.mark.parametrize("edit", ["route", "report"])
def test_a_hand_edited_entry_never_reports_a_route_that_did_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    edit: str) -> None:
    """entry.json's route and its report disagreeing (a hand edit: its route set to eager, or its
    report's backend to another engine) is a corrupt entry, rebuilt: the report of the hit said
    'onnxruntime' while eager ran."""
    from xlaunch.kernels.optimize.notes import OptimizeWarning

    _, _, run = _file_route_model(tmp_path, monkeypatch)
    assert run().report.backend == "onnxruntime"
    path = next(tmp_path.glob(f"engines/v*/*/{ENTRY}"))
    entry = json.loads(path.read_text())
    if edit == "route":
        entry["route"] = "eager"
    else:
        entry["report"]["backend"] = "openvino"
    path.write_text(json.dumps(entry))
    with pytest.warns(OptimizeWarning, match="is corrupt .*report does not describe the .* route"):
        rebuilt = run()
    assert rebuilt.report.cache == "miss" and rebuilt.report.backend == "onnxruntime"
    assert type(rebuilt.__dict__["forward"]).__name__ == "EngineForward"   # what the report says runs
    hit = run()
    assert hit.report.cache == "hit" and hit.report.backend == "onnxruntime"
