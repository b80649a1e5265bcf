"""Keep pytest out of the recorded trees (thousands of small sysfs files, no tests)."""
from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
collect_ignore = [str(p) for p in _HERE.iterdir() if (p / "sys").is_dir() or (p / "proc").is_dir()]
