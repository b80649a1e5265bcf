"""The house in rooms: every room small, the public names where users find them, the old module
paths still working. (The layers and the absence of cycles: import-linter, run by ``make test``.)"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "xlaunch"
MAX_MODULES = 12          # per package folder, __init__ and __main__ not counted
MAX_LINES = 450           # per module


def test_no_package_folder_holds_more_than_a_dozen_modules() -> None:
    crowded = {}
    for folder in [PACKAGE, *[p.parent for p in PACKAGE.rglob("__init__.py")]]:
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > MAX_MODULES:
            crowded[str(folder.relative_to(REPO))] = len(modules)
    assert not crowded


def test_no_module_is_longer_than_a_few_hundred_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long


PUBLIC = {
    "xlaunch": ["CPUPool", "pin", "Task", "MultiStreamModule", "optimize", "quantize", "load_quantized"],
    "xlaunch.runtime_ext": ["CPUPool", "pin", "Task", "MultiStreamModule", "threadpool_info", "set_num_threads",
                            "get_core_list_of_node_id", "is_runtime_ext_enabled"],
    "xlaunch.kernels": ["optimize", "quantize", "load_quantized", "to_fused", "FusedSGD", "FusedAdam", "master_params"],
    "xlaunch.kernels.optimize": ["optimize", "OptimizeWarning", "Report"],
    "xlaunch.kernels.optim": ["to_fused", "FusedLamb", "master_params", "split_params"],
    "xlaunch.kernels.quantize": ["quantize", "load_quantized", "QuantizeWarning"],
    "xlaunch.nn": ["MergedEmbeddingBag", "MergedEmbeddingBagWithSGD", "MergedEmbeddingBagWithAdaGrad",
                   "MergedEmbeddingBagWithCat", "EmbeddingSpec", "interaction", "FrozenBatchNorm2d", "roi_align",
                   "RoIAlign"],
    "xlaunch.nn.functional": ["interaction", "roi_align"],
    "xlaunch.launcher": ["main"],
    "xlaunch.launcher.cli": ["main", "run"],
    "xlaunch.launcher.plan": ["plan", "Plan", "Instance", "Options", "build_options"],
    "xlaunch.machine": ["load_machine", "current_machine"],
}


NO_TORCH = importlib.util.find_spec("torch") is None     # `pip install xlaunch` without the torch extra


def _torch_missing(error: ImportError) -> bool:
    """The one ImportError a torch-only name gives without torch (xlaunch._torch.needs_torch)."""
    return NO_TORCH and error.name == "torch"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module: str) -> None:
    """Every public name is listed and resolves; without torch, a torch-only name is the one
    ImportError naming torch (and the names that need no torch still resolve)."""
    try:
        loaded = importlib.import_module(module)
    except ImportError as error:
        if _torch_missing(error):
            pytest.skip(f"{module} needs torch")
        raise
    assert set(PUBLIC[module]) <= set(dir(loaded))
    missing = []
    for name in PUBLIC[module]:
        try:
            getattr(loaded, name)
        except AttributeError:
            missing.append(name)
        except ImportError as error:
            if not _torch_missing(error):
                raise
    assert not missing


def test_kernels_optimize_is_callable_as_the_function() -> None:
    pytest.importorskip("torch")
    from torch import nn

    import xlaunch.kernels.optimize.pipeline  # noqa: F401 - binds the package as xlaunch.kernels.optimize
    from xlaunch.kernels import optimize

    model = optimize(nn.Linear(2, 2), level="O0")
    assert isinstance(model, nn.Linear)


OLD_PATHS = {
    "xlaunch.launcher.runner": "xlaunch.launcher.run.runner",
    "xlaunch.launcher.binding": "xlaunch.launcher.run.binding",
    "xlaunch.launcher.machine": "xlaunch.machine",
    "xlaunch.launcher.machine.record": "xlaunch.machine.record",
    "xlaunch.launcher.report": "xlaunch.machine.report",
    "xlaunch.launcher.ranks": "xlaunch.launcher.distributed.ranks",
    "xlaunch.launcher.options": "xlaunch.launcher.plan.options",
    "xlaunch.launcher.probe": "xlaunch.launcher.observe.probe",
    "xlaunch.kernels.fold": "xlaunch.kernels.optimize.fold",
    "xlaunch.kernels.splitbf16": "xlaunch.kernels.optim.splitbf16",
    "xlaunch.kernels.quantize_policy": "xlaunch.kernels.quantize.policy",
    "xlaunch.llm.arch": "xlaunch.llm.shapes",
}


def test_old_module_paths_give_the_new_module_with_a_warning() -> None:
    """In a fresh interpreter (nothing imported yet), each old path is the new module itself."""
    script = (
        "import importlib, json, sys, warnings\n"
        f"moved = {OLD_PATHS!r}\n"
        "out = {}\n"
        "for old, new in moved.items():\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    out[old] = [module is importlib.import_module(new),\n"
        "                [str(w.message) for w in seen if w.category is DeprecationWarning]]\n"
        "print(json.dumps(out))\n"
    )
    moved = {old: new for old, new in OLD_PATHS.items() if not (NO_TORCH and new.startswith("xlaunch.kernels"))}
    script = script.replace(f"moved = {OLD_PATHS!r}", f"moved = {moved!r}")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(result.stdout)
    for old, new in moved.items():
        same, messages = seen[old]
        assert same, old
        assert any(f"{old} moved to {new}" in m for m in messages), (old, messages)


def test_an_unknown_old_path_is_still_an_import_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("xlaunch.launcher.no_such_module")


@pytest.mark.parametrize("argv", [["xlaunch", "--version"], [sys.executable, "-m", "xlaunch", "--version"],
                                  ["xlaunch-tune", "--help"], ["xlaunch-record-machine", "--help"]])
def test_entry_points_start(argv: list[str]) -> None:
    if argv[0] != sys.executable:
        argv = [str(Path(sys.executable).parent / argv[0]), *argv[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
