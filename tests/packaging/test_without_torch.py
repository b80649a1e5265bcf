"""Without torch, the lazy exports raise one ImportError naming the extra (fast, no wheel:
``sys.modules["torch"] = None`` makes ``import torch`` fail like a missing install)."""
from __future__ import annotations

import subprocess
import sys

import pytest

HINT = 'pip install "xlaunch[torch]"'
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("expression", ["xlaunch.optimize", "xlaunch.MultiStreamModule",
                                        "xlaunch.kernels.FusedSGD", "xlaunch.kernels.to_fused"])
def test_one_import_error_names_the_extra(expression):
    result = python(f"import xlaunch, xlaunch.kernels\n{expression}\n")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"ImportError: {expression} needs PyTorch, which is not installed here: {HINT}"), result.stderr


def test_what_does_not_need_torch_still_loads():
    result = python("import xlaunch\nprint(xlaunch.CPUPool, xlaunch.Task, xlaunch.pin)\n"
                    "from xlaunch.launcher.machine import load_machine; load_machine()\n")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_other_missing_modules_are_not_disguised():
    from xlaunch._torch import load_attribute

    with pytest.raises(ModuleNotFoundError, match="no_such_xlaunch_module"):
        load_attribute("xlaunch.no_such_xlaunch_module", "x", "xlaunch.x")
