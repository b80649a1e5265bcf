"""Without torch, every torch-needing entry point raises one ImportError naming the extra (fast, no
wheel: ``sys.modules["torch"] = None`` makes ``import torch`` fail like a missing install)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HINT = 'pip install "xlaunch[torch]"'
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("expression", ["xlaunch.optimize", "xlaunch.MultiStreamModule",
                                        "xlaunch.kernels.FusedSGD", "xlaunch.kernels.to_fused",
                                        "xlaunch.nn.MergedEmbeddingBag", "xlaunch.nn.roi_align"])
def test_one_import_error_names_the_extra(expression):
    result = python(f"import xlaunch, xlaunch.kernels, xlaunch.nn\n{expression}\n")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"ImportError: {expression} needs PyTorch, which is not installed here: {HINT}"), result.stderr


def test_what_does_not_need_torch_still_loads():
    result = python("import xlaunch\nprint(xlaunch.CPUPool, xlaunch.Task, xlaunch.pin)\n"
                    "from xlaunch.machine import load_machine; load_machine()\n")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_other_missing_modules_are_not_disguised():
    from xlaunch._torch import load_attribute

    with pytest.raises(ModuleNotFoundError, match="no_such_xlaunch_module"):
        load_attribute("xlaunch.no_such_xlaunch_module", "x", "xlaunch.x")


# Walks every module of the source tree in one child. The launcher's start-up hook is left out:
# importing it runs the user's sitecustomize and installs import hooks (its torch-less behaviour
# is to wait for a torch that never comes).
WALK = """
import importlib, json, pkgutil, xlaunch
outcome = {}
for info in pkgutil.walk_packages(xlaunch.__path__, "xlaunch.", onerror=lambda name: None):
    if info.name == "xlaunch.kernels.inject.site.sitecustomize":
        continue
    try:
        importlib.import_module(info.name)
        outcome[info.name] = None
    except ImportError as exc:
        outcome[info.name] = [type(exc).__name__, exc.name, str(exc)]
print(json.dumps(outcome))
"""


def test_every_module_imports_or_names_the_extra():
    import json
    from pathlib import Path

    import xlaunch
    from xlaunch._torch import missing_torch_message

    result = python(WALK)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    source = Path(xlaunch.__file__).parent
    expected = {".".join(("xlaunch",) + path.relative_to(source).with_suffix("").parts)
                for path in source.rglob("*.py") if path.name != "__init__.py"} - {
        "xlaunch.kernels.inject.site.sitecustomize"}
    assert expected <= set(outcome), sorted(expected - set(outcome))   # the walk missed none
    wrong = {name: error for name, error in outcome.items()
             if error is not None and error != ["ImportError", "torch", missing_torch_message(name)]}
    assert not wrong, wrong
    needing = {name for name, error in outcome.items() if error is not None}
    assert {"xlaunch.kernels.optimize.pipeline", "xlaunch.kernels.optimize.fold", "xlaunch.kernels.quantize.api",
            "xlaunch.runtime_ext.streams"} <= needing
    assert {"xlaunch", "xlaunch.launcher.cli.command", "xlaunch.runtime_ext.task",
            "xlaunch.runtime_ext.batching", "xlaunch.kernels.probe_worker"}.isdisjoint(needing)


def test_probe_child_without_torch_says_how_to_get_it(tmp_path):
    # The probe runs in a child (python -m xlaunch.kernels.probe_worker) that inherits the
    # environment: a torch package that fails like a missing install stands in for no torch.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    path = [str(tmp_path)] + [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    result = subprocess.run([sys.executable, "-m", "xlaunch", "--check-isa", "--probe"],
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (1, "")
    # A child slower than a second (a loaded machine) is shown by its steps first: "xlaunch: probe: ...".
    lines = [line for line in result.stderr.splitlines(keepends=True) if not line.startswith("xlaunch: probe: ")]
    assert "".join(lines) == ("xlaunch: error: --probe: the probe child exited with status 1: "
                              f"xlaunch --check-isa --probe needs PyTorch, which is not installed here: {HINT}\n")


def test_check_isa_torch_without_torch_says_how_to_get_it():
    result = python("import sys\nfrom xlaunch.launcher import cli\nsys.exit(cli.run(['--check-isa', '--torch']))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].endswith(f"); to install it: {HINT}"), result.stdout


@pytest.mark.parametrize("module", ["xlaunch.nn.native", "xlaunch.llm.native"])
def test_building_the_kernels_without_torch_is_one_line(tmp_path, module):
    """It was a traceback ending in "__main__ needs PyTorch" (the module named by its name as a script)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    path = [str(tmp_path)] + [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    result = subprocess.run([sys.executable, "-m", module], env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"python -m {module}: {module} needs PyTorch, which is not installed here: {HINT}\n"
