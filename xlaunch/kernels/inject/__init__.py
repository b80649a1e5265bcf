"""``xlaunch --auto-optimize``: the environment that injects the optimizer library into an
unmodified Python program.

Runs in the launcher, so it imports neither torch nor the rest of ``xlaunch.kernels``. The child
finds our ``sitecustomize`` first on ``PYTHONPATH`` (the user's entries follow, unchanged); it
runs the user's own ``sitecustomize`` if one exists further down the path, then installs the hooks
of :mod:`xlaunch.kernels.inject.hooks`, configured by the variables below. Every instance gets
the same ``XLAUNCH_CACHE_DIR`` (the user's, else the default folder spelled out), so the engine
chosen for a model is built by one instance and loaded by the others and by later runs.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
SITE_DIR = os.path.join(_HERE, "site")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))   # holds xlaunch/

DTYPE_ENV = "XLAUNCH_AUTO_OPTIMIZE"                 # float32 | bfloat16
VERBOSE_ENV = "XLAUNCH_AUTO_OPTIMIZE_VERBOSE"       # 1 when --auto-optimize-verbose
FREEZE_ENV = "XLAUNCH_AUTO_OPTIMIZE_FREEZE"         # jit | inductor | none (user may set it)
BACKEND_ENV = "XLAUNCH_AUTO_OPTIMIZE_BACKEND"       # auto (default) | torch | a route | routes, comma-separated
BUDGET_ENV = "XLAUNCH_AUTO_OPTIMIZE_BUDGET"         # seconds auto may spend per model (default 120)
CACHE_ENV = "XLAUNCH_CACHE_DIR"                     # the engine cache every instance shares
LLM_WEIGHTS_ENV = "XLAUNCH_AUTO_OPTIMIZE_LLM_WEIGHTS"  # Hugging Face decoders: int8 | int4 (default: the dtype's)
RECORD_ENV = "XLAUNCH_AUTO_OPTIMIZE_RECORD"         # set by the runner: the file an instance appends its engines to
MAX_RECORD_BYTES = 1 << 20
MAX_RECORDS = 64
DTYPES = ("float32", "bfloat16")
FREEZE_BACKENDS = ("jit", "inductor", "none")
LLM_WEIGHTS = ("int8", "int4")
DEFAULT_BUDGET_S = 120.0


def read_variables(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``XLAUNCH_AUTO_OPTIMIZE_*`` settings in ``environ`` (defaults for unset or empty ones):
    ``dtype``, ``freeze``, ``backend`` (a name or a list of routes), ``budget`` (seconds),
    ``llm_weights`` (None or a name). A bad value is one ValueError naming the variable (the launcher
    refuses it before starting anything; torch-free)."""
    from xlaunch.kernels.optimize.engines.report import ROUTES

    dtype = environ.get(DTYPE_ENV, "") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"{DTYPE_ENV} must be one of {', '.join(DTYPES)}, not {dtype!r}")
    freeze = environ.get(FREEZE_ENV, "") or "jit"
    if freeze not in FREEZE_BACKENDS:
        raise ValueError(f"{FREEZE_ENV} must be one of {', '.join(FREEZE_BACKENDS)}, not {freeze!r}")
    text = (environ.get(BACKEND_ENV, "") or "auto").strip() or "auto"
    backend: Any = text
    if "," in text:
        backend = [name.strip() for name in text.split(",") if name.strip()]
        if not backend or any(name not in ROUTES for name in backend):
            raise ValueError(f"{BACKEND_ENV} must be auto, one route or routes separated by commas "
                             f"(routes: {', '.join(ROUTES)}), not {text!r}")
    elif text not in ("auto", *ROUTES):
        raise ValueError(f"{BACKEND_ENV} must be auto or one of {', '.join(ROUTES)} (or several, "
                         f"separated by commas), not {text!r}")
    raw = environ.get(BUDGET_ENV, "") or str(DEFAULT_BUDGET_S)
    try:
        budget = float(raw)
    except ValueError:
        budget = math.nan
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"{BUDGET_ENV} must be a number of seconds > 0, not {raw!r}")
    weights = environ.get(LLM_WEIGHTS_ENV, "") or None
    if weights is not None and weights not in LLM_WEIGHTS:
        raise ValueError(f"{LLM_WEIGHTS_ENV} must be int8 or int4, not {weights!r}")
    return {"dtype": dtype, "freeze": freeze, "backend": backend, "budget": budget, "llm_weights": weights}


def injection_env(environ: Mapping[str, str], *, dtype: Optional[str], verbose: bool) -> dict[str, str]:
    """Variables to add to each instance's environment (``PYTHONPATH`` keeps the user's entries).
    A bad ``dtype`` or ``XLAUNCH_AUTO_OPTIMIZE_*`` value in ``environ`` is one ValueError naming it
    (each instance would otherwise run unoptimized, or give each model up)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    read_variables({**environ, DTYPE_ENV: dtype or "float32"})
    user = [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    entries = [SITE_DIR] + [entry for entry in user if entry != SITE_DIR]
    # last, so it never shadows the user's modules: xlaunch itself for the child's sitecustomize
    if PACKAGE_PARENT not in entries:
        entries.append(PACKAGE_PARENT)
    env = {"PYTHONPATH": os.pathsep.join(entries), DTYPE_ENV: dtype or "float32"}
    if not environ.get(CACHE_ENV):   # one cache folder for every instance: the first builds, the rest load
        from xlaunch.kernels.optimize.engines.cache import cache_dir

        env[CACHE_ENV] = cache_dir(environ)
    if verbose:
        env[VERBOSE_ENV] = "1"
    return env


def append_record(item: dict) -> None:
    """In an instance: the engine a model runs on, for the launcher's summary (one JSON line appended
    to the file ``XLAUNCH_AUTO_OPTIMIZE_RECORD`` names, set by the runner; never through a link)."""
    path = os.environ.get(RECORD_ENV, "")
    if not path:
        return
    import json

    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (json.dumps(item) + "\n").encode("utf-8"))
        finally:
            os.close(fd)
    except OSError:   # the summary just lacks the line
        pass


def read_records(path: str) -> list[dict]:
    """What an instance wrote to its ``XLAUNCH_AUTO_OPTIMIZE_RECORD`` file: one object per model it
    optimized (``module``, ``backend``, ``cache``, ``reason``), in order; [] when none (no file, or
    lines that are not such objects, are skipped). Read without following a symlink, at most
    :data:`MAX_RECORD_BYTES`, at most :data:`MAX_RECORDS` objects."""
    import json
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        data = os.read(fd, MAX_RECORD_BYTES)
    finally:
        os.close(fd)
    records = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("backend"), str):
            records.append({key: item.get(key) for key in ("module", "backend", "cache", "reason")})
        if len(records) >= MAX_RECORDS:
            break
    return records
