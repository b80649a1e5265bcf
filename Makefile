# The two commands README.md starts with. Both set up whatever they need first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/xlaunch --ninstances 2 --ncore_per_instance 1 examples/infer.py

test: setup
	.venv/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) bench/launch.py
	$(PY) bench/throughput.py
	$(PY) bench/streams.py
	LD_PRELOAD=$$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -1) $(PY) bench/optimize.py
	.venv/bin/xlaunch --ninstances 1 bench/ops.py

clean:
	rm -rf .venv build *.egg-info
