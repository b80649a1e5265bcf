"""``xlaunch --auto-optimize``: real launches of unmodified scripts."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest
from host_cpus import allowed_cores, need_cores

from xlaunch.kernels.inject import (BACKEND_ENV, CACHE_ENV, DTYPE_ENV, FREEZE_ENV, RECORD_ENV, SITE_DIR, VERBOSE_ENV,
                                    injection_env)

REPO = Path(__file__).resolve().parents[3]
JIT_INSTANCES = min(2, allowed_cores())      # the jit launch's instances: one per allowed core, two at most
JIT_ROWS = [f"[{index}]" for index in range(JIT_INSTANCES)]
if importlib.util.find_spec("torch") is None:     # the launched scripts import torch (found without importing it)
    pytest.skip("needs torch", allow_module_level=True)

MODEL_SCRIPT = """
import json, sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
with torch.no_grad():   # non-trivial BN statistics, so folding changes the weights
    model[1].running_mean.uniform_(-1, 1); model[1].running_var.uniform_(0.5, 2)
model.eval()
x = torch.randn(2, 3, 16, 16)
with torch.no_grad():
    outputs = [model(x) for _ in range(3)]
    with torch.autograd.set_grad_enabled(True):
        pass
    model[6].weight.add_(1.0)     # in-place change: the optimized copy must be rebuilt
    changed = model(x)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
print(json.dumps({
    "out": outputs[-1].tolist(), "changed": changed.tolist(),
    "optimizer": type(opt).__module__ + "." + type(opt).__name__,
    "is_adamw": isinstance(opt, torch.optim.AdamW),
    "module_types": [type(m).__name__ for m in model],
}))
"""


def xlaunch(*args: str, env: dict | None = None, freeze: str = "none", backend: str = "torch") -> subprocess.CompletedProcess:
    """``python -m xlaunch -q ARGS``; graph freezing off unless asked (it costs seconds per model),
    the torch rewrite unless another backend is asked (auto builds and times every engine)."""
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full_env.update({FREEZE_ENV: freeze, BACKEND_ENV: backend, **(env or {})})
    return subprocess.run([sys.executable, "-m", "xlaunch", "-q", "--memory-allocator", "default", *args],
                          capture_output=True, text=True, env=full_env, cwd=REPO, timeout=180)


def payload(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [line for line in result.stdout.splitlines() if line.lstrip("[0123456789] ").startswith("{")]
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0].split("] ", 1)[1] if lines[0].startswith("[") else lines[0])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def close(a, b, tol: float = 1e-4) -> bool:
    flat_a = [v for row in a for v in row]
    flat_b = [v for row in b for v in row]
    return len(flat_a) == len(flat_b) and all(abs(x - y) <= tol * (1 + abs(y)) for x, y in zip(flat_a, flat_b))


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "model_script.py"
    path.write_text(MODEL_SCRIPT)
    return path


@pytest.fixture(scope="module")
def reference() -> dict:
    """MODEL_SCRIPT's output without xlaunch: plain torch, run in this process (no hooks are installed
    here; a process of its own would only import torch once more), the global RNG left as it was."""
    import torch

    out = io.StringIO()
    with torch.random.fork_rng(), contextlib.redirect_stdout(out):
        exec(compile(MODEL_SCRIPT, "model_script.py", "exec"), {"__name__": "__main__"})
    return json.loads(out.getvalue().strip().splitlines()[-1])


def instance_payloads(result: subprocess.CompletedProcess) -> dict[str, dict]:
    """The JSON line of each instance of a multi-instance run, by its ``[N]`` prefix."""
    assert result.returncode == 0, result.stderr + result.stdout
    rows = [line for line in result.stdout.splitlines() if line[:1] == "[" and '] {"' in line]
    return {line.split("]", 1)[0] + "]": json.loads(line.split("] ", 1)[1]) for line in rows}


# -- the launcher side: pure, no torch ----------------------------------------------------------

def test_injection_env_prepends_our_site_dir_and_keeps_the_users_path() -> None:
    env = injection_env({"PYTHONPATH": f"/a{os.pathsep}/b"}, dtype="bfloat16", verbose=True)
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries[:3] == [SITE_DIR, "/a", "/b"]
    assert env[DTYPE_ENV] == "bfloat16" and env[VERBOSE_ENV] == "1"
    assert (Path(SITE_DIR) / "sitecustomize.py").is_file()


def test_injection_env_defaults_and_bad_dtype() -> None:
    env = injection_env({}, dtype=None, verbose=False)
    assert env[DTYPE_ENV] == "float32" and VERBOSE_ENV not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == SITE_DIR
    with pytest.raises(ValueError, match="dtype"):
        injection_env({}, dtype="float16", verbose=False)


@pytest.mark.parametrize("variable, value", [
    (FREEZE_ENV, "bogus"), (BACKEND_ENV, "bogus"), (BACKEND_ENV, "eager,nope"), (BACKEND_ENV, ","),
    ("XLAUNCH_AUTO_OPTIMIZE_BUDGET", "abc"), ("XLAUNCH_AUTO_OPTIMIZE_BUDGET", "-5"),
    ("XLAUNCH_AUTO_OPTIMIZE_BUDGET", "nan"), ("XLAUNCH_AUTO_OPTIMIZE_BUDGET", "inf"),
    ("XLAUNCH_AUTO_OPTIMIZE_LLM_WEIGHTS", "int3"),
])
def test_a_bad_variable_is_one_value_error_naming_it(variable, value) -> None:
    """Each instance printed 'not active' and ran unoptimized, or gave each model up (budget, backend)."""
    with pytest.raises(ValueError, match=variable) as error:
        injection_env({variable: value}, dtype=None, verbose=False)
    assert "\n" not in str(error.value) and repr(value) in str(error.value)
    good = {FREEZE_ENV: "inductor", BACKEND_ENV: "onnxruntime, torch", "XLAUNCH_AUTO_OPTIMIZE_BUDGET": "0.5",
            "XLAUNCH_AUTO_OPTIMIZE_LLM_WEIGHTS": "int4"}
    assert injection_env(good, dtype="bfloat16", verbose=False)[DTYPE_ENV] == "bfloat16"


def test_the_launcher_refuses_a_bad_variable_before_starting(tmp_path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {**os.environ, "XLAUNCH_AUTO_OPTIMIZE_BUDGET": "abc"}
    result = subprocess.run([sys.executable, "-m", "xlaunch", "--auto-optimize", str(script)], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=60)
    assert result.returncode == 2 and not marker.exists(), result.stderr
    assert result.stderr.strip().splitlines() == [
        "xlaunch: error: --auto-optimize: XLAUNCH_AUTO_OPTIMIZE_BUDGET must be a number of seconds > 0, not 'abc'"]


def test_every_instance_is_pointed_at_one_engine_cache(tmp_path) -> None:
    env = injection_env({"HOME": str(tmp_path)}, dtype=None, verbose=False)
    assert env[CACHE_ENV] == str(tmp_path / ".cache" / "xlaunch")
    assert CACHE_ENV not in injection_env({CACHE_ENV: "/mine"}, dtype=None, verbose=False)   # the user's stays


def test_engine_records_reach_the_summary(tmp_path) -> None:
    """What an instance appends to its XLAUNCH_AUTO_OPTIMIZE_RECORD file names its engines in the
    table and the JSON (bad lines skipped; no file: no engines)."""
    from xlaunch.kernels.inject import read_records
    from xlaunch.launcher.observe.summary import InstanceResult, summary_json, table_lines

    record = tmp_path / "instance-0.jsonl"
    record.write_text('{"module": "ResNet", "backend": "openvino", "cache": "hit", "reason": "r"}\nnot json\n[1]\n')
    engines = read_records(str(record))
    assert engines == [{"module": "ResNet", "backend": "openvino", "cache": "hit", "reason": "r"}]
    assert read_records(str(tmp_path / "missing")) == []
    rows = [InstanceResult(0, (0,), (0,), 0, "exit 0", 1.0, engines=engines),
            InstanceResult(1, (1,), (0,), 0, "exit 0", 1.0)]
    assert "instance 0 engines: ResNet on openvino (cache hit)" in table_lines(rows, 0)
    data = summary_json(rows, 0, allocator="default", openmp="gnu")
    assert data["instances"][0]["engines"] == engines and "engines" not in data["instances"][1]


def test_launcher_side_imports_no_torch() -> None:
    code = ("import sys; from xlaunch.kernels.inject import injection_env; injection_env({}, dtype=None, "
            "verbose=False); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_dry_run_shows_the_injection_without_importing_torch(script) -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "xlaunch", "--dry-run", "--json",
                             "--auto-optimize", "--dtype", "bfloat16", str(script)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)["instances"][0]["env"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == SITE_DIR and env[DTYPE_ENV] == "bfloat16"
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "xlaunch.kernels.inject" in imported
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}


# -- real launches --------------------------------------------------------------------------------

def test_unmodified_script_is_optimized_in_every_instance_and_gives_the_same_results(scenarios, reference) -> None:
    """Two instances, or one on one allowed core (the ``jit`` launch: ``-m pkg.run``, MODEL_SCRIPT first, then
    the scenarios)."""
    result, (_custom, run, before) = scenarios.with_files("jit")
    rows = instance_payloads(result)
    assert sorted(rows) == JIT_ROWS, result.stdout
    text = result.stderr + result.stdout
    for index in JIT_ROWS:
        got = rows[index]
        assert f"{index} " in text and "Sequential optimized: folded 1 BN, removed 1 dropout, channels_last on 1 conv" in text
        assert close(got["out"], reference["out"])
        assert close(got["changed"], reference["changed"])       # rebuilt after the in-place change
        assert got["optimizer"] == "xlaunch.kernels.optim.fused.FusedAdamW" and got["is_adamw"]
        assert got["module_types"] == reference["module_types"]   # the user's model object untouched
    for line in ("Sequential: frozen with jit for inputs [(2, 3, 16, 16)]", "weights changed since it was optimized"):
        assert {row[:3] for row in text.splitlines() if line in row} == set(JIT_ROWS), (line, text)
    assert digest(run) == before[1]


NO_INJECTION_PROBE = """
import json, os, sys
print(json.dumps({"hooks": "xlaunch.kernels.inject.hooks" in sys.modules,
                  "site": (getattr(sys.modules.get("sitecustomize"), "__file__", None) or ""),
                  "env": sorted(k for k in os.environ if k.startswith("XLAUNCH_AUTO_OPTIMIZE"))}))
"""


def test_without_auto_optimize_nothing_is_injected(tmp_path) -> None:
    """No hooks, not our sitecustomize, none of the injection's variables (a torch-free probe: what
    the hooks would do to a torch program is the launches' below)."""
    probe = tmp_path / "probe.py"
    probe.write_text(NO_INJECTION_PROBE)
    got = payload(xlaunch(str(probe)))
    assert got["hooks"] is False and not got["site"].startswith(str(SITE_DIR)), got
    assert {DTYPE_ENV, VERBOSE_ENV, RECORD_ENV} & set(got["env"]) == set(), got   # (the test sets FREEZE and BACKEND)


ENGINE_SCRIPT = """
import json, sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
x = torch.randn(5, 32)
reference = model(x).tolist()
with torch.no_grad():
    out = [model(x) for _ in range(3)][-1]
    small = model(x[:2])
print(json.dumps({"out": out.tolist(), "reference": reference, "small": small.tolist(),
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_two_instances_build_the_engine_once(tmp_path) -> None:
    """``--ninstances 2 --auto-optimize``: one instance builds the engine, the other loads it."""
    pytest.importorskip("onnxruntime")
    need_cores(2)
    script = tmp_path / "engine_script.py"
    script.write_text(ENGINE_SCRIPT)
    summary = tmp_path / "summary.json"
    result = xlaunch("--auto-optimize", "--auto-optimize-verbose", "--ninstances", "2", "--ncores-per-instance", "1",
                     "--summary-json", str(summary), str(script), backend="onnxruntime",
                     env={CACHE_ENV: str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    built = [line for line in text.splitlines() if "Sequential optimized: backend onnxruntime" in line]
    assert len(built) == 2, text
    assert sorted(line[:3] + line.rsplit("cache ", 1)[1] for line in built) in (["[0]hit)", "[1]miss)"],
                                                                                ["[0]miss)", "[1]hit)"]), built
    rows = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines() if '"reference"' in line]
    assert len(rows) == 2
    for row in rows:
        assert close(row["out"], row["reference"]) and close(row["small"], row["reference"][:2])
        assert row["dynamo"] is False      # the hooks never import torch._dynamo (sympy...: seconds) themselves
    assert len(list((tmp_path / "cache" / "engines").glob("v*/*/model.onnx"))) == 1
    engines = [instance["engines"] for instance in json.loads(summary.read_text())["instances"]]   # named per instance
    assert all([e["module"] for e in found] == ["Sequential"] and found[0]["backend"] == "onnxruntime"
               for found in engines), engines
    assert sorted(found[0]["cache"] for found in engines) == ["hit", "miss"], engines


# Small scenarios share a launch (each launch imports torch: ~4 s of CPU): one launch per freeze
# mode runs MODEL_SCRIPT and every scenario in its own function, and each test reads its own lines.
SCENARIOS = {
    # optimize() raises for this model (a bad flag forced through the environment would be
    # artificial); here the model's own deepcopy refuses, which optimize needs.
    "odd": """
class Odd(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 2)
    def __deepcopy__(self, memo):
        raise RuntimeError('this model cannot be copied')
    def forward(self, x):
        return self.lin(x) * 2
torch.manual_seed(0); m = Odd().eval(); x = torch.ones(1, 4)
with torch.no_grad():
    outs = [m(x) for _ in range(3)]
print('ok', round(float(outs[-1].sum()), 5), round(float((m.lin(x) * 2).sum()), 5))
""",
    "grad": """
m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
x = torch.randn(3, 4, requires_grad=True)
y = m(x).sum(); y.backward()
print('grad', x.grad is not None, type(m[1]).__name__)
""",
    # Tracing bakes in shape-dependent control flow (no TracerWarning for ``x.dim()``).
    "shapes": """
class Branchy(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x) if x.dim() == 2 else self.lin(x).sum(0)
m = Branchy().eval()
with torch.no_grad():
    m(torch.ones(2, 4))          # the first call runs the model itself (watched), the copy is built after it
    a = m(torch.ones(2, 4))
    b = m(torch.ones(3, 2, 4))
    c = m(torch.ones(3, 2, 4))
print('shapes', tuple(a.shape), tuple(b.shape), tuple(c.shape))
""",
    "values": """
class Sign(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)
torch.manual_seed(0); m = Sign().eval()
with torch.no_grad():
    got = [m(torch.ones(2, 4)), m(-torch.ones(2, 4))]
    m.lin.weight.add_(0)
with torch.no_grad():
    want = [m.lin(torch.ones(2, 4)), -m.lin(-torch.ones(2, 4))]
print('same', all(torch.equal(a, b) for a, b in zip(got, want)))
""",
    # A hook on the user's BatchNorm fires on the first call only (the module itself runs, watched):
    # later calls run the folded copy (eager or frozen), also for more input signatures than are
    # frozen, and with keyword arguments.
    "hooks": """
class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.conv = nn.Conv2d(3, 4, 3); self.bn = nn.BatchNorm2d(4)
    def forward(self, x, scale=1.0):
        return self.bn(self.conv(x)) * scale
m = Net().eval(); calls = []
m.bn.register_forward_hook(lambda *a: calls.append(1))
with torch.no_grad():
    for size in range(6, 13):
        m(torch.randn(1, 3, size, size))
    m(torch.randn(1, 3, 8, 8), scale=2.0)
print('bn calls', len(calls))
""",
    # The program's own wrong call (caught by it) raises as the model raises it, and the optimized
    # copy stays: it was not the copy that failed.
    "wrongcall": """
from xlaunch.kernels.inject import hooks
class Strict(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 2)
    def forward(self, x):
        return self.lin(x)
m = Strict().eval()
raised = []
with torch.no_grad():
    for rows, cols in ((2, 5), (2, 4), (2, 5)):   # a wrong first call (the copy is built on it), then a later one
        try:
            good = m(torch.ones(rows, cols))
        except RuntimeError as exc:
            raised.append('mat1 and mat2 shapes' in str(exc))
    good = m(torch.ones(3, 4))
entry = hooks._entries[m]
print('wrongcall', raised == [True, True], entry.given_up, entry.eager is not None, tuple(good.shape))
""",
    # a training loop validated under no_grad: fused steps (ours, torch's fused=True) bump no version
    # counter, yet each validation must see the weights of that step, not those of the first one
    "steps": """
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.Adam(m.parameters(), lr=0.1)
x, y, xv = torch.randn(64, 16), torch.randint(0, 4, (64,)), torch.randn(16, 16)
errors = []
for step in range(3):
    m.train(); opt.zero_grad(); nn.functional.cross_entropy(m(x), y).backward(); opt.step()
    m.eval()
    with torch.no_grad():
        got = m(xv).float()
    want = m(xv).detach()           # autograd on: the module itself
    errors.append(float((got - want).abs().max() / want.abs().max()))
print('steps', type(opt).__name__, max(errors) < 0.05, errors)
""",
    # validation after each step under the engine backend: the first call measures the routes, each
    # rebuild for the new weights builds the route measured then, untimed, and adds no summary entry
    "reuse": """
import atexit, os, shutil, tempfile
from xlaunch.kernels.inject import hooks
from xlaunch.kernels.optimize.engines import auto
os.environ['XLAUNCH_CACHE_DIR'] = tempfile.mkdtemp()     # not the user's cache, and not left in /tmp
atexit.register(shutil.rmtree, os.environ['XLAUNCH_CACHE_DIR'], True)
hooks._settings.backend, hooks._settings.dtype = 'onnxruntime', 'float32'   # an engine whose build holds weights
auto.MIN_TIMING_S, timed, records = 0.2, [], []
real_timing, real_record = auto.time_routes, hooks._record
auto.time_routes = lambda *a, **k: (timed.append(1), real_timing(*a, **k))[1]
hooks._record = lambda item: (records.append(item['backend']), real_record(item))
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x, y, xv = torch.randn(64, 16), torch.randn(64, 4), torch.randn(16, 16)
errors, routes = [], []
for step in range(3):
    m.train(); opt.zero_grad(); nn.functional.mse_loss(m(x), y).backward(); opt.step()
    m.eval()
    with torch.no_grad():
        got = m(xv).float()
    want = m(xv).detach()
    errors.append(float((got - want).abs().max() / want.abs().max()))
    routes.append(hooks._entries[m].eager._xlaunch_engine_report.backend)
again = hooks._entries[m].eager._xlaunch_engine_report
print('reuse', len(timed), max(errors) < 0.05, len(set(routes)), records == routes[:1], again.cache,
      'not measured again' in again.reason, errors)
""",
    # torch.compile's wrapper, where the hooks look for it (torch's optimizers have loaded torch._dynamo)
    "compiled": """
import torch._dynamo.eval_frame as eval_frame
from xlaunch.kernels.inject import hooks
print('compiled type', hooks._compiled_module_type() is eval_frame.OptimizedModule)
""",
}
SCENARIOS_OF = {"none": ("odd", "grad", "hooks", "wrongcall", "steps", "reuse", "compiled"), "jit": ("shapes", "values", "hooks")}


def scenario_script(freeze: str, model_script: str) -> str:
    """``model_script`` (its one JSON line) and that mode's scenarios, each in its own function."""
    body = ["import torch", "from torch import nn"]
    for name, text in (("model", model_script), *((name, SCENARIOS[name]) for name in SCENARIOS_OF[freeze])):
        body.append(f"def scenario_{name}():" + text.replace("\n", "\n    "))
        body.append(f"scenario_{name}()")
    return "\n".join(body) + "\n"


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """``scenarios(freeze)``: the one verbose ``--auto-optimize`` launch of that mode, which runs
    MODEL_SCRIPT and the mode's scenarios. ``none`` is a script run with ``--dtype bfloat16`` (bf16
    or the line saying why not, for the model; the scenarios' checks hold either way); ``jit`` is
    two instances in module mode, ``-m pkg.run``, with the user's own sitecustomize on PYTHONPATH
    (returned too: ``(sitecustomize, pkg/run.py, their digests before the launch)``)."""
    done: dict[str, tuple] = {}

    def launch(freeze: str) -> subprocess.CompletedProcess:
        return launch_with_files(freeze)[0]

    def launch_with_files(freeze: str) -> tuple:
        if freeze in done:
            return done[freeze]
        root = tmp_path_factory.mktemp(f"scenarios_{freeze}")
        if freeze == "none":
            script = root / "scenarios.py"
            script.write_text(scenario_script(freeze, MODEL_SCRIPT))
            result = xlaunch("--auto-optimize", "--auto-optimize-verbose", "--dtype", "bfloat16", str(script),
                             freeze=freeze)
            files: tuple = ()
        else:
            package = root / "pkg"
            package.mkdir()
            (package / "__init__.py").write_text("")
            run = package / "run.py"
            run.write_text(scenario_script(freeze, MODEL_SCRIPT.replace(
                '"optimizer":', '"site": __import__("os").environ.get("USER_SITECUSTOMIZE_RAN"), "optimizer":')))
            user_site = root / "usersite"
            user_site.mkdir()
            custom = user_site / "sitecustomize.py"
            custom.write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
            files = (custom, run, (digest(custom), digest(run)))
            result = xlaunch("--auto-optimize", "--auto-optimize-verbose", "--ninstances", str(JIT_INSTANCES),
                             "--ncores-per-instance", "1", "-m", "pkg.run", freeze=freeze,
                             env={"PYTHONPATH": os.pathsep.join([str(root), str(user_site)])})
        assert result.returncode == 0, result.stderr + result.stdout
        done[freeze] = (result, files)
        return done[freeze]
    launch.with_files = launch_with_files    # type: ignore[attr-defined]
    return launch


def test_module_mode(scenarios, reference) -> None:
    rows = instance_payloads(scenarios("jit"))
    assert sorted(rows) == JIT_ROWS
    for got in rows.values():
        assert got["optimizer"] == "xlaunch.kernels.optim.fused.FusedAdamW"
        assert close(got["out"], reference["out"])


def test_existing_sitecustomize_still_runs_and_is_untouched(scenarios) -> None:
    result, (custom, run, before) = scenarios.with_files("jit")
    rows = instance_payloads(result)
    assert sorted(rows) == JIT_ROWS
    for got in rows.values():
        assert got["site"] == "yes"
        assert got["optimizer"] == "xlaunch.kernels.optim.fused.FusedAdamW"
    assert (digest(custom), digest(run)) == before


def test_a_model_the_library_cannot_handle_runs_unchanged_with_one_warning(scenarios) -> None:
    result = scenarios("none")
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if "runs unoptimized" in line
                and "Odd" in line]
    assert len(warnings) == 1 and "cannot be copied" in warnings[0], result.stdout + result.stderr
    ok = [line for line in result.stdout.splitlines() if " ok " in line or line.startswith("ok")][0].split()
    assert ok[-1] == ok[-2]


def test_the_programs_own_wrong_call_raises_and_keeps_the_optimized_copy(scenarios) -> None:
    result = scenarios("none")
    assert "wrongcall True False True (3, 2)" in result.stdout, result.stdout + result.stderr
    assert not [line for line in (result.stdout + result.stderr).splitlines() if "Strict runs unoptimized" in line]


def test_validation_after_each_optimizer_step_sees_that_steps_weights(scenarios) -> None:
    result = scenarios("none")
    assert "steps FusedAdam True" in result.stdout, result.stdout + result.stderr


def test_a_rebuild_for_new_weights_reuses_the_route_measured_before(scenarios) -> None:
    """Each rebuild measured every route again (seconds each) and added a summary entry."""
    result = scenarios("none")
    assert "reuse 1 True 1 True rebuilt (weights changed; not written) True" in result.stdout, \
        result.stdout + result.stderr


def test_grad_enabled_eval_calls_run_unoptimized(scenarios) -> None:
    result = scenarios("none")
    assert "grad True BatchNorm1d" in result.stdout
    assert "autograd on: runs unoptimized" in result.stdout + result.stderr


def test_script_without_torch_never_imports_it(tmp_path) -> None:
    script = tmp_path / "notorch.py"
    script.write_text("import sys\nprint('torch loaded:', 'torch' in sys.modules)\n")
    result = xlaunch("--auto-optimize", str(script))
    assert "torch loaded: False" in result.stdout, result.stderr


def test_bf16_follows_the_isa(scenarios, reference) -> None:
    """bf16 only where the CPU has AVX512_BF16/AMX (under ``ONEDNN_MAX_CPU_ISA``'s ceiling, as oneDNN runs it);
    otherwise fp32 and a line saying why."""
    from xlaunch.kernels.native_dtypes import isa_flags

    flags = isa_flags()
    native = bool({"avx512_bf16", "amx_bf16"} & flags)
    result = scenarios("none")      # launched with --dtype bfloat16
    got = payload(result)
    text = result.stdout + result.stderr
    if native:
        assert "bf16 (" in text
        assert close(got["out"], reference["out"], tol=5e-2)
    else:
        assert "bf16 not used" in text and "AVX512_BF16" in text
        assert close(got["out"], reference["out"])


def test_a_traced_graph_only_serves_inputs_like_its_sample(scenarios) -> None:
    """Each input signature gets its own graph, so every call gets the model's own answer."""
    result = scenarios("jit")
    assert "shapes (2, 4) (2, 4) (2, 4)" in result.stdout
    frozen = [line for line in (result.stderr + result.stdout).splitlines() if "Branchy: frozen with jit" in line]
    assert any("inputs [(2, 4)]" in line for line in frozen) and any("inputs [(3, 2, 4)]" in line for line in frozen), frozen


def test_value_dependent_control_flow_is_never_frozen(scenarios) -> None:
    result = scenarios("jit")
    assert "same True" in result.stdout
    assert "UnsafeTrace" in result.stdout + result.stderr


@pytest.mark.parametrize("freeze", ["none", "jit"])
def test_calls_go_to_the_optimized_copy_not_the_users_modules(scenarios, freeze) -> None:
    assert "bn calls 1" in scenarios(freeze).stdout


def test_compiled_modules_are_left_to_torch_compile(monkeypatch) -> None:
    """A ``torch.compile`` wrapper (known once torch._dynamo is loaded) runs as it is, never through
    the hooks; a plain module in eval mode under no_grad goes through them. (torch's own wrapper
    class, where the hooks look for it, is checked in the 'none' launch: importing torch._dynamo
    here would cost seconds.)"""
    torch = pytest.importorskip("torch")
    from xlaunch.kernels.inject import hooks

    class Compiled(torch.nn.Module):
        pass

    asked = []
    monkeypatch.setattr(hooks, "_optimized_for", lambda module, *rest: asked.append(type(module).__name__))
    call = hooks._make_call(lambda module, *args, **kwargs: "original", torch)
    plain, compiled = torch.nn.Linear(2, 2).eval(), Compiled().eval()
    with torch.no_grad():
        monkeypatch.delitem(sys.modules, "torch._dynamo.eval_frame", raising=False)
        assert hooks._compiled_module_type() is None
        assert call(compiled, torch.ones(1, 2)) == "original" and asked == ["Compiled"]
        monkeypatch.setitem(sys.modules, "torch._dynamo.eval_frame", type(sys)("eval_frame"))
        sys.modules["torch._dynamo.eval_frame"].OptimizedModule = Compiled
        assert call(compiled, torch.ones(1, 2)) == "original" and asked == ["Compiled"]
        assert call(plain, torch.ones(1, 2)) == "original" and asked == ["Compiled", "Linear"]


def test_the_hooks_know_torchs_compiled_module_type(scenarios) -> None:
    assert "compiled type True" in scenarios("none").stdout


def test_a_wrong_first_call_raises_the_models_error_and_the_next_call_is_optimized(monkeypatch) -> None:
    """The engine route is built on the first call's arguments: when the model itself fails on them,
    the program gets the model's error and the next call builds (it gave the model up for the run)."""
    torch = pytest.importorskip("torch")
    from xlaunch.kernels.inject import hooks

    monkeypatch.setattr(hooks, "_settings", hooks.Settings({BACKEND_ENV: "eager", FREEZE_ENV: "none"}))
    monkeypatch.delenv(RECORD_ENV, raising=False)
    call = hooks._make_call(torch.nn.Module.__call__, torch)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):
            call(model, torch.ones(2, 5))
        entry = hooks._entries[model]
        assert not entry.given_up and entry.eager is None
        out = call(model, torch.ones(3, 4))
    assert tuple(out.shape) == (3, 2) and not entry.given_up
    assert entry.eager is not None and entry.eager.report.backend == "eager"


def test_a_forward_that_changes_its_own_state_runs_unoptimized(monkeypatch, capsys) -> None:
    """An optimized copy kept a call counter and a running state buffer to itself (frozen: with the value
    of the build's calls): the program read wrong numbers and stale state. The first call runs the model
    itself, watched; a model that changes its state once more runs as it is (said once), and a cache
    filled on the first call only does not stop the copy being built on the next."""
    torch = pytest.importorskip("torch")
    from xlaunch.kernels.inject import hooks

    monkeypatch.setattr(hooks, "_settings", hooks.Settings({BACKEND_ENV: "eager", FREEZE_ENV: "none"}))
    monkeypatch.delenv(RECORD_ENV, raising=False)
    call = hooks._make_call(torch.nn.Module.__call__, torch)

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__(); self.lin = torch.nn.Linear(4, 4); self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x) * self.calls

    class Running(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__(); self.lin = torch.nn.Linear(4, 4); self.register_buffer("state", torch.zeros(1, 4))

        def forward(self, x):
            y = self.lin(x) + self.state
            self.state.copy_(y.mean(0, keepdim=True))
            return y

    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__(); self.lin = torch.nn.Linear(4, 4); self.table = None

        def forward(self, x):
            if self.table is None:
                self.table = torch.arange(4.0)
            return self.lin(x) + self.table

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    for kind in (Counter, Running, Cached):
        model = kind().eval()
        twin = kind().eval()
        twin.load_state_dict(model.state_dict())
        with torch.no_grad():
            got = [call(model, x) for _ in range(4)]
            want = [twin(x) for _ in range(4)]
        assert all(torch.allclose(a, b) for a, b in zip(got, want)), kind.__name__
        entry = hooks._entries[model]
        assert entry.given_up == (kind is not Cached) and (entry.eager is not None) == (kind is Cached), kind.__name__
    assert torch.equal(model.table, torch.arange(4.0))
    said = [line for line in capsys.readouterr().err.splitlines() if "runs unoptimized" in line]
    assert said == ["xlaunch --auto-optimize: Counter runs unoptimized: its forward changes its own state (calls), "
                    "which a copy would not update",
                    "xlaunch --auto-optimize: Running runs unoptimized: its forward changes its own state (state), "
                    "which a copy would not update"], said


FORK_WHILE_BUILDING = """
import os, sys, threading
from xlaunch.kernels.inject import hooks
held, release = threading.Event(), threading.Event()
def build():                      # another thread building a copy holds the hooks' lock
    with hooks._lock:
        held.set(); release.wait()
thread = threading.Thread(target=build); thread.start(); held.wait()
pid = os.fork()
if pid == 0:                      # a DataLoader worker's or multiprocessing child's first model call takes the lock
    os._exit(0 if hooks._lock.acquire(timeout=5) else 1)
_, status = os.waitpid(pid, 0)
release.set(); thread.join()
print('child', os.waitstatus_to_exitcode(status), 'torch' in sys.modules)
"""


def test_a_child_forked_while_another_thread_builds_does_not_wait_for_ever() -> None:
    """The child waited for ever on the lock the building thread held at the fork (a forked DataLoader
    worker hung on its first call of a model). Torch-free: the lock is the hooks' own."""
    result = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", FORK_WHILE_BUILDING],
                            capture_output=True, text=True, timeout=60, cwd=REPO)   # 3.12 warns of fork with threads
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.split() == ["child", "0", "False"], result.stdout


def test_a_model_whose_copy_fails_where_it_does_not_is_given_up_once(monkeypatch, capsys) -> None:
    """A copy that fails on arguments the model itself just took (here: it looks itself up by identity) was
    taken for the program's wrong call: no word, and a copy made and tried again on every call."""
    torch = pytest.importorskip("torch")
    from xlaunch.kernels.inject import hooks
    from xlaunch.kernels.optimize import pipeline

    monkeypatch.setattr(hooks, "_settings", hooks.Settings({BACKEND_ENV: "eager", FREEZE_ENV: "none"}))
    monkeypatch.delenv(RECORD_ENV, raising=False)
    builds = []
    real = pipeline.optimize
    monkeypatch.setattr(pipeline, "optimize", lambda *a, **k: (builds.append(1), real(*a, **k))[1])
    call = hooks._make_call(torch.nn.Module.__call__, torch)
    known: set = set()

    class Registered(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__(); self.lin = torch.nn.Linear(4, 2); known.add(id(self))

        def forward(self, x):
            if id(self) not in known:
                raise KeyError("module not registered")
            return self.lin(x)

    model = Registered().eval()
    with torch.no_grad():
        got = [call(model, torch.ones(3, 4)) for _ in range(4)]
        want = model.lin(torch.ones(3, 4))
    assert all(torch.equal(out, want) for out in got) and len(builds) == 1 and hooks._entries[model].given_up
    said = [line for line in capsys.readouterr().err.splitlines() if "Registered" in line]
    assert said == ["xlaunch --auto-optimize: Registered runs unoptimized: a copy of it fails on a call the model "
                    "itself took (KeyError: 'module not registered')"], said


@pytest.mark.parametrize("stream", ["none", "closed"])
def test_a_missing_or_closed_stderr_loses_the_line_not_the_run(stream, monkeypatch) -> None:
    """The program set sys.stderr to None or closed it (it runs fine without --auto-optimize): the hooks'
    one line (here: a model given up) raised AttributeError/ValueError out of the program's model call."""
    torch = pytest.importorskip("torch")
    import io

    from xlaunch.kernels.inject import hooks

    monkeypatch.setattr(hooks, "_settings", hooks.Settings({BACKEND_ENV: "eager", FREEZE_ENV: "none"}))
    monkeypatch.delenv(RECORD_ENV, raising=False)
    call = hooks._make_call(torch.nn.Module.__call__, torch)

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__(); self.lin = torch.nn.Linear(4, 4); self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x) * self.calls

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", None if stream == "none" else closed)
    model = Counter().eval()
    with torch.no_grad():
        got = [call(model, torch.ones(1, 4)) for _ in range(3)]
    monkeypatch.undo()
    assert hooks._entries[model].given_up and torch.allclose(got[2], 3 * model.lin(torch.ones(1, 4)))


def test_a_model_first_called_under_inference_mode_is_optimized(monkeypatch, capsys, tmp_path) -> None:
    """Built under the program's torch.inference_mode(), the copy held inference tensors, which the engine
    routes refused ('Inference tensors do not track version counter'): the model ran unoptimized."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from xlaunch.kernels.inject import hooks

    monkeypatch.setattr(hooks, "_settings", hooks.Settings({BACKEND_ENV: "onnxruntime", FREEZE_ENV: "none"}))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(RECORD_ENV, raising=False)
    call = hooks._make_call(torch.nn.Module.__call__, torch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    x = torch.randn(3, 4)
    with torch.inference_mode():
        got = [call(model, x) for _ in range(3)]
    entry = hooks._entries[model]
    assert not entry.given_up and entry.eager is not None, capsys.readouterr().err
    assert entry.eager._xlaunch_engine_report.backend == "onnxruntime"
    assert torch.allclose(got[-1], model(x), atol=1e-5)
    with torch.no_grad():                      # the copy's tensors are not inference tensors: later calls too
        assert torch.allclose(call(model, x), model(x), atol=1e-5)


def test_a_model_made_under_inference_mode_is_optimized(monkeypatch, capsys, tmp_path) -> None:
    """A model made under torch.inference_mode (an inference server's) has inference tensors for weights: the
    state watch asked each for its version counter (hasattr raised RuntimeError, not AttributeError) and the
    program died in its first model call; the weights check would have raised the same."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from xlaunch.kernels.inject import hooks

    monkeypatch.setattr(hooks, "_settings", hooks.Settings({BACKEND_ENV: "onnxruntime", FREEZE_ENV: "none"}))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(RECORD_ENV, raising=False)
    call = hooks._make_call(torch.nn.Module.__call__, torch)
    torch.manual_seed(0)
    with torch.inference_mode():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
        x = torch.randn(3, 4)
        got = [call(model, x) for _ in range(3)]
        entry = hooks._entries[model]
        assert not entry.given_up and entry.eager is not None, capsys.readouterr().err
        assert entry.eager._xlaunch_engine_report.backend == "onnxruntime"
        assert torch.allclose(got[-1], model(x), atol=1e-5)
