"""bench/llm.py --instances: the pinning read from xlaunch's dry run, the memory sums over smaps_rollup,
the argument errors, and (live, tiny model) two xlaunch instances sharing one packed file's pages."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench_modules import BENCH, load, tiny_packed
from host_cpus import allowed_cores, need_cores
REPO = BENCH.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
USABLE = len(os.sched_getaffinity(0))


def instances():
    load("llm")                  # puts bench/ on sys.path (bench/_llm_instances.py imports _procmem)
    return load("_llm_instances")


def test_the_cpus_come_from_xlaunchs_dry_run() -> None:
    inst = instances()
    (cpus,) = inst.plan(1, 1, [str(BENCH / "llm.py")], ENV)
    assert len(cpus) == 1 and set(cpus) <= os.sched_getaffinity(0)
    if allowed_cores() < 2:
        return
    two = inst.plan(2, 1, [str(BENCH / "llm.py")], ENV)
    assert len(two) == 2 and not set(two[0]) & set(two[1]) and set(two[0] + two[1]) <= os.sched_getaffinity(0)
    # the plan is parsed by index, and a plan that is not one set per instance is refused
    plan = {"instances": [{"index": 1, "cpus": [3, 2]}, {"index": 0, "cpus": [0, 1]}]}
    assert inst.cpus_from_plan(plan, 2) == [[0, 1], [3, 2]]
    for bad in ({"instances": [{"index": 0, "cpus": [0]}]}, {"instances": [{"index": 0, "cpus": [0]},
                                                                            {"index": 1, "cpus": [0]}]}):
        with pytest.raises(inst.PlanError):
            inst.cpus_from_plan(bad, 2)


def test_more_instances_than_cores_is_one_line_and_exit_2(tmp_path: Path) -> None:
    too_many = USABLE + 1          # more than the logical CPUs, so more than the cores xlaunch plans on
    with pytest.raises(instances().PlanError) as refused:
        instances().plan(too_many, 1, [str(BENCH / "llm.py")], ENV)
    assert str(refused.value).startswith(f"--instances {too_many} with --threads 1: ") and "\n" not in str(refused.value)
    env = {**ENV, "XLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    for argv, expected in ((["--instances", str(too_many)], f"bench/llm.py: --instances {too_many} with --threads 1: "),
                           (["--instances", "0"], "--instances: expected positive integers, got '0'"),
                           (["--instances", "2", "--routes", "hf-bf16,xlaunch-int8"], "not hf-bf16")):
        proc = subprocess.run([sys.executable, str(BENCH / "llm.py"), "--shape", "tiny", "--no-llamacpp", "--lock", "",
                               *argv], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2 and proc.stdout == "" and expected in proc.stderr, proc.stderr
        assert proc.stderr.startswith("bench/llm.py: ") or proc.stderr.startswith("usage:"), proc.stderr
        assert proc.stderr.count("\n") == 1 or proc.stderr.startswith("usage:"), proc.stderr
    assert not (tmp_path / "cache").exists()


def test_instances_arguments() -> None:
    llm = load("llm")
    args = llm.parse_args(["--instances", "1,2", "--quick"])
    assert args.instances == [1, 2] and args.threads == [1]
    assert args.route_names == ["xlaunch-bf16", "llamacpp-bf16", "xlaunch-int8", "llamacpp-q8_0",
                                "xlaunch-int4", "llamacpp-q4_0"]
    assert llm.parse_args(["--instances", "2", "--no-llamacpp", "--threads", "2"]).route_names == \
        ["xlaunch-bf16", "xlaunch-int8", "xlaunch-int4"]
    assert llm.parse_args([]).instances is None and llm.parse_args([]).threads == [1, 2]      # unchanged


ROLLUP = """00400000-7ffe00000000 ---p 00000000 00:00 0                          [rollup]
Rss:              {rss} kB
Pss:              {pss} kB
Pss_Anon:         100 kB
Pss_File:         {pss} kB
Shared_Clean:     0 kB
"""
SMAPS = """7f0000000000-7f0000200000 r--s 00000000 08:01 42                         {path}
Size:               2048 kB
Rss:                2048 kB
Pss:                1024 kB
7f0000200000-7f0000300000 r--s 00200000 08:01 42                         {path}
Rss:                 512 kB
Pss:                 256 kB
7f0000300000-7f0000400000 rw-p 00000000 00:00 0 
Rss:                1000 kB
Pss:                1000 kB
"""


def test_memory_sums_pss_and_rss_over_the_instances(tmp_path: Path) -> None:
    inst = instances()
    proc = tmp_path / "proc"
    packed = "/cache/llm-packed/x/xlaunch-int8.xlp"

    def write(pid: int, rss: int, pss: int) -> None:
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "smaps_rollup").write_text(ROLLUP.format(rss=rss, pss=pss))
        (proc / str(pid) / "smaps").write_text(SMAPS.format(path=packed))

    write(11, 400_000, 300_000)
    write(12, 420_000, 310_000)
    sampler = inst.MemorySampler([11, 12], proc=str(proc), mapped=packed)
    assert sampler.sample()
    write(12, 430_000, 330_000)
    assert sampler.sample()
    write(12, 430_000, 900_000)                       # a transient: in the largest sum, not in the median
    assert sampler.sample()
    sampler.pids = [11, 12, 13]                       # one that is gone: the sample does not count
    assert not sampler.sample()
    sampler.pids = [11, 12]
    got = sampler.result()
    assert got["samples"] == 3
    assert got["pss_sum_mib"] == (300_000 + 330_000) / 1024 and got["rss_sum_mib"] == (400_000 + 430_000) / 1024
    assert got["pss_sum_max_mib"] == (300_000 + 900_000) / 1024
    assert got["pss_each_mib"] == [300_000 / 1024, 330_000 / 1024]
    assert got["mapped_rss_each_mib"] == [2560 / 1024] * 2 and got["mapped_pss_each_mib"] == [1280 / 1024] * 2
    assert inst.parse_rollup(ROLLUP.format(rss=5, pss=3))["Pss_Anon"] == 100
    assert inst.MemorySampler([], proc=str(proc)).result() == {"samples": 0}


def test_summary_sums_the_copies_per_window_and_pairs_windows_with_llamacpp() -> None:
    inst = instances()
    llm = load("llm")
    from _machine_bench import median

    def window(rounds, pss, rss):
        return {"decode_rounds": rounds, "pss_sum_mib": pss, "rss_sum_mib": rss, "window_s": 1.0}

    # window 1: copies at 50 (median of 3 rounds) and 30; window 2: 20 and 20 (a loaded window)
    ours = inst.combine([window([[50.0, 40.0, 60.0], [30.0]], 900.0, 1500.0), window([[20.0], [20.0]], 910.0, 1500.0),
                         window([[45.0], [35.0]], 920.0, 1500.0)], median, cpus=[[0], [1]])
    theirs = inst.combine([window([[40.0], [40.0]], 300.0, 600.0), window([[10.0], [10.0]], 300.0, 600.0),
                           window([[40.0], [40.0]], 300.0, 600.0)], median)
    assert [w["decode_tps"] for w in ours["windows"]] == [80.0, 40.0, 80.0] and ours["decode_tps"] == 80.0
    assert ours["decode_tps_each"] == [45.0, 30.0] and ours["pss_sum_mib"] == 910.0 and ours["cpus"] == [[0], [1]]
    # per-window ratios 1.0, 2.0, 1.0: the loaded window is paired with llama.cpp's loaded window
    assert inst.paired(ours, theirs, median) == 1.0
    rows = {"xlaunch-int8": {**ours, "decode_vs_llamacpp": inst.paired(ours, theirs, median)}, "llamacpp-q8_0": theirs,
            "xlaunch-int4": {"status": "failed: xlaunch exited (1)\n      ! Traceback"}}
    text = inst.table(2, 1, rows, llm.INSTANCE_PAIRS, {"xlaunch-int8": {"pss_sum_mib": 455.0}})
    assert "| xlaunch-int8 | 80.0 | 45.0 + 30.0 | 1.00 | 910 | 1500 | 3.03 | 2.00 |" in text
    assert "| llamacpp-q8_0 | 80.0 | 40.0 + 40.0 |  | 300 | 600 |  |  |" in text
    assert "| xlaunch-int4 | failed: xlaunch exited (1) | | | | | | |" in text


# An instance that follows the bench worker's protocol without torch (importing xlaunch.llm takes
# 8-10 s a process on the AVX2 VM): it maps the file read-only and reads every page, as
# xlaunch.llm.from_pretrained(packed) maps a packed file, and reports its reading rate as its rounds.
MAPPING_WORKER = """
import json, mmap, os, sys, time
from pathlib import Path
path, sync = sys.argv[1], Path(sys.argv[2])
index = os.environ["XLAUNCH_INSTANCE_INDEX"]
with open(path, "rb") as handle:
    area = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
view = memoryview(area)
def read():
    return sum(view[offset] for offset in range(0, len(area), 4096))
read()
(sync / f"ready-{index}.json.partial").write_text(json.dumps(
    {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "threads": 1, "setup_s": 0.0}))
os.replace(sync / f"ready-{index}.json.partial", sync / f"ready-{index}.json")
window = 0
while True:
    while not (sync / f"go-{window}").exists():
        if (sync / "quit").exists():
            sys.exit(0)
        time.sleep(0.01)
    time.sleep(max(0.0, float((sync / f"go-{window}").read_text()) - time.monotonic()))
    with open(sync / f"rounds-{index}-{window}.jsonl", "a") as rounds:
        while not (sync / f"stop-{window}").exists():
            begin = time.monotonic()
            for _ in range(20):
                read()
            end = time.monotonic()
            rounds.write(json.dumps({"begin": begin, "end": end, "decode_tps": 20 / max(end - begin, 1e-9)}) + "\\n")
            rounds.flush()
    (sync / f"idle-{index}-{window}").write_text("")
    window += 1
"""


@pytest.mark.live
def test_two_xlaunch_instances_share_a_mapped_files_pages(tmp_path: Path) -> None:
    """The orchestration end to end under ``xlaunch --ninstances 2``: the plan's CPUs checked against each
    instance's affinity and the summary, the window, and the memory read from the instances' smaps."""
    need_cores(2)                    # two instances of one core
    inst = instances()
    mapped = tmp_path / "weights.bin"
    mapped.write_bytes(os.urandom(8 << 20))
    worker = tmp_path / "worker.py"
    worker.write_text(MAPPING_WORKER)
    cpus = inst.plan(2, 1, [str(worker)], ENV)
    copies = inst.XlaunchInstances("mapping", mapped, 2, 1, cpus, lambda sync: [str(worker), str(mapped), str(sync)], ENV)
    windows = [copies.window(2), copies.window(1)]        # the instances wait, idle, between the windows
    got = inst.combine(windows, lambda values: sorted(values)[len(values) // 2], **copies.close())
    assert [len(rounds) >= n for w, n in zip(windows, (2, 1)) for rounds in w["decode_rounds"]] == [True] * 4
    assert all(set(seen) <= set(planned) for seen, planned in zip(got["threads_ran_on"], cpus)), got["threads_ran_on"]
    assert all(rate > 0 for rate in got["decode_tps_each"]) and all(w["samples"] >= 1 for w in windows)
    # both map all 8 MiB; each page is counted in both, so each one's Pss of it is about half its Rss
    for rss, pss in zip(got["mapped_rss_each_mib"], got["mapped_pss_each_mib"]):
        assert rss >= 7.5 and pss <= 0.75 * rss, (rss, pss)
    assert got["pss_sum_mib"] < got["rss_sum_mib"]


PINNED_THREADS = """
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
import _llm_instances
first, second = int(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {first})            # the main thread, as an OpenMP runtime binds it to one place
pinned, done = threading.Event(), threading.Event()
def member():
    os.sched_setaffinity(0, {second})       # a team member bound to another place
    pinned.set()
    done.wait()
worker = threading.Thread(target=member)
worker.start()
pinned.wait()
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "process": _llm_instances.process_cpus()}))
done.set()
worker.join()
"""


def test_an_instances_cpus_are_its_threads_together_not_its_main_threads() -> None:
    """On the 16-core Xeon an instance of 4 threads reported its main thread's one CPU (GNU OpenMP binds it to
    the team's first place) where the plan said four, and the bench stopped: the check reads every thread."""
    if USABLE < 2:
        pytest.skip(f"two threads on two CPUs need 2 usable CPUs, {USABLE} here")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    out = subprocess.run([sys.executable, "-c", PINNED_THREADS, str(BENCH), str(first), str(second)],
                         capture_output=True, text=True, timeout=60, env=ENV, check=True)
    got = __import__("json").loads(out.stdout)
    assert got == {"main": [first], "process": [first, second]}, got


@pytest.mark.live
def test_a_failed_start_check_raises_its_own_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Instances that ran elsewhere than planned stop with that reason (it raised AttributeError before,
    from the summary check of a half-made object)."""
    inst = instances()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))   # the failed launch's folder is kept (its log): here
    mapped = tmp_path / "weights.bin"
    mapped.write_bytes(os.urandom(1 << 20))
    worker = tmp_path / "worker.py"
    worker.write_text(MAPPING_WORKER)
    (planned,) = inst.plan(1, 1, [str(worker)], ENV)
    elsewhere = [[cpu + 1 for cpu in planned]]
    with pytest.raises(inst.RouteFailed) as failed:
        inst.XlaunchInstances("mapping", mapped, 1, 1, elsewhere, lambda sync: [str(worker), str(mapped), str(sync)],
                              ENV)
    assert str(failed.value) == f"failed: the instances ran on {[planned]}, the plan said {elsewhere}"


def test_the_memory_check_counts_the_packed_file_once_and_the_process_per_instance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path))
    model_ = load("_llm_model")
    tiny = model_.resolve("tiny", None)
    footprint, shape = model_.footprint, tiny.shape
    steady, _ = model_.route_bytes("xlaunch-int8", shape, model_.shapes.checkpoint_bytes(tiny.config), 32, 57)
    packed = footprint.packed_bytes(shape, footprint.default_activations(), "int8")
    many = [model_.need_instances(tiny, ["xlaunch-int8"], [], k, 32, 24) for k in (50, 51)]
    assert "50 instance(s) of xlaunch-int8" in many[0].memory_what
    assert many[1].memory - many[0].memory == steady - packed          # one more process, not one more copy
    assert many[0].disk == model_.shapes.checkpoint_bytes(tiny.config) + packed     # the packed file, once


def test_each_finished_pair_is_handed_to_the_checkpoint(monkeypatch) -> None:
    """bench/llm.py writes its --json after each pair: a run cut by a time limit keeps the pairs it finished
    (the first run on the AMX Xeon lost every finished pair to its limit)."""
    import json
    from types import SimpleNamespace

    inst = instances()
    pairs = {"xlaunch-bf16": "llamacpp-bf16", "xlaunch-int8": "llamacpp-q8_0"}
    monkeypatch.setattr(inst, "run_pair", lambda args, ours, theirs, *rest: {ours: {"k": rest[2]}, theirs: {"k": rest[2]}})
    args = SimpleNamespace(threads=[1], instances=[1, 2], route_names=[*pairs, *pairs.values()])
    seen: list[str] = []
    results = inst.run(args, {}, None, {(1, 1): [[0]], (2, 1): [[0], [1]]}, "llm.py", {}, None, None, pairs,
                       checkpoint=lambda done: seen.append(json.dumps(done, sort_keys=True)))
    assert [sorted((key, sorted(rows)) for key, rows in json.loads(s).items()) for s in seen] == [
        [("1x1", ["llamacpp-bf16", "xlaunch-bf16"])],
        [("1x1", ["llamacpp-bf16", "llamacpp-q8_0", "xlaunch-bf16", "xlaunch-int8"])],
        [("1x1", ["llamacpp-bf16", "llamacpp-q8_0", "xlaunch-bf16", "xlaunch-int8"]),
         ("2x1", ["llamacpp-bf16", "xlaunch-bf16"])],
        [("1x1", ["llamacpp-bf16", "llamacpp-q8_0", "xlaunch-bf16", "xlaunch-int8"]),
         ("2x1", ["llamacpp-bf16", "llamacpp-q8_0", "xlaunch-bf16", "xlaunch-int8"])]]
    assert json.loads(seen[-1]) == results and results["2x1"]["xlaunch-int8"] == {"k": 2}


def test_a_window_too_short_to_sample_says_so_instead_of_0_mib(capsys) -> None:
    """A tiny run (--new-tokens 2): llama.cpp's windows ended before the first 0.2 s sample, and the bench
    printed 'PSS sum 0 MiB, RSS sum 0 MiB' as if it had measured them."""
    from statistics import median
    from types import SimpleNamespace

    inst = instances()
    llamacpp = SimpleNamespace(llama_bench_argv=lambda *a: ["llama-bench"], parse_llama_bench=None,
                               run_slots=lambda *a: {"status": "ok", "decode_rounds": [[2000.0]], "window_s": 0.05,
                                                     "samples": 0})
    args = SimpleNamespace(rounds=2, new_tokens=2, prompt=1)
    rows = inst.run_pair(args, None, "llamacpp-q8_0", {}, (Path("bin"), {"q8_0": Path("m.gguf")}), 1, 1, [[0]],
                         "llm.py", {}, lambda values: median(values) if values else None, llamacpp)
    assert rows["llamacpp-q8_0"]["status"] == "ok" and rows["llamacpp-q8_0"]["pss_sum_mib"] is None
    out = capsys.readouterr().out
    assert "0 MiB" not in out and out.count("memory not sampled") == 3, out
    assert inst.memory({"pss_sum_mib": 350.4, "rss_sum_mib": 402.0}) == "PSS sum 350 MiB, RSS sum 402 MiB"


def test_the_memory_bench_takes_its_routes_and_counts() -> None:
    memory = load("llm_memory")
    args = memory.parse_args([])
    assert (args.instances, args.load, args.route_names) == ([1, 4], "decoder", list(memory.ROUTES))
    assert memory.parse_args(["--instances", "1,2,8", "--routes", "xlaunch-int4", "--load", "packed"]).instances == [1, 2, 8]
    for argv in (["--routes", "llamacpp-q8_0"], ["--instances", "0"], ["--shape", "tiny", "--model", "x"]):
        with pytest.raises(SystemExit) as stop:
            memory.parse_args(argv)
        assert stop.value.code == 2
    rows = {"xlaunch-int8": [dict(copies=1, pss_sum_mib=1000.0, rss_sum_mib=1004.0, anonymous_each_mib=[150.0]),
                             dict(copies=4, pss_sum_mib=1450.0, rss_sum_mib=4000.0,
                                  anonymous_each_mib=[148.0, 151.0, 150.0, 149.0])]}
    assert "| xlaunch-int8 | 4 | 1450 | 4000 | 148-151 | 1.45 |" in memory.table(rows, "decoder")


def test_the_memory_bench_sums_copies_that_never_import_transformers(tmp_path: Path) -> None:
    """Two copies of a tiny packed file, each decoding then waiting: their PSS, RSS and anonymous memory read
    together, and load_decoder's copies without transformers."""
    _, packed = tiny_packed(tmp_path, "int4", group_size=32)
    memory = load("llm_memory")
    got = memory.hold(packed, 2, memory.parse_args(["--prompt", "8", "--new-tokens", "3"]))
    assert got["copies"] == 2 and len(got["anonymous_each_mib"]) == 2 and got["transformers_imported"] is False
    assert 0 < got["pss_sum_mib"] <= got["rss_sum_mib"] and min(got["anonymous_each_mib"]) > 50     # torch's own


def test_the_memory_bench_forks_copies_that_share_the_imports(tmp_path: Path) -> None:
    """``--share-imports``: two copies forked from xlaunch's fork server after it imported torch and
    xlaunch.llm; their anonymous memory (torch's import) is mostly shared: its PSS sum is well under
    what the copies hold each."""
    _, packed = tiny_packed(tmp_path, "int4", group_size=32)
    memory = load("llm_memory")
    script = tmp_path / "llm_memory_copy.py"
    script.write_text(memory.CHILD)
    args = memory.parse_args(["--prompt", "8", "--new-tokens", "3", "--share-imports", "torch,xlaunch.llm"])
    got = memory.hold_forked(packed, 2, args, script)
    assert got["copies"] == 2 and got["transformers_imported"] is False
    assert min(got["anonymous_each_mib"]) > 50                         # torch's own, mapped in each
    assert got["pss_anon_sum_mib"] < 0.75 * sum(got["anonymous_each_mib"]), got



LOADING_COPY = """
import os, sys, time
with open(os.path.join(os.environ["PIDDIR"], str(os.getpid())), "w"):
    pass
time.sleep(120)                # loading a big packed file: it reads no stdin until it is ready
"""


@pytest.mark.parametrize("forked", [False, True])
def test_an_interrupted_memory_bench_stops_the_copies_still_loading(tmp_path: Path, monkeypatch, forked: bool) -> None:
    """bench/llm_memory.py interrupted while its copies loaded: it closed their stdin and waited up to 60 s for
    each (forked from --share-imports' server: for as long as they took); the copies loaded and decoded on."""
    import signal

    memory = load("llm_memory")
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setattr(memory, "CHILD", LOADING_COPY)
    monkeypatch.setenv("PIDDIR", str(pids))
    script = tmp_path / "copy.py"
    script.write_text(LOADING_COPY)
    args = memory.parse_args(["--share-imports", "json"] if forked else [])
    hold = (lambda: memory.hold_forked(tmp_path / "x.xlp", 2, args, script)) if forked else \
        (lambda: memory.hold(tmp_path / "x.xlp", 2, args))

    def interrupt(number: int, frame: object) -> None:
        if len(list(pids.iterdir())) < 2:              # both copies started first
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    started = time.monotonic()
    try:
        hold()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interruption was swallowed")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 20
    for pid in (int(path.name) for path in pids.iterdir()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_the_memory_bench_never_writes_its_json_through_a_symlink(tmp_path: Path, capsys) -> None:
    memory = load("llm_memory")
    target = tmp_path / "somebody-elses.txt"
    target.write_text("theirs")
    (tmp_path / "out.json").symlink_to(target)
    assert memory.write_json(str(tmp_path / "out.json"), {"results": {}})
    assert target.read_text() == "theirs" and not (tmp_path / "out.json").is_symlink()
    assert json.loads((tmp_path / "out.json").read_text()) == {"results": {}}
    assert not memory.write_json(str(tmp_path / "no-such-folder" / "out.json"), {})
    assert capsys.readouterr().err.startswith("bench/llm_memory.py: --json ")
