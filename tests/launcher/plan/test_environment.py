"""Instance environment: OpenMP/allocator variables, never overriding what the user set."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_machines import LIBS_ALL, synthetic_machine

from xlaunch.launcher.plan.environment import (
    GLIBC_TUNABLES_VALUE,
    JEMALLOC_CONF,
    JEMALLOC_CONF_BENCHMARK,
    choose_runtime,
    instance_environment,
    runtime_variables,
    team_places,
)
from xlaunch.launcher.errors import PlanError
from xlaunch.machine.model import Library
from xlaunch.launcher.plan.options import Options
from xlaunch.launcher.plan.planner import plan

JEMALLOC = LIBS_ALL[0].path
IOMP = LIBS_ALL[2].path
NO_LIBS = synthetic_machine(nodes=1, cores_per_l3=4, smt=1, libraries=())
ALL_LIBS = synthetic_machine(nodes=1, cores_per_l3=4, smt=1)


def test_gnu_openmp_places_and_binding() -> None:
    runtime = choose_runtime(ALL_LIBS, omp_runtime="default")
    env = instance_environment({}, runtime, cpus=(2, 3), index=1, ninstances=2).env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert env["OMP_PROC_BIND"] == "close" and env["OMP_PLACES"] == "{2},{3}"
    assert "KMP_AFFINITY" not in env
    assert env["LD_PRELOAD"] == JEMALLOC
    assert (env["XLAUNCH_INSTANCE_INDEX"], env["XLAUNCH_NINSTANCES"], env["XLAUNCH_CPUS"]) == ("1", "2", "2-3")


def test_intel_openmp_preloaded_with_kmp_settings() -> None:
    runtime = choose_runtime(ALL_LIBS)          # auto: libiomp5 is there
    env = instance_environment({}, runtime, cpus=(0, 1), index=0, ninstances=1).env
    assert env["LD_PRELOAD"].split(":") == [JEMALLOC, IOMP]
    assert env["KMP_AFFINITY"] == "granularity=fine,proclist=[{0,1},1],explicit" and env["KMP_BLOCKTIME"] == "1"
    assert "OMP_PLACES" not in env


def test_intel_names_the_cpus_with_or_without_external_binding() -> None:
    runtime = choose_runtime(ALL_LIBS, omp_runtime="intel")
    env = runtime_variables(runtime, (4, 5, 6), 0, 1)
    assert env["KMP_AFFINITY"] == "granularity=fine,proclist=[{4,5,6},5,6],explicit"


def test_intel_proclist_binds_workers_and_leaves_the_master_the_whole_instance() -> None:
    assert team_places((7,)) == "{7}"
    assert team_places((0, 1, 2, 3)) == "{0,1,2,3},1,2,3"
    assert team_places((8, 10, 12)) == "{8,10,12},10,12"


def test_auto_falls_back_to_gnu_and_tuned_glibc_without_libraries() -> None:
    runtime = choose_runtime(NO_LIBS)
    assert (runtime.openmp, runtime.allocator) == ("gnu", "glibc")
    env = instance_environment({}, runtime, cpus=(0,), index=0, ninstances=1).env
    assert env["GLIBC_TUNABLES"] == GLIBC_TUNABLES_VALUE and "LD_PRELOAD" not in env
    assert any("GLIBC_TUNABLES" in w for w in runtime.warnings)


def test_default_allocator_touches_nothing() -> None:
    runtime = choose_runtime(ALL_LIBS, memory_allocator="default", omp_runtime="default")
    env = runtime_variables(runtime, (0,), 0, 1)
    assert not {"LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES"} & set(env)


def test_tcmalloc_falls_back_to_minimal_and_benchmark_tunes_allocators() -> None:
    runtime = choose_runtime(ALL_LIBS, memory_allocator="tcmalloc", omp_runtime="default", benchmark=True)
    assert runtime.allocator == "tcmalloc_minimal"
    assert runtime_variables(runtime, (0,), 0, 1)["TCMALLOC_RELEASE_RATE"] == "0"
    je = choose_runtime(ALL_LIBS, benchmark=True)
    assert runtime_variables(je, (0,), 0, 1)["MALLOC_CONF"] == JEMALLOC_CONF_BENCHMARK
    assert runtime_variables(choose_runtime(ALL_LIBS), (0,), 0, 1)["MALLOC_CONF"] == JEMALLOC_CONF


@pytest.mark.parametrize("option, value", [("memory_allocator", "jemalloc"), ("memory_allocator", "tcmalloc"),
                                           ("omp_runtime", "intel")])
def test_requested_library_missing_is_an_error(option: str, value: str) -> None:
    with pytest.raises(PlanError) as err:
        choose_runtime(NO_LIBS, **{option: value})
    assert err.value.option == "--" + option.replace("_", "-")
    assert "not found" in err.value.problem


def test_user_ld_preload_entries_are_kept_after_ours() -> None:
    runtime = choose_runtime(ALL_LIBS, omp_runtime="default")
    result = instance_environment({"LD_PRELOAD": "/opt/libfoo.so /opt/libbar.so"}, runtime,
                                  cpus=(0,), index=0, ninstances=1)
    assert result.env["LD_PRELOAD"] == f"{JEMALLOC}:/opt/libfoo.so:/opt/libbar.so"


def test_user_allocator_in_ld_preload_is_respected() -> None:
    environ = {"LD_PRELOAD": "/opt/mimalloc/libmimalloc.so"}
    runtime = choose_runtime(ALL_LIBS, omp_runtime="default", environ=environ)
    assert runtime.allocator == "user"
    env = instance_environment(environ, runtime, cpus=(0,), index=0, ninstances=1).env
    assert env["LD_PRELOAD"] == "/opt/mimalloc/libmimalloc.so" and "MALLOC_CONF" not in env
    assert any("libmimalloc" in w for w in runtime.warnings)


def test_already_preloaded_iomp_is_not_added_twice() -> None:
    runtime = choose_runtime(ALL_LIBS, memory_allocator="default")
    env = instance_environment({"LD_PRELOAD": "/elsewhere/libiomp5.so"}, runtime, cpus=(0,), index=0,
                               ninstances=1).env
    assert env["LD_PRELOAD"] == "/elsewhere/libiomp5.so"


LIBOMP = "/usr/lib/llvm-16/lib/libomp.so.5"


@pytest.mark.parametrize("name", ["libomp.so.5", "libomp.so", "libomp-16.so.5"])
def test_llvm_openmp_in_ld_preload_is_kept_with_intels_variables(name: str) -> None:
    environ = {"LD_PRELOAD": f"/opt/llvm/lib/{name}"}
    runtime = choose_runtime(ALL_LIBS, environ=environ)
    assert (runtime.openmp, runtime.openmp_library) == ("llvm", None)
    assert runtime.warnings == (f"kept the OpenMP runtime in your LD_PRELOAD (/opt/llvm/lib/{name}); "
                                "not adding Intel OpenMP",)
    env = instance_environment(environ, runtime, cpus=(2, 3), index=0, ninstances=1).env
    assert env["LD_PRELOAD"] == f"{JEMALLOC}:/opt/llvm/lib/{name}"        # no libiomp5 beside it
    assert env["KMP_AFFINITY"] == "granularity=fine,proclist=[{2,3},3],explicit" and env["KMP_BLOCKTIME"] == "1"
    assert "OMP_PLACES" not in env


def test_a_preloaded_openmp_against_the_asked_runtime() -> None:
    with pytest.raises(PlanError) as error:     # two runtimes in one process: refused, nothing planned
        choose_runtime(ALL_LIBS, omp_runtime="intel", environ={"LD_PRELOAD": LIBOMP})
    assert error.value.option == "--omp-runtime" and LIBOMP in str(error.value)
    runtime = choose_runtime(ALL_LIBS, omp_runtime="default", environ={"LD_PRELOAD": LIBOMP})
    assert runtime.openmp == "llvm" and "not torch's own libgomp" in runtime.warnings[0]
    # Intel's elsewhere: that one runs, not a second copy, without a word
    runtime = choose_runtime(ALL_LIBS, omp_runtime="intel", environ={"LD_PRELOAD": "/elsewhere/libiomp5.so"})
    assert (runtime.openmp, runtime.openmp_library, runtime.warnings) == ("intel", None, ())
    # libgomp is preloaded for other reasons too (its static TLS): Intel's still goes first, as before
    runtime = choose_runtime(ALL_LIBS, environ={"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libgomp.so.1"})
    assert (runtime.openmp, runtime.openmp_library) == ("intel", IOMP)
    # names that only look alike are not runtimes
    runtime = choose_runtime(ALL_LIBS, environ={"LD_PRELOAD": "/opt/libompitt.so:/opt/libomptarget.so"})
    assert (runtime.openmp, runtime.openmp_library) == ("intel", IOMP)


USER_VARIABLES = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY",
                  "KMP_BLOCKTIME", "MALLOC_CONF", "GLIBC_TUNABLES", "TCMALLOC_RELEASE_RATE"]


@settings(max_examples=60, deadline=None)
@given(
    user=st.dictionaries(st.sampled_from(USER_VARIABLES), st.text("abc123,:=", min_size=1, max_size=8)),
    omp=st.sampled_from(["auto", "default", "intel"]),
    alloc=st.sampled_from(["auto", "default", "jemalloc", "tcmalloc"]),
    libs=st.booleans(),
    benchmark=st.booleans(),
)
def test_user_values_are_never_overridden(user, omp, alloc, libs, benchmark) -> None:
    machine = ALL_LIBS if libs else NO_LIBS
    try:
        runtime = choose_runtime(machine, memory_allocator=alloc, omp_runtime=omp, benchmark=benchmark)
    except PlanError:
        assert not libs and (alloc in ("jemalloc", "tcmalloc") or omp == "intel")
        return
    result = instance_environment(user, runtime, cpus=(0, 1), index=0, ninstances=1)
    for name, value in user.items():
        assert result.env[name] == value
        assert name not in result.added
    wanted = runtime_variables(runtime, (0, 1), 0, 1)
    assert set(result.kept) == {n for n in user if n in wanted and wanted[n] != user[n]}


def test_plan_reports_kept_variables_as_warnings() -> None:
    p = plan(Options(program="x.py", ninstances=2), ALL_LIBS, {"OMP_NUM_THREADS": "7", "PATH": "/bin"})
    assert p.env_kept == {"OMP_NUM_THREADS": "7"}
    assert all(i.env["OMP_NUM_THREADS"] == "7" for i in p.instances)
    assert any("kept your OMP_NUM_THREADS=7" in w for w in p.warnings)
    assert "OMP_NUM_THREADS" not in p.env_set
    assert p.env_set["KMP_BLOCKTIME"] == "1"
    assert "KMP_AFFINITY" not in p.env_set            # names each instance's CPUs
    assert "XLAUNCH_CPUS" not in p.env_set            # differs per instance


def test_plan_with_bind_none_uses_explicit_cpu_places() -> None:
    p = plan(Options(program="x.py", ninstances=2, bind_with="none"), ALL_LIBS)
    assert [i.env["KMP_AFFINITY"] for i in p.instances] == [
        "granularity=fine,proclist=[{0,1},1],explicit", "granularity=fine,proclist=[{2,3},3],explicit"]
    assert all(i.membind == "none" and i.bind == "none" for i in p.instances)


def test_library_preference_order() -> None:
    only_tc = synthetic_machine(nodes=1, cores_per_l3=1, smt=1, libraries=(
        Library("tcmalloc_minimal", "/m.so", "x"), Library("tcmalloc", "/full.so", "x")))
    assert choose_runtime(only_tc).allocator_library == "/full.so"


def test_a_library_in_a_folder_with_a_space_is_preloaded_by_name_through_ld_library_path() -> None:
    """The loader splits LD_PRELOAD at spaces (and colons) with no escape: '/home/me/My Projects/.venv/lib/
    libiomp5.so' would be two missing files in every instance, and Intel OpenMP not loaded at all."""
    spaced = "/home/me/My Projects/.venv/lib"
    machine = synthetic_machine(nodes=1, cores_per_l3=4, smt=1, libraries=(
        LIBS_ALL[0], Library("iomp", f"{spaced}/libiomp5.so", "venv")))
    runtime = choose_runtime(machine)
    assert runtime.openmp == "intel" and runtime.openmp_library == f"{spaced}/libiomp5.so"
    env = instance_environment({"LD_LIBRARY_PATH": "/opt/cuda/lib64"}, runtime, cpus=(0, 1), index=0,
                               ninstances=1).env
    assert env["LD_PRELOAD"] == f"{JEMALLOC}:libiomp5.so"
    assert env["LD_LIBRARY_PATH"] == f"{spaced}:/opt/cuda/lib64"       # ours first, the user's kept
    assert all(" " not in entry for entry in env["LD_PRELOAD"].split(":"))
    plain = instance_environment({}, choose_runtime(ALL_LIBS), cpus=(0,), index=0, ninstances=1).env
    assert "LD_LIBRARY_PATH" not in plain


def test_a_library_path_with_a_colon_is_passed_over_with_a_warning() -> None:
    machine = synthetic_machine(nodes=1, cores_per_l3=4, smt=1, libraries=(
        Library("jemalloc", "/opt/a:b/libjemalloc.so.2", "LD_LIBRARY_PATH"), LIBS_ALL[1],
        Library("iomp", "/opt/a:b/libiomp5.so", "LD_LIBRARY_PATH")))
    runtime = choose_runtime(machine)
    assert (runtime.allocator, runtime.openmp) == ("tcmalloc_minimal", "gnu")
    assert sum("cannot be preloaded" in w and "a:b" in w for w in runtime.warnings) == 2
    with pytest.raises(PlanError, match="Intel OpenMP"):
        choose_runtime(machine, omp_runtime="intel")
