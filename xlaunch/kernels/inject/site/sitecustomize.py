"""Started by ``xlaunch --auto-optimize`` (``PYTHONPATH``); see ``xlaunch.kernels.inject``.

1. Runs the ``sitecustomize`` Python would have imported without us, if any (searched on the rest
   of ``sys.path``), so the user's start-up code still runs.
2. Installs the auto-optimize hooks; they wait for the program to import torch.
A failure of step 2 prints one warning and leaves the program to run unchanged.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize():
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _run_shadowed_sitecustomize()
except Exception as _exc:  # as Python's site module does: report and go on
    sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(_exc).__name__}: {_exc}\n")

try:
    from xlaunch.kernels.inject import hooks as _autooptimize

    _autooptimize.install_from_environment()
except Exception as _exc:  # the program must run even when injection cannot
    sys.stderr.write(f"xlaunch --auto-optimize: not active ({type(_exc).__name__}: {_exc})\n")
