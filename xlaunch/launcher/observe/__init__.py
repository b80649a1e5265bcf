"""What really ran: libraries, threads' CPUs and memory read from ``/proc`` while instances run
(:mod:`.procfs`, :mod:`.observer`), the summary table and JSON (:mod:`.summary`), and the
``--check-isa --probe`` measurement (:mod:`.probe`)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "Observer": "xlaunch.launcher.observe.observer",
    "Observed": "xlaunch.launcher.observe.observer",
    "compare": "xlaunch.launcher.observe.observer",
    "cells": "xlaunch.launcher.observe.observer",
    "to_json": "xlaunch.launcher.observe.observer",
    "sample": "xlaunch.launcher.observe.procfs",
    "run_probe": "xlaunch.launcher.observe.probe",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
