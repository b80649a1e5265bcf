"""Observation of running instances: parsers on recorded /proc text, merging, plan comparison."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from xlaunch.launcher.observe.observer import Observed, Observer, cells, compare, to_json
from xlaunch.launcher.observe.procfs import (
    ProcessSample,
    Sample,
    anonymous_memory_by_node,
    exiting,
    last_cpu,
    library_kind,
    mapped_file_memory_by_node,
    mapped_libraries,
    preload_kinds,
    resolved,
    split_openmp,
)

VENV = "/opt/venv/lib"
GOMP = f"{VENV}/python3.11/site-packages/torch/lib/libgomp.so.1"
IOMP = f"{VENV}/libiomp5.so"
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"

# A torch process with libiomp5 and jemalloc preloaded (trimmed /proc/PID/maps).
MAPS = f"""\
55d0c8a00000-55d0c8a2e000 r--p 00000000 fe:00 1311       /usr/bin/python3.11
55d0ca1f3000-55d0ca5e1000 rw-p 00000000 00:00 0          [heap]
7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0
7f3a2c000000-7f3a2c01f000 r--p 00000000 fe:00 88         {GOMP}
7f3a2c01f000-7f3a2c049000 r-xp 0001f000 fe:00 88         {GOMP}
7f3a2c049000-7f3a2c04a000 rw-p 00049000 fe:00 88         {GOMP}
7f3a30000000-7f3a3004c000 r--p 00000000 fe:00 91         {IOMP}
7f3a3004c000-7f3a30100000 r-xp 0004c000 fe:00 91         {IOMP}
7f3a40000000-7f3a40010000 r-xp 00000000 fe:00 95         {JEMALLOC}
7f3a50000000-7f3a50010000 r-xp 00000000 fe:00 97         /usr/lib/x86_64-linux-gnu/libc.so.6
7f3a51000000-7f3a51010000 r-xp 00000000 fe:00 98         /tmp/build/libomp.so (deleted)
7f3a52000000-7f3a52010000 r-xp 00000000 fe:00 99         /usr/lib/llvm/libomptarget.so
7ffc1e5f1000-7ffc1e612000 rw-p 00000000 00:00 0          [stack]
"""

NUMA_MAPS = f"""\
55d0c8a00000 default file=/usr/bin/python3.11 mapped=46 mapmax=3 N0=40 N1=6 kernelpagesize_kB=4
55d0ca1f3000 default heap anon=1006 dirty=1006 N0=1000 N1=6 kernelpagesize_kB=4
7f3a10000000 bind:0 anon=33 dirty=33 N0=33 kernelpagesize_kB=4
7f3a10021000 bind:0
7f3a2c000000 default file={GOMP} mapped=31 mapmax=2 N1=31 kernelpagesize_kB=4
7f3a60000000 interleave:0-1 anon=262144 dirty=262144 N0=131072 N1=131072 kernelpagesize_kB=4
7f3a80000000 default file=/anon_hugepage\\040(deleted) huge anon=4 dirty=4 N1=4 kernelpagesize_kB=2048
7f3a90000000 default file=/dev/shm/torch_123_456 dirty=512 N1=512 kernelpagesize_kB=4
7ffc1e5f1000 default stack anon=12 dirty=12 N0=12 kernelpagesize_kB=4
"""


# ---------------------------------------------------------------------------------- parsers


@pytest.mark.parametrize("name, kind", [
    ("libjemalloc.so.2", "jemalloc"),
    ("/usr/lib/libjemalloc.so", "jemalloc"),
    ("libtcmalloc.so.4", "tcmalloc"),
    ("libtcmalloc_minimal.so.4.5.9", "tcmalloc_minimal"),
    ("libtcmalloc_minimal_debug.so.4", "tcmalloc_minimal"),
    ("libtcmalloc_and_profiler.so.4", "tcmalloc"),
    ("libmimalloc.so.2", "mimalloc"),
    ("libgomp.so.1", "gomp"),
    ("libgomp-a34b3233.so.1", "gomp"),
    ("libiomp5.so", "iomp"),
    ("libomp.so.5", "omp"),
    ("libomp-3a1b2c.so", "omp"),
    ("libomptarget.so", None),
    ("libc.so.6", None),
    ("libgomp.spec", None),
    ("mylibgomp.so.1", None),
])
def test_library_kind(name, kind):
    assert library_kind(name) == kind


def test_mapped_libraries_each_path_once_in_address_order():
    assert mapped_libraries(MAPS) == [
        ("gomp", GOMP), ("iomp", IOMP), ("jemalloc", JEMALLOC), ("omp", "/tmp/build/libomp.so"),
    ]


def test_mapped_libraries_of_empty_maps():
    assert mapped_libraries("") == []


def test_anonymous_memory_counts_anonymous_and_private_hugetlb_only():
    page = 4096
    by_node = anonymous_memory_by_node(NUMA_MAPS, page_size=page)
    assert by_node == {
        0: (1000 + 33 + 131072 + 12) * page,
        1: (6 + 131072) * page + 4 * 2048 * 1024,
    }


def test_anonymous_memory_falls_back_to_the_page_size_given():
    assert anonymous_memory_by_node("7f00 default anon=3 dirty=3 N2=3\n", page_size=65536) == {2: 3 * 65536}


def test_anonymous_memory_of_empty_text():
    assert anonymous_memory_by_node("") == {}


MODEL = "/data/models/llama-1b.xlp"
FILE_NUMA_MAPS = f"""\
7f0000000000 default file={MODEL} mapped=262144 mapmax=4 N0=200000 N1=62144 kernelpagesize_kB=4
7f0040000000 default file={MODEL} mapped=4096 mapmax=4 N1=4096 kernelpagesize_kB=4
7f2000000000 default file=/opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so mapped=30000 N0=30000 kernelpagesize_kB=4
7f3000000000 default file={GOMP} mapped=5000 N1=5000 kernelpagesize_kB=4
7f4000000000 default file=/tmp/small.bin mapped=10 N1=10 kernelpagesize_kB=4
7f5000000000 default file=/data/my\\040model.gguf mapped=8192 N1=8192 kernelpagesize_kB=4
7f5800000000 default file=/data/gone.bin\\040(deleted) mapped=8192 N0=8192 kernelpagesize_kB=4
7f6000000000 default file=/anon_hugepage\\040(deleted) huge anon=40 dirty=40 N1=40 kernelpagesize_kB=2048
7f7000000000 default anon=50000 dirty=50000 N0=50000 kernelpagesize_kB=4
"""


def test_mapped_data_files_by_node_leave_out_libraries_small_files_and_anonymous_memory():
    page = 4096
    assert mapped_file_memory_by_node(FILE_NUMA_MAPS) == {
        MODEL: {0: 200000 * page, 1: (62144 + 4096) * page},     # both mappings of the file
        "/data/my model.gguf": {1: 8192 * page},                  # numa_maps escapes the space
        "/data/gone.bin (deleted)": {0: 8192 * page},
    }
    assert mapped_file_memory_by_node(FILE_NUMA_MAPS, min_bytes=1).keys() >= {"/tmp/small.bin"}
    assert mapped_file_memory_by_node(NUMA_MAPS) == {}          # libraries, the interpreter, 2 MiB of /dev/shm
    assert mapped_file_memory_by_node("") == {}


STAT_TAIL = ("S 2956 2959 2959 0 -1 4194560 5829 241815 0 21 2 5 1165 307 20 0 1 0 51739 5242880 927 "
             "18446744073709551615 94841460453376 94841461242781 140737379879168 0 0 0 65536 4 "
             "1132560123 1 0 0 17 {cpu} 0 0 0 0 0 94841461476080 94841461524324 94842230931456 "
             "140737379883901 140737379883916 140737379883916 140737379885034 0")


def test_last_cpu_is_field_39():
    assert last_cpu("2959 (bash) " + STAT_TAIL.format(cpu=7)) == 7
    assert last_cpu("2959 (python3) " + STAT_TAIL.format(cpu=113)) == 113


def test_last_cpu_with_spaces_and_parentheses_in_the_name():
    assert last_cpu("12 (a) b (c) d) " + STAT_TAIL.format(cpu=3)) == 3


def test_last_cpu_of_an_exited_thread_or_short_line_is_none():
    assert last_cpu("12 (x) " + STAT_TAIL.format(cpu=3).replace("S ", "Z ", 1)) is None
    assert last_cpu("12 (x) S 1 2 3") is None
    assert last_cpu("") is None


def test_exiting_is_pf_exiting_in_field_9_or_a_zombie():
    running = STAT_TAIL.format(cpu=3)                       # flags 4194560: PF_RANDOMIZE | PF_FORKNOEXEC
    assert not exiting("2959 (python3) " + running)
    assert exiting("2959 (python3) " + running.replace(" 4194560 ", f" {4194560 | 0x4} ", 1))
    assert exiting("2959 (a) b) " + running.replace("S ", "Z ", 1))
    assert exiting("2959 (python3) S 1 2") and exiting("")


def test_a_process_whose_threads_all_exit_is_left_out_of_the_sample(monkeypatch):
    """Its maps may be half torn down while they are read (the kernel's per-VMA-lock reads of
    /proc/PID/maps, 6.x): such a sample named no allocator and the run got a false "never mapped".
    A process whose leader alone has exited (``pthread_exit`` from main) is still sampled."""
    import xlaunch.launcher.observe.procfs as procfs

    torn = "\n".join(line for line in MAPS.splitlines() if not line.endswith(("jemalloc.so.2", "iomp5.so", "(deleted)")))
    stat = {"running": "S", "exiting": "R", "zombie": "Z"}
    flags = {"running": 4194560, "exiting": 4194560 | 0x4, "zombie": 4194560 | 0x4}
    for threads, expected in ((("running", "running"), 1), (("exiting", "exiting"), 0), (("zombie", "exiting"), 0),
                              (("zombie", "running"), 1), (("exiting", "running"), 1)):
        texts = {"/proc/77/maps": torn}
        for tid, state in zip((77, 78), threads):
            line = STAT_TAIL.format(cpu=0).replace("S ", stat[state] + " ", 1).replace(" 4194560 ", f" {flags[state]} ", 1)
            texts[f"/proc/77/task/{tid}/stat"] = f"{tid} (python3) {line}"
        monkeypatch.setattr(procfs, "_read", lambda path: texts[path])
        monkeypatch.setattr(procfs, "_list_ints", lambda path: [77, 78])
        monkeypatch.setattr(procfs, "_members", lambda pid, psutil: [pid])
        assert len(procfs.sample(77, memory=False).processes) == expected, threads


def test_preload_kinds_split_like_the_loader():
    value = f"{JEMALLOC} /x/libfoo.so:libiomp5.so  {GOMP}"
    assert preload_kinds(value) == {JEMALLOC: "jemalloc", "libiomp5.so": "iomp", GOMP: "gomp"}
    assert preload_kinds("") == {}


GOMP_LIB = ("gomp", GOMP)
IOMP_LIB = ("iomp", IOMP)
OMP_LIB = ("omp", "/usr/lib/llvm/libomp.so.5")
SYSTEM_GOMP = ("gomp", "/usr/lib/x86_64-linux-gnu/libgomp.so.1")


def test_preloaded_intel_openmp_shadows_torchs_libgomp():
    assert split_openmp([GOMP_LIB, IOMP_LIB], {IOMP: "iomp"}) == ([IOMP], [GOMP])


def test_preloaded_by_bare_file_name_matches_the_mapped_path():
    assert split_openmp([GOMP_LIB, IOMP_LIB], {"libiomp5.so": "iomp"}) == ([IOMP], [GOMP])


def test_preloaded_through_a_symlink_matches_the_mapped_real_path(tmp_path):
    """maps shows the resolved path; LD_PRELOAD may name it through a link (a symlinked venv, /lib).
    (An LD_PRELOAD path cannot hold a space: under a TMPDIR with one, the files go to /tmp.)"""
    import shutil
    import tempfile

    base = tmp_path if " " not in str(tmp_path) else Path(tempfile.mkdtemp(prefix="xlaunch-test-", dir="/tmp"))
    try:
        real = base / "real" / "libiomp5.so"
        real.parent.mkdir()
        real.write_bytes(b"")
        (base / "venv").symlink_to(base / "real")
        preloaded = preload_kinds(str(base / "venv" / "libiomp5.so"))
        mapped = [GOMP_LIB, ("iomp", str(real))]
        assert split_openmp(mapped, preloaded) == ([GOMP, str(real)], [])      # unresolved: no match
        assert split_openmp(mapped, resolved(preloaded)) == ([str(real)], [GOMP])
        assert resolved({"libiomp5.so": "iomp"}) == {"libiomp5.so": "iomp"}
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


def test_nothing_preloaded_leaves_every_runtime_active():
    assert split_openmp([GOMP_LIB, IOMP_LIB], {}) == ([GOMP, IOMP], [])
    assert split_openmp([GOMP_LIB, IOMP_LIB], {JEMALLOC: "jemalloc"}) == ([GOMP, IOMP], [])


def test_preloaded_libgomp_does_not_shadow_intel_or_llvm():
    assert split_openmp([GOMP_LIB, IOMP_LIB, OMP_LIB], {GOMP: "gomp"}) == ([GOMP, IOMP, OMP_LIB[1]], [])


def test_preloaded_libgomp_shadows_another_libgomp_copy():
    assert split_openmp([GOMP_LIB, SYSTEM_GOMP], {SYSTEM_GOMP[1]: "gomp"}) == ([SYSTEM_GOMP[1]], [GOMP])


def test_preloaded_llvm_openmp_shadows_gnu_and_intel():
    assert split_openmp([GOMP_LIB, IOMP_LIB, OMP_LIB], {OMP_LIB[1]: "omp"}) == ([OMP_LIB[1]], [GOMP, IOMP])


def test_a_preloaded_runtime_that_is_not_mapped_shadows_nothing():
    assert split_openmp([GOMP_LIB], {IOMP: "iomp"}) == ([GOMP], [])


# ---------------------------------------------------------------------------------- merging


def process(pid=100, libraries=(), active=(), shadowed=(), threads=((100, 0),), memory=None, files=None):
    return ProcessSample(pid=pid, libraries=tuple(libraries), openmp_active=tuple(active),
                         openmp_shadowed=tuple(shadowed), threads=tuple(threads),
                         memory_by_node=None if memory is None else tuple(sorted(memory.items())),
                         files_by_node=None if files is None else
                         tuple((path, tuple(sorted(nodes.items()))) for path, nodes in sorted(files.items())))


def merged(*samples, mem_nodes=(0,)):
    observer = Observer(100, mem_nodes)
    for i, processes in enumerate(samples):
        observer.add(Sample(pid=100, time=float(i), processes=tuple(processes)))
    return observer.observed


def test_nothing_sampled_is_unknown():
    observed = Observer(100, (0,)).observed
    assert observed.samples == 0 and observed.allocator is None and observed.openmp == ()
    assert observed.remote_memory_pct() is None
    data = to_json(observed)
    assert data["allocator"] is None and data["threads"] == 0 and data["thread_cpus"] == []
    assert data["remote_memory_pct"] is None and data["memory_mib_by_node"] is None


def test_merge_unions_cpus_keeps_max_threads_and_every_library():
    observed = merged(
        [process(threads=((100, 0), (101, 1), (102, 1)), libraries=[("jemalloc", JEMALLOC)])],
        [process(threads=((100, 2), (101, 1)), libraries=[GOMP_LIB], active=[GOMP]),
         process(pid=200, threads=((200, 3),))],
    )
    assert observed.samples == 2
    assert observed.threads == 3 and observed.processes == 2
    assert observed.thread_cpus == (0, 1, 2, 3)
    assert observed.cpus_by_thread == ((100, (0, 2)), (101, (1,)), (102, (1,)), (200, (3,)))
    assert observed.libraries == (("jemalloc", JEMALLOC), GOMP_LIB)
    assert observed.allocator == "jemalloc" and observed.openmp == ("gnu",)
    assert observed.openmp_conflicts == ()


def test_allocator_is_glibc_when_processes_were_read_without_one():
    assert merged([process()]).allocator == "glibc"
    assert merged([]).allocator is None


def test_memory_is_the_last_read_summed_over_processes():
    mib = 1 << 20
    observed = merged(
        [process(memory={0: 900 * mib, 1: 100 * mib})],
        [process(memory={0: 50 * mib, 1: 150 * mib}), process(pid=200, threads=((200, 0),), memory={0: 200 * mib})],
        [process()],                                       # a sample without a memory read keeps the last
    )
    assert observed.memory_by_node == ((0, 250 * mib), (1, 150 * mib))
    assert observed.remote_memory_pct() == 37.5
    assert observed.remote_memory_pct([0, 1]) == 0.0
    assert observed.remote_memory_pct([1]) == 62.5
    assert to_json(observed)["memory_mib_by_node"] == {"0": 250.0, "1": 150.0}


def test_remote_share_is_unknown_without_memory_nodes_or_memory():
    assert merged([process(memory={0: 1 << 20})], mem_nodes=()).remote_memory_pct() is None
    assert merged([process(memory={})]).remote_memory_pct() is None


def test_conflicts_are_per_process_and_shadowed_runtimes_are_not_in_use():
    observed = merged([
        process(libraries=[GOMP_LIB, IOMP_LIB], active=[IOMP], shadowed=[GOMP]),
        process(pid=200, threads=((200, 0),), libraries=[OMP_LIB], active=[OMP_LIB[1]]),
    ])
    assert observed.openmp == ("intel", "llvm")
    assert observed.openmp_shadowed == (GOMP,)
    assert observed.openmp_conflicts == ()
    conflicting = merged([process(libraries=[GOMP_LIB, IOMP_LIB], active=[GOMP, IOMP])])
    assert conflicting.openmp_conflicts == ((100, (GOMP, IOMP)),)
    assert set(conflicting.openmp) == {"gnu", "intel"}


def test_a_runtime_shadowed_in_one_process_but_active_in_another_is_in_use():
    observed = merged([
        process(libraries=[GOMP_LIB, IOMP_LIB], active=[IOMP], shadowed=[GOMP]),
        process(pid=200, threads=((200, 0),), libraries=[GOMP_LIB], active=[GOMP]),
    ])
    assert observed.openmp_shadowed == () and set(observed.openmp) == {"gnu", "intel"}


def test_to_json_has_the_summary_keys_and_is_json():
    observed = merged([process(threads=((100, 1), (101, 0)), libraries=[("jemalloc", JEMALLOC), IOMP_LIB],
                               active=[IOMP], memory={0: 3 << 20, 1: 1 << 20})])
    data = to_json(observed)
    assert {"allocator", "openmp", "threads", "thread_cpus", "remote_memory_pct"} <= set(data)
    assert data["allocator"] == "jemalloc" and data["openmp"] == ["intel"]
    assert data["threads"] == 2 and data["thread_cpus"] == [0, 1]
    assert data["remote_memory_pct"] == 25.0
    assert json.loads(json.dumps(data)) == data


# ---------------------------------------------------------------------------------- compare


def test_compare_nothing_observed_says_nothing():
    assert compare(Observed(), (0, 1), (0,), "jemalloc", "intel") == []


def test_compare_as_planned_says_nothing():
    observed = merged([process(threads=((100, 0), (101, 1)), libraries=[("jemalloc", JEMALLOC), GOMP_LIB, IOMP_LIB],
                               active=[IOMP], shadowed=[GOMP], memory={0: 1 << 30})])
    assert compare(observed, (0, 1), (0,), "jemalloc", "intel") == []


def test_compare_threads_outside_the_slice():
    observed = merged([process(threads=((100, 0), (101, 1), (102, 5)))], [process(threads=((100, 4),))])
    assert compare(observed, (0, 1), (0,), None, None) == [
        "2 of 3 threads ran outside the planned CPUs 0-1 (seen on 4-5)"]
    assert compare(observed, (), (0,), None, None) == []      # no slice planned: nothing to check


def test_compare_allocator_not_mapped():
    observed = merged([process(libraries=[GOMP_LIB], active=[GOMP])])
    assert compare(observed, (), (), "jemalloc", "gnu") == [
        "allocator jemalloc was planned but never mapped (ran with glibc)"]
    for not_checked in ("glibc", "default", "user", None):
        assert compare(observed, (), (), not_checked, "gnu") == []


def test_compare_intel_openmp_not_mapped():
    observed = merged([process(libraries=[GOMP_LIB], active=[GOMP])])
    assert compare(observed, (), (), None, "intel") == ["Intel OpenMP (libiomp5) was planned but never mapped"]
    assert compare(observed, (), (), None, "llvm") == ["LLVM OpenMP (libomp) was planned but never mapped"]
    assert compare(observed, (), (), None, "gnu") == []


def test_compare_two_openmp_runtimes_in_one_process():
    observed = merged([process(pid=4242, threads=((4242, 0),), libraries=[GOMP_LIB, IOMP_LIB], active=[GOMP, IOMP])])
    [line] = compare(observed, (0,), (0,), None, "gnu")
    assert line.startswith(f"2 OpenMP runtimes mapped in process 4242: gnu ({GOMP}), intel ({IOMP})")


def test_compare_remote_memory_above_the_threshold_only():
    mib = 1 << 20
    far = merged([process(memory={0: 600 * mib, 1: 100 * mib, 2: 200 * mib, 3: 100 * mib})])
    assert compare(far, (), (0, 1), None, None) == [
        "30.0% of its memory (300 MiB) is on node(s) 2-3, outside its memory nodes 0-1"]
    assert compare(far, (), (0, 1), None, None, remote_warn_pct=30.0) == []
    assert compare(far, (), (0, 1), None, None, remote_warn_min_bytes=301 * mib) == []
    small = merged([process(memory={0: 10 * mib, 1: 10 * mib})])     # 50% but only 10 MiB
    assert compare(small, (), (0,), None, None) == []
    assert compare(far, (), (), None, None) == [                     # the observer's nodes: (0,)
        "40.0% of its memory (400 MiB) is on node(s) 1-3, outside its memory nodes 0"]
    unbound = merged([process(memory={0: 600 * mib, 2: 400 * mib})], mem_nodes=())
    assert unbound.remote_memory_pct() is None
    assert compare(unbound, (), (), None, None) == []                # no memory nodes: unknown


def test_compare_names_mapped_files_whose_pages_sit_on_other_nodes():
    """An instance on node 1 mapping a model file another node's process read first: the anonymous memory is
    local (no line for it), the file's pages are not; two processes of the instance map the same pages once."""
    mib = 1 << 20
    files = {MODEL: {0: 900 * mib, 1: 100 * mib}, "/data/tokenizer.bin": {1: 20 * mib}}
    observed = merged([process(memory={1: 500 * mib}, files=files),
                       process(pid=200, threads=((200, 1),), memory={1: 10 * mib}, files={MODEL: {0: 400 * mib}})],
                      mem_nodes=(1,))
    assert observed.remote_memory_pct() == 0.0 and observed.remote_file_pct() == round(100 * 900 / 1020, 1)
    [line] = compare(observed, (), (1,), None, None)
    assert line.startswith("88.2% of the pages of its mapped files (900 MiB of llama-1b.xlp) are on node(s) 0, "
                           "outside its memory nodes 1: ")
    assert compare(observed, (), (0, 1), None, None) == []
    assert compare(merged([process(files={MODEL: {0: 40 * mib}})], mem_nodes=(1,)), (), (1,), None, None) == []
    data = to_json(observed)
    assert data["mapped_files_mib_by_node"] == {"/data/tokenizer.bin": {"1": 20.0}, MODEL: {"0": 900.0, "1": 100.0}}
    assert data["remote_file_pct"] == 88.2
    assert to_json(merged([process()]))["mapped_files_mib_by_node"] is None


# ---------------------------------------------------------------------------------- Observer


def test_observer_samples_only_when_due():
    now = [1000.0]
    observer = Observer(os.getpid(), (0,), interval=0.5, memory_interval=2.0, clock=lambda: now[0])
    assert observer.poll() is True                      # the first poll samples at once
    assert observer.next_due == 1000.5
    now[0] = 1000.2
    assert observer.poll() is False
    assert observer.poll(force=True) is True
    now[0] = 1000.7
    assert observer.poll() is True
    observed = observer.observed
    assert observed.samples == 3 and observed.processes >= 1 and observed.threads >= 1
    assert observed.memory_by_node is not None


def test_observer_rejects_a_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        Observer(1, interval=0)
    with pytest.raises(ValueError, match="interval"):
        Observer(1, memory_interval=-1)


def test_cells_for_the_summary_table():
    assert cells(Observed()) == {"allocator": "-", "openmp": "-", "threads": "-", "cpus_seen": "-", "remote_mem": "-"}
    plain = merged([process(threads=((100, 0),), memory={0: 1 << 20})])
    assert cells(plain) == {"allocator": "glibc", "openmp": "none", "threads": "1", "cpus_seen": "0",
                            "remote_mem": "0%"}
    busy = merged([process(threads=((100, 0), (101, 1), (102, 2)), libraries=[("jemalloc", JEMALLOC), GOMP_LIB, IOMP_LIB],
                           active=[GOMP, IOMP], memory={0: 3 << 20, 1: 1 << 20})])
    assert cells(busy) == {"allocator": "jemalloc", "openmp": "gnu+intel", "threads": "3", "cpus_seen": "0-2",
                           "remote_mem": "25%"}
