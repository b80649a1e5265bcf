# The two commands README.md starts with. Both set up whatever they need first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/xlaunch --ninstances 2 --ncore_per_instance 1 examples/infer.py

# lint-imports: the layers (pyproject.toml). compileall: the bytecode every test subprocess would
# otherwise compile again (PYTHONDONTWRITEBYTECODE is common on CI). Two workers, one file each.
# --no-loadscope-reorder: files in the order tests/conftest.py gives (slowest first), not by test count.
test: setup
	.venv/bin/lint-imports --no-cache
	$(PY) -m compileall -q xlaunch tests examples >/dev/null
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=12 tests

bench: setup
	$(PY) bench/launch.py
	$(PY) bench/throughput.py
	$(PY) bench/streams.py
	LD_PRELOAD=$$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -1) $(PY) bench/optimize.py
	.venv/bin/xlaunch --ninstances 1 bench/ops.py

clean:
	rm -rf .venv build *.egg-info
