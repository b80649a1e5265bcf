"""bench/llm.py ``--instances k``: k copies of one route decoding at once, each pinned to its own cores.

The xlaunch routes run through ``xlaunch --ninstances k --ncores-per-instance T``: every instance is a
decode worker (``bench/llm.py --instance-worker``) that maps the one packed file
(``xlaunch.llm.from_pretrained(path)``), so the k share its pages. llama.cpp runs k ``llama-bench``
processes under ``taskset -c`` on the core sets that ``xlaunch --dry-run --json`` planned for the
same options (read from the plan, never guessed).

Windows: the xlaunch instances warm up once; then each of ``rounds`` windows times the k xlaunch copies
and the k llama.cpp copies one after the other (order reversed every other window). In a window all k
start at one instant (``go-w``) and decode round after round until every copy has its round; only then
does the orchestrator say ``stop-w``, so each counted round ran while the other k-1 copies were
decoding too. A window's aggregate is the sum of the copies' tokens/s; "vs llama.cpp" is the median of
the per-window ratios. Memory (bench/_procmem.py): the sums over the k processes of ``Pss`` and ``Rss``
from ``/proc/PID/smaps_rollup``, sampled together every 0.2 s in a window (the median sums are
reported, and the largest). No torch here (the worker imports it).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil

from xlaunch.cpulist import format_cpulist

import _processes
from _llm_summary import combine, memory, paired, ratio, table, tables  # noqa: F401  (bench/llm.py and the tests use them here)
from _procmem import MemorySampler, mapping_kib, parse_rollup  # noqa: F401  (bench/ is on sys.path)

SAMPLE_S = 0.2
START_DELAY_S = 0.3                  # ``go`` names an instant this far ahead: every copy starts together
READY_TIMEOUT_S = 900.0


class PlanError(ValueError):
    """The launcher refused the instances (the message is one line)."""


# -- the plan ------------------------------------------------------------------------------------
def launcher_argv(instances: int, threads: int) -> list[str]:
    """The xlaunch options of a run (the dry run and the launch take the same ones)."""
    return [sys.executable, "-m", "xlaunch", "--ninstances", str(instances), "--ncores-per-instance", str(threads)]


def cpus_from_plan(plan: dict[str, Any], instances: int) -> list[list[int]]:
    """Each instance's CPUs, by index, from ``xlaunch --dry-run --json``'s object."""
    found = sorted(plan.get("instances") or [], key=lambda entry: entry["index"])
    if [entry["index"] for entry in found] != list(range(instances)):
        raise PlanError(f"xlaunch planned instances {[entry['index'] for entry in found]}, not 0..{instances - 1}")
    cpus = [[int(cpu) for cpu in entry["cpus"]] for entry in found]
    if any(not one for one in cpus) or len({cpu for one in cpus for cpu in one}) != sum(map(len, cpus)):
        raise PlanError(f"xlaunch planned empty or overlapping CPU sets: {cpus}")
    return cpus


def plan(instances: int, threads: int, program: Sequence[str], env: dict[str, str],
         run: Callable[..., Any] = subprocess.run) -> list[list[int]]:
    """The CPUs of each of ``instances`` instances of ``threads`` cores; :class:`PlanError` (one line) when
    xlaunch refuses them (more than the usable cores, ...)."""
    proc = run([*launcher_argv(instances, threads), "--dry-run", "--json", *program], capture_output=True,
               text=True, env=env, timeout=120)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        reason = lines[-1].removeprefix("xlaunch: error: ") if lines else f"exit status {proc.returncode}"
        raise PlanError(f"--instances {instances} with --threads {threads}: {reason}")
    return cpus_from_plan(json.loads(proc.stdout), instances)


# -- one instance (runs under xlaunch) ---------------------------------------------------------------
def _write_text(path: Path, text: str) -> None:
    """Whole or not at all: the reader polls for the name."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _write(path: Path, payload: dict[str, Any]) -> None:
    _write_text(path, json.dumps(payload))


def process_cpus() -> list[int]:
    """The CPUs this process's threads may run on, together: the union over ``/proc/self/task``. The main
    thread's own mask is not the instance's: an OpenMP runtime binds it to one place of the team."""
    cpus = set(os.sched_getaffinity(0))
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return sorted(cpus)
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:          # the thread ended since the listing
            pass
    return sorted(cpus)


def without_end_of_sequence(model: Any) -> None:
    """No end-of-sequence id in ``model``'s generation config (a dict for ``load_decoder``'s decoder, else Hugging
    Face's config): every generate call runs its N tokens, with no per-step end check."""
    if isinstance(model.generation_config, dict):
        model.generation_config["eos_token_id"] = None
    else:
        model.generation_config.eos_token_id = None


def instance_worker(packed: Path, sync: Path, prompt_len: int, new_tokens: int, load: str = "packed") -> None:
    """Map the packed file (``load`` "decoder": by ``load_decoder``, no transformers in the process), warm up, say
    ``ready-<index>.json``; from ``go``'s instant decode rounds (t_1 the fastest of 3 ``generate(1)``, t_N of 2
    ``generate(N)``) into ``rounds-<index>.jsonl`` until ``stop``."""
    import torch

    index = int(os.environ.get("XLAUNCH_INSTANCE_INDEX", "0"))
    owner = int((sync / "owner").read_text())      # the bench: gone (even by SIGKILL), this copy ends
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    try:
        import xlaunch.llm

        model = xlaunch.llm.load_decoder(packed) if load == "decoder" else xlaunch.llm.from_pretrained(packed)
    except Exception as error:
        _write(sync / f"ready-{index}.json", {"unavailable": f"{type(error).__name__}: {str(error)[:300]}"})
        return
    without_end_of_sequence(model)          # exactly N tokens (bench/llm.py's worker does the same)
    vocab = model.spec.vocab_size if load == "decoder" else model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)

    def generate(count: int) -> float:
        begin = time.perf_counter()
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=count, do_sample=False, pad_token_id=0)
        if out.shape[1] != prompt_len + count:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} new tokens, not {count}")
        return time.perf_counter() - begin

    with torch.inference_mode():
        generate(new_tokens)
        generate(1)
        _write(sync / f"ready-{index}.json", {"pid": os.getpid(), "cpus": process_cpus(),
                                              "threads": torch.get_num_threads(), "setup_s": time.perf_counter() - start})
        window = 0
        while True:          # window w: from go-w's instant, rounds until stop-w; then idle-<index>-w
            go, stop = sync / f"go-{window}", sync / f"stop-{window}"
            while not go.exists():
                if (sync / "quit").exists() or not psutil.pid_exists(owner):
                    return
                time.sleep(0.01)
            time.sleep(max(0.0, float(go.read_text()) - time.monotonic()))
            with open(sync / f"rounds-{index}-{window}.jsonl", "a") as rounds:
                while not stop.exists():
                    if not psutil.pid_exists(owner):
                        return
                    begin = time.monotonic()
                    gen1 = min(generate(1) for _ in range(3))
                    genN = min(generate(new_tokens) for _ in range(2))
                    rounds.write(json.dumps({"begin": begin, "end": time.monotonic(),
                                             "decode_tps": (new_tokens - 1) / max(genN - gen1, 1e-9)}) + "\n")
                    rounds.flush()
            _write_text(sync / f"idle-{index}-{window}", "")
            window += 1


def _read_rounds(path: Path, start: float, until: float = float("inf")) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [row for row in rows if row["begin"] >= start and row["end"] <= until]


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join("      ! " + line for line in path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class RouteFailed(RuntimeError):
    """A route's copies could not run (the message is the row's status)."""


class XlaunchInstances:
    """``route``'s k instances under ``xlaunch --ninstances``, kept between windows (idle in between)."""

    def __init__(self, route: str, packed: Path, instances: int, threads: int, cpus: list[list[int]],
                 program: Callable[[Path], list[str]], env: dict[str, str]) -> None:
        self.cpus, self.instances, self.setup_s = cpus, instances, []
        self.sync = Path(tempfile.mkdtemp(prefix=f"xlaunch-bench-{route}-x{instances}-"))
        self.summary, self.log = self.sync / "summary.json", self.sync / "xlaunch.log"
        _write_text(self.sync / "owner", str(os.getpid()))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*launcher_argv(instances, threads), "--summary-json", str(self.summary),
                                          *program(self.sync)], stdout=log, stderr=subprocess.STDOUT, env=env)
        ready_files = [self.sync / f"ready-{i}.json" for i in range(instances)]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(path.exists() for path in ready_files):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.fail(f"failed: xlaunch exited ({self.proc.poll()}) before every instance was ready")
            time.sleep(0.05)
        ready = [json.loads(path.read_text()) for path in ready_files]
        missing = [r["unavailable"] for r in ready if "unavailable" in r]
        if missing:
            self.fail(f"unavailable: {missing[0]}", tail=False)
        if [r["cpus"] for r in ready] != cpus:
            self.fail(f"failed: the instances ran on {[r['cpus'] for r in ready]}, the plan said {cpus}", tail=False)
        self.pids, self.setup_s, self.mapped, self.windows = [r["pid"] for r in ready], [r["setup_s"] for r in ready], \
            str(packed), 0

    def fail(self, status: str, tail: bool = True) -> None:
        """Stop the instances and raise ``status`` (the first failure, not what closing then finds)."""
        self.quit()
        raise RouteFailed(status + ("\n" + _tail(self.log) if tail else ""))

    def window(self, rounds: int) -> dict[str, Any]:
        """All k from one instant until each has ``rounds`` rounds; returns when every one is idle again."""
        w, sampler = self.windows, MemorySampler(self.pids, mapped=self.mapped)
        self.windows += 1
        start = time.monotonic() + START_DELAY_S
        _write_text(self.sync / f"go-{w}", repr(start))
        files = [self.sync / f"rounds-{i}-{w}.jsonl" for i in range(self.instances)]
        while True:
            time.sleep(SAMPLE_S)
            if time.monotonic() >= start:
                sampler.sample()
            if all(len(_read_rounds(path, start)) >= rounds for path in files):
                break
            if self.proc.poll() is not None:
                self.fail(f"failed: xlaunch exited ({self.proc.poll()}) while decoding")
        stop_at = time.monotonic()
        sampler.sample()
        _write_text(self.sync / f"stop-{w}", "")
        while not all((self.sync / f"idle-{i}-{w}").exists() for i in range(self.instances)):
            if self.proc.poll() is not None:
                self.fail(f"failed: xlaunch exited ({self.proc.poll()}) after a window")
            time.sleep(0.02)
        return {"decode_rounds": [[row["decode_tps"] for row in _read_rounds(path, start, stop_at)] for path in files],
                "window_s": stop_at - start, **sampler.result()}

    def stop(self) -> None:
        """The bench is interrupted: xlaunch and the instances stopped now (mid-window they decode on), folder removed."""
        _processes.stop_tree(self.proc)
        shutil.rmtree(self.sync, ignore_errors=True)

    def quit(self) -> None:
        """Tell the instances to exit and wait for xlaunch (terminated after 10 minutes)."""
        (self.sync / "quit").write_text("")
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()

    def close(self) -> dict[str, Any]:
        """Quit the instances; xlaunch's summary checked against the plan (:class:`RouteFailed` when it differs)."""
        self.quit()
        launched = json.loads(self.summary.read_text()) if self.summary.exists() else {}
        seen = [i.get("cpus") for i in launched.get("instances", [])]
        if launched.get("exit_status") != 0 or seen != self.cpus:
            raise RouteFailed(f"failed: xlaunch's summary: exit {launched.get('exit_status')}, cpus {seen} "
                              f"(plan {self.cpus})\n" + _tail(self.log))
        shutil.rmtree(self.sync, ignore_errors=True)          # kept when a launch failed: its log is there
        ran_on = [sorted((i.get("observed") or {}).get("thread_cpus") or []) for i in launched["instances"]]
        return {"setup_s": self.setup_s, "threads_ran_on": ran_on}


# -- the run -----------------------------------------------------------------------------------------
def worker_program(script: str, packed: Path, args: Any) -> Callable[[Path], list[str]]:
    """The instance's program and arguments, given its sync folder (after ``--share-imports`` when asked)."""
    shared = ["--share-imports", args.share_imports] if getattr(args, "share_imports", None) else []
    return lambda sync: [*shared, script, "--instance-worker", "--packed", str(packed), "--sync", str(sync),
                         "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                         "--load", "decoder" if args.load == "decoder" else "packed"]


def plans(args: Any, script: str, env: dict[str, str]) -> dict[tuple[int, int], list[list[int]]]:
    """Each (k, threads)'s CPU sets from xlaunch's dry run; :class:`PlanError` on the first refused."""
    program = worker_program(script, Path("packed.xlp"), args)(Path("sync"))
    return {(k, threads): plan(k, threads, program, env) for threads in args.threads for k in args.instances}


def pack_all(routes: Sequence[str], model: Any, script: str, env: dict[str, str]) -> dict[str, Optional[Path]]:
    """Each xlaunch route's packed file under ``model.packed_dir``, written once by one subprocess (torch);
    None for a route whose file could not be written."""
    wanted = [route for route in routes if route.startswith("xlaunch-")]
    files = {route: model.packed_dir / f"{route}.xlp" for route in wanted}
    if not wanted:
        return {}
    print(f"packed files (written once, then mapped by every instance) under {model.packed_dir}", flush=True)
    model.packed_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    proc = subprocess.run([sys.executable, script, "--pack", ",".join(wanted), "--model-dir", str(model.folder),
                           "--packed", str(model.packed_dir)], capture_output=True, text=True, env=env)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    for route, path in files.items():
        if proc.returncode != 0 or not path.exists():
            print(f"  {route}: unavailable: {lines[-1] if lines else f'exit status {proc.returncode}'}", flush=True)
            files[route] = None
        else:
            print(f"  {route}: {path.name} ({path.stat().st_size / 2**20:.0f} MiB)", flush=True)
    print(f"  ({time.monotonic() - began:.0f} s)", flush=True)
    return dict(files)


def run(args: Any, packed_files: dict[str, Optional[Path]], llama: Optional[tuple[Path, dict[str, Path]]],
        cpu_plans: dict[tuple[int, int], Any], script: str, env: dict[str, str], median: Callable,
        llamacpp: Any, pairs: dict[str, str],
        checkpoint: Callable[[dict[str, Any]], None] = lambda results: None) -> dict[str, Any]:
    """Every (threads, k) and route pair: the xlaunch instances started once, then ``args.rounds`` windows,
    each the xlaunch copies' window and llama.cpp's (order reversed every other window), one round a copy.
    ``checkpoint`` gets the results so far after each pair (the bench writes its JSON then)."""
    results: dict[str, Any] = {}
    for threads in args.threads:
        for k in args.instances:
            cpus = cpu_plans[(k, threads)]
            print(f"\n== {k} instance(s) x {threads} thread(s) on CPUs {' | '.join(format_cpulist(c) for c in cpus)}", flush=True)
            rows: dict[str, Any] = {}
            results[f"{k}x{threads}"] = rows
            for ours, theirs in pairs.items():
                rows.update(run_pair(args, ours if ours in args.route_names else None,
                                     theirs if theirs in args.route_names else None, packed_files, llama, k, threads,
                                     cpus, script, env, median, llamacpp))
                checkpoint(results)
    return results


def run_pair(args: Any, ours: Optional[str], theirs: Optional[str], packed_files: dict[str, Optional[Path]],
             llama: Optional[tuple[Path, dict[str, Path]]], k: int, threads: int, cpus: list[list[int]], script: str,
             env: dict[str, str], median: Callable, llamacpp: Any) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    instances, windows = None, {ours: [], theirs: []}
    if ours and packed_files.get(ours) is None:
        rows[ours] = {"status": "unavailable: no packed file"}
    elif ours:
        print(f"  {ours}: starting {k} instance(s) ...", flush=True)
        try:
            instances = XlaunchInstances(ours, packed_files[ours], k, threads, cpus,
                                         worker_program(script, packed_files[ours], args), env)
        except RouteFailed as error:
            rows[ours] = {"status": str(error)}
    if theirs and llama is None:
        rows[theirs] = {"status": "unavailable: llama.cpp skipped"}
    argv = llamacpp.llama_bench_argv(llama[0], llama[1][theirs.removeprefix("llamacpp-")], threads, "decode",
                                     args.new_tokens - 1, args.prompt + 1, 2) if theirs and llama else None
    try:
        for index in range(args.rounds):
            order = [ours, theirs] if index % 2 == 0 else [theirs, ours]
            for name in order:
                if name is None or name in rows:
                    continue
                try:
                    got = instances.window(1) if name == ours else llamacpp.run_slots(argv, cpus, 1,
                                                                                       llamacpp.parse_llama_bench)
                except RouteFailed as error:          # only the xlaunch side raises it, its instances closed
                    rows[name], instances = {"status": str(error)}, None
                    continue
                if got.get("status", "ok") != "ok":
                    rows[name] = got
                    continue
                windows[name].append(got)
                print(f"    {name}: {' + '.join(f'{median(r) or 0:.1f}' for r in got['decode_rounds'])} tok/s "
                      f"({got['window_s']:.1f} s window); {memory(got)}", flush=True)
    except BaseException:          # Ctrl-C, the bench's SIGTERM, a bug: the copies must not decode on
        if instances is not None:
            instances.stop()
        raise
    extra: dict[str, Any] = {}
    if instances is not None:
        try:
            extra = instances.close()
        except RouteFailed as error:
            rows[ours] = {"status": str(error)}
    for name in (ours, theirs):
        if name and name not in rows:
            rows[name] = combine(windows[name], median, cpus=cpus, **(extra if name == ours else {}))
    if ours and theirs and rows[ours]["status"] == "ok" == rows[theirs]["status"]:
        rows[ours]["decode_vs_llamacpp"] = paired(rows[ours], rows[theirs], median)
    for name in (ours, theirs):
        row = rows.get(name) if name else None
        if row is None:
            continue
        if row["status"] != "ok":
            print(f"  {name}: {row['status']}", flush=True)
            continue
        mapped = ""
        if row.get("mapped_rss_each_mib"):
            mapped = "; packed file mapped: " + ", ".join(
                f"Rss {r:.0f} Pss {p:.0f}" for r, p in zip(row["mapped_rss_each_mib"], row["mapped_pss_each_mib"]))
        print(f"  {name}: {row['decode_tps']:.1f} tok/s over {len(row['windows'])} window(s); {memory(row)}{mapped}",
              flush=True)
    return rows
