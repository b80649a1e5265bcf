"""``LD_PRELOAD`` for the tests that preload a library themselves, written as xlaunch writes it
(:func:`xlaunch.launcher.plan.environment.preload_names`): the loader splits ``LD_PRELOAD`` at spaces,
so a library under a path with one (a checkout under "My Projects", its venv's ``libiomp5.so``) goes by
file name, its folder first in ``LD_LIBRARY_PATH``; and the environment of a test that chooses the OpenMP
runtime and preloads itself (:func:`without_openmp_and_preloads`). Imported by name, like host_cpus."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from xlaunch.launcher.plan.environment import library_path, preload_names


def preload(*paths: str, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``{"LD_PRELOAD": ...}`` for ``paths``, with ``LD_LIBRARY_PATH`` (before ``base``'s, default this
    environment's) where a path has a space."""
    entries, folders = preload_names(paths)
    env = {"LD_PRELOAD": ":".join(entries)}
    if folders:
        env["LD_LIBRARY_PATH"] = library_path(folders, (os.environ if base is None else base).get("LD_LIBRARY_PATH", ""))
    return env


OPENMP_AND_PRELOAD_PREFIXES = ("XLAUNCH_", "OMP_", "KMP_", "GOMP_", "LD_PRELOAD")


def without_openmp_and_preloads(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``environ`` (default: this one) without xlaunch's, OpenMP's and the loader's preload variables: a
    launch under it gets only what the plan sets."""
    return {k: v for k, v in (os.environ if environ is None else environ).items()
            if not k.startswith(OPENMP_AND_PRELOAD_PREFIXES)}
