"""The engine cache's key, cap and stored choice: the key is equal across processes (no
addresses) and follows the code that runs (a changed helper rebuilds); the cache stays within its
cap, least recently used out first; a noisy tie keeps the incumbent; the decision is stored with
the entry and is the incumbent of a retrained model; ``xlaunch --show-cache`` reads it without torch."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cache_models  # noqa: E402
from xlaunch.kernels.optimize.engines import api, auto, policy  # noqa: E402
from xlaunch.kernels.optimize.engines.base import Built, Route  # noqa: E402
from xlaunch.kernels.optimize.engines.cache import Cache, describe  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def test_the_key_is_equal_in_another_process() -> None:
    """nn.TransformerEncoder and a forward with a comprehension, a generator and a lambda: their
    code objects' reprs hold addresses, which made every process's key new."""
    here = cache_models.keys()
    script = "import json, cache_models; print(json.dumps(cache_models.keys()))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_the_key_follows_code_attributes_and_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    base = cache_models.keys()["comprehensions"]
    monkeypatch.setattr(cache_models, "SCALE", 3.0)          # a global constant the helper reads
    scaled = cache_models.keys()["comprehensions"]
    monkeypatch.undo()
    assert cache_models.keys()["comprehensions"] == base != scaled
    from xlaunch.kernels.optimize.engines.cache import model_keys

    model, spec = cache_models.comprehensions(), (("T", torch.float32, 2, (8,), True),)

    def keys(m: nn.Module) -> tuple[str, str]:
        return model_keys(m, spec, ("eager",), 1, "", "O1", {})

    key, choice = keys(model)
    model.act = lambda t: torch.relu(t) + 2                  # an attribute holding other code
    assert keys(model)[0] != key
    model = cache_models.comprehensions()
    with torch.no_grad():
        model.layers[0].bias.add_(1.0)                       # other weights: another key, the same choice key
    assert keys(model)[0] != key and keys(model)[1] == choice


class TracedRoute(Route):
    """An engine-like route: its artifact is a traced graph (as an ONNX export would be), so a
    stale entry would keep running the old code."""

    cached_files = True
    builds = 0

    def build(self, model, sample, context):
        type(self).builds += 1
        traced = torch.jit.trace(model, sample.args, check_trace=False)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        return Built(traced, files={"traced.pt": buffer.getvalue()})

    def load(self, model, sample, context, files, state):
        return Built(torch.jit.load(io.BytesIO(files["traced.pt"])), files=files)


def synthetic_rounds(built, sample, report, budget_s, progress):
    """Rounds without timing (the tests here are about the cache, not the clock)."""
    fast = {"eager": 1.0, "torch": 0.99, "onnxruntime": 0.5}
    return {name: [fast[name]] * 5 for name in built}


def test_a_changed_helper_rebuilds_and_the_output_follows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "time_routes", synthetic_rounds)
    route = TracedRoute()
    route.name = "onnxruntime"
    monkeypatch.setattr(api, "ROUTES_BY_NAME", {**api.ROUTES_BY_NAME, "onnxruntime": route})
    model, x = cache_models.comprehensions(), torch.randn(3, 8)

    def run() -> nn.Module:
        return optimize(model, sample_input=x, backend="onnxruntime", progress=False)

    assert run().report.cache == "miss" and TracedRoute.builds == 1
    assert run().report.cache == "hit" and TracedRoute.builds == 1
    monkeypatch.setattr(cache_models, "helper", lambda t: t * -1.0)   # the code forward calls changed
    changed = run()
    assert changed.report.cache == "miss" and TracedRoute.builds == 2
    with torch.no_grad():
        assert torch.allclose(changed(x), model(x), atol=1e-6)


def fill(store: Cache, key: str, size: int, used: float) -> None:
    assert store.write(key, "onnxruntime", {}, {"sample": "float32[N,8]"}, {"model.onnx": b"x" * size},
                       {"model": "Net"})
    os.utime(store.path(key), (used, used))


def test_the_cache_stays_within_its_cap_least_recently_used_out(tmp_path: Path) -> None:
    store = Cache(str(tmp_path), limit=12_000)
    for index, key in enumerate("abc"):
        fill(store, key * 40, 3000, 1000.0 + index)          # a, then b, then c: ~3.6 kB each with entry.json
    assert [item["key"][0] for item in store.entries()] == ["a", "b", "c"]
    store.read("a" * 40)                                     # a read makes a the most recently used
    assert [item["key"][0] for item in store.entries()] == ["b", "c", "a"]
    fill(store, "d" * 40, 3000, 2e9)                         # over the cap: b goes (the least recently used)
    assert sorted(item["key"][0] for item in store.entries()) == ["a", "c", "d"]
    assert sum(item["size"] for item in store.entries()) <= store.limit
    with store.lock("c" * 40):                               # an entry in use is never evicted
        fill(store, "e" * 40, 3000, 2e9)
    assert sorted(item["key"][0] for item in store.entries()) == ["c", "d", "e"]
    assert not (Path(store.root) / ("b" * 40 + ".lock")).exists()
    text = describe(str(tmp_path), store.limit, store.entries())
    assert "3 entries" in text and "onnxruntime" in text and "Net float32[N,8]" in text


def test_a_noisy_tie_keeps_the_incumbent() -> None:
    # onnxruntime is 3.5 % faster in the median, but the rounds spread by +-6 %: a tie
    noisy = [1.0, 0.90, 1.02, 0.93, 0.99, 0.95, 1.04]
    rounds = {"eager": [1.3] * 7, "torch": [1.25] * 7, "openvino": [1.0] * 7,
              "onnxruntime": [v * 0.965 / 0.99 for v in noisy]}
    assert policy.choose(rounds, incumbent="openvino")[0] == "openvino"
    assert "kept the stored choice openvino" in policy.choose(rounds, incumbent="openvino")[1]
    assert "faster than openvino, not by the margin (3%) plus the noise" in policy.choose(rounds, incumbent="openvino")[1]
    # a challenger that is slower is not "within the margin" (the reason said so of one 7.5x slower)
    slower = {"eager": [7.5] * 7, "onnxruntime": [v * 0.9 for v in noisy]}
    reason = policy.choose(slower, incumbent="onnxruntime")[1]
    assert "eager, measured" in reason and "slower than onnxruntime" in reason and "margin" not in reason, reason
    assert "too noisy" not in reason and policy.decide(slower, incumbent="onnxruntime").clear   # decisively slower
    assert policy.choose(rounds, incumbent="onnxruntime")[0] == "onnxruntime"   # either way: no flip
    rounds["onnxruntime"] = [0.8 * v for v in rounds["openvino"]]              # a clear win replaces it
    assert policy.choose(rounds, incumbent="openvino")[0] == "onnxruntime"
    # without a stored choice the margin grows with the noise too
    tie = {"eager": [1.0, 1.1, 0.9, 1.0, 1.2, 0.95, 1.0], "torch": [1.0] * 7,
           "openvino": [0.95, 1.0, 0.9, 0.96, 1.1, 0.86, 0.97]}
    assert policy.choose(tie)[0] == "eager" and "plus the noise" in policy.choose(tie)[1]


def test_the_decision_is_stored_and_is_the_incumbent_of_a_retrained_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path))
    fake = TracedRoute()
    fake.name = "onnxruntime"
    monkeypatch.setattr(api, "ROUTES_BY_NAME", {**api.ROUTES_BY_NAME, "onnxruntime": fake})
    seen = []
    real_decide = policy.decide

    def decide(samples, margin=policy.WIN_MARGIN, incumbent=None):
        seen.append(incumbent)
        return real_decide(samples, margin, incumbent)

    monkeypatch.setattr(auto, "time_routes", synthetic_rounds)
    monkeypatch.setattr(policy, "decide", decide)
    model, x = cache_models.comprehensions(), torch.randn(3, 8)
    first = optimize(model, sample_input=x, backend=["onnxruntime"], progress=False)
    assert first.report.backend == "onnxruntime" and seen == [None]
    entry = json.loads((Path(first.report.cache_path) / "entry.json").read_text())
    assert entry["decision"]["route"] == "onnxruntime" and entry["model"] == "Comprehensions"
    assert optimize(model, sample_input=x, backend=["onnxruntime"], progress=False).report.cache == "hit"
    assert seen == [None]                                    # a hit is not timed again
    with torch.no_grad():
        model.layers[1].weight.mul_(0.5)                     # retrained: new key, same choice key
    again = optimize(model, sample_input=x, backend=["onnxruntime"], progress=False)
    assert again.report.cache == "miss" and seen == [None, "onnxruntime"]
    assert "stored choice onnxruntime" in again.report.reason


def test_a_choice_made_under_noise_is_measured_again_and_changes_when_clear(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: onnxruntime measured faster (3.7 vs 6.7 ms) but with noise 72.8 %, so the
    torch route was kept, then served from the cache for ever. Now the noisy decision is stored as
    such; the next run measures again, and clear figures change the cached choice."""
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path))
    fake = TracedRoute()
    fake.name = "onnxruntime"
    monkeypatch.setattr(api, "ROUTES_BY_NAME", {**api.ROUTES_BY_NAME, "onnxruntime": fake})
    noisy = [0.5, 1.6, 0.3, 2.2, 0.55, 1.9, 0.6]      # ORT's per-round ratio to torch: median 0.6, half-IQR > 50 %
    figures = {"noisy": {"eager": [8.0] * 7, "torch": [6.7] * 7, "onnxruntime": [6.7 * r for r in noisy]},
               "clear": {"eager": [8.0] * 7, "torch": [6.7] * 7, "onnxruntime": [3.7] * 7}}
    phase, timed = ["noisy"], []

    def rounds(built, sample, report, budget_s, progress):
        timed.append(phase[0])
        return {name: figures[phase[0]][name] for name in built}

    monkeypatch.setattr(auto, "time_routes", rounds)
    model, x = cache_models.comprehensions(), torch.randn(3, 8)

    def run() -> nn.Module:
        return optimize(model, sample_input=x, backend=["onnxruntime"], progress=False)

    first = run()
    assert first.report.backend == "torch" and first.report.cache == "miss"
    assert "the fastest, onnxruntime, measured 1.67x faster than torch" in first.report.reason   # directly compared
    assert "too noisy to tell" in first.report.reason
    entry = json.loads((Path(first.report.cache_path) / "entry.json").read_text())
    assert entry["decision"]["clear"] is False and entry["decision"]["noise"] > policy.NOISY
    for count in range(1, api.MAX_REMEASURES + 1):   # still noisy: measured again, boundedly
        again = run()
        assert timed == ["noisy"] * (count + 1) and again.report.backend == "torch"
        assert again.report.cache.startswith(f"measured again ({count} of {api.MAX_REMEASURES}")
    assert run().report.cache == "hit" and len(timed) == api.MAX_REMEASURES + 1   # the bound: no more

    with torch.no_grad():
        model.layers[0].bias.add_(1.0)    # another model (new key): its noisy choice is not an incumbent
    phase[0] = "noisy"
    assert run().report.backend == "torch"
    phase[0] = "clear"                    # the machine is quiet now: the figures are clear
    changed = run()
    assert changed.report.backend == "onnxruntime", changed.report.reason
    assert changed.report.reason.startswith("onnxruntime measured 1.81x faster than the stored choice torch")
    entry = json.loads((Path(changed.report.cache_path) / "entry.json").read_text())
    assert entry["route"] == "onnxruntime" and entry["decision"]["clear"] is True
    hit = run()
    assert hit.report.cache == "hit" and hit.report.backend == "onnxruntime" and timed[-1] == "clear"
    assert len(timed) == api.MAX_REMEASURES + 3
    with torch.no_grad():
        assert torch.allclose(hit(x), model(x), atol=1e-5)


def test_show_cache_reads_the_metadata_without_torch(tmp_path: Path) -> None:
    fill(Cache(str(tmp_path)), "f" * 40, 10, 1e9)
    script = ("import sys; from xlaunch.launcher.cli.command import run; code = run(['--show-cache', '--json']); "
              "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "XLAUNCH_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert [e["key"] for e in shown["entries"]] == ["f" * 40] and shown["entries"][0]["model"] == "Net"
