"""Write pytest's assertion-rewritten bytecode of the test modules before the test run.

pytest rewrites every test module's asserts when it imports it, and caches the result beside it
(``__pycache__/*.<tag>-pytest-<version>.pyc``, checked by source hash) unless bytecode writing is off
(``PYTHONDONTWRITEBYTECODE``, common on CI). It reads that cache either way. Each xdist worker collects
every module, so without the cache each one rewrites them all: about 12 s a worker on the AVX2 VM.
Written here once, in parallel; anything unexpected (another pytest's internals) writes nothing.

    python scripts/rewrite_tests.py [tests]
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace


def rewrite_one(path: str) -> bool:
    """Rewrite one module into pytest's cache beside it (False when it could not)."""
    from _pytest.assertion import rewrite

    source = Path(path)
    cache = rewrite.get_cache_dir(source)
    try:
        cache.mkdir(exist_ok=True)
        source_hash, code = rewrite._rewrite_test(source, None)
    except (OSError, SyntaxError):
        return False
    return rewrite._write_pyc(SimpleNamespace(trace=lambda message: None), code, source_hash,
                              cache / (source.name[:-3] + rewrite.PYC_TAIL))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "tests").resolve()        # code objects name files as pytest does
    try:
        from _pytest.assertion import rewrite

        for name in ("_rewrite_test", "_write_pyc", "get_cache_dir", "PYC_TAIL"):
            getattr(rewrite, name)
    except (ImportError, AttributeError):
        return 0
    files = sorted(str(p) for p in root.rglob("*.py") if p.name == "conftest.py" or p.name.startswith("test_"))
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    with ProcessPoolExecutor(workers) as pool:
        written = sum(pool.map(rewrite_one, files, chunksize=4))
    print(f"rewrite_tests: {written} of {len(files)} test modules' rewritten bytecode cached", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
