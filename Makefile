# The two commands README.md starts with. Both set up whatever they need first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

# The example CNN as 2 pinned instances x 1 core, then the same workload beside plain python and torch's
# run_cpu at the same shape: aggregate img/s over one shared window, ratios printed (about a minute).
demo: setup
	.venv/bin/xlaunch --ninstances 2 --ncores-per-instance 1 examples/infer.py
	@echo "demo: compare: plain python, xlaunch 2x1 and run_cpu 2x1, 2 interleaved rounds of 2-second windows"
	$(PY) bench/throughput.py --quick --only 'plain python' --only 'xlaunch 2x1' --only 'run_cpu 2x1'

# lint-imports: the layers (pyproject.toml). compileall: the bytecode every test subprocess would
# otherwise compile again (PYTHONDONTWRITEBYTECODE is common on CI); scripts/rewrite_tests.py: pytest's
# assertion-rewritten test modules, which every worker would rewrite (3 s once against 12 s a worker).
# Workers: one more than the CPUs this process may use, at most 4: a quarter of the suite's wall time
# waits on child processes (start-up, grace periods, signals), and a third worker fills it (2 vCPUs,
# Zen 5 VM: 147 s with 2 workers, 122-132 s with 3; under a 0.95-CPU quota, 247 against 234 s); each
# worker takes one file at a time.
# --no-loadscope-reorder: files in the order tests/conftest.py gives (slowest first), not by test count.
# The live tests whose expectations depend on how many CPUs there are (pinning, OpenMP places,
# pools, ranks), once more under a 1-CPU mask: the last allowed CPU (not CPU 0). About 20 s of
# wall time, run beside the main run (not after it); its output is shown at the end.
ONE_CPU_TESTS := tests/runtime_ext/test_runtime_pool.py tests/runtime_ext/test_runtime_pinning.py \
	tests/runtime_ext/test_runtime_topology.py tests/runtime_ext/test_runtime_task.py tests/machine/test_machine_live.py \
	tests/launcher/cli/test_cli.py::test_each_instance_openmp_places_are_its_own_cpus \
	tests/launcher/cli/test_cli.py::test_launcher_never_imports_torch \
	tests/launcher/cli/test_cli.py::test_taskset_restricted_launcher_plans_inside_its_cpu \
	tests/launcher/distributed/test_ranks.py::test_no_torch_on_the_planning_paths \
	tests/launcher/run/test_runner.py::test_native_binding_pins_each_instance_to_its_cpus_and_memory \
	tests/launcher/run/test_runner.py::test_affinity_read_from_outside_while_instances_run \
	tests/launcher/run/test_runner.py::test_bind_none_leaves_affinity_alone \
	tests/launcher/run/test_startup_signals.py::test_kill_9_of_xlaunch_leaves_nothing_running

test: setup
	.venv/bin/lint-imports --no-cache
	$(PY) -m compileall -q xlaunch tests examples >/dev/null
	$(PY) scripts/rewrite_tests.py tests
	@one_cpu_log=$$(mktemp); \
	cpu=$$($(PY) -c 'import os; print(max(os.sched_getaffinity(0)))'); \
	workers=$$($(PY) -c 'import os; print(min(4, len(os.sched_getaffinity(0)) + 1))'); \
	( start=$$(date +%s); taskset -c $$cpu $(PY) -m pytest -q -p no:cacheprovider -k 'not recorded_machines' \
	  $(ONE_CPU_TESTS) >$$one_cpu_log 2>&1; code=$$?; \
	  echo "1-CPU run (taskset -c $$cpu): $$(( $$(date +%s) - start )) s wall" >>$$one_cpu_log; exit $$code ) & one_cpu=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -n $$workers --dist loadfile --no-loadscope-reorder --durations=25 tests; main=$$?; \
	wait $$one_cpu; single=$$?; \
	if [ $$single -eq 0 ]; then tail -n 2 $$one_cpu_log; else cat $$one_cpu_log; fi; rm -f $$one_cpu_log; \
	[ $$main -eq 0 ] && [ $$single -eq 0 ]

bench: setup
	$(PY) bench/launch.py
	$(PY) bench/throughput.py
	$(PY) bench/streams.py
	LD_PRELOAD=$$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -1) $(PY) bench/optimize.py
	.venv/bin/xlaunch --ninstances 1 bench/ops.py

clean:
	rm -rf .venv build *.egg-info
