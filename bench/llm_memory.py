"""The memory k copies of a packed LLM hold together, against one copy: xlaunch.llm's serving footprint.

    .venv/bin/python bench/llm_memory.py --shape llama-3.2-1b --instances 1,4
    .venv/bin/python bench/llm_memory.py --shape llama-3.2-3b --routes xlaunch-int4 --load packed

For each xlaunch route (``xlaunch-bf16``, ``-int8``, ``-int4``) the route's packed file is written once
(as ``bench/llm.py --instances`` writes it, under the cache), then, for each k, k processes start
together; each maps the file (``--load decoder``: ``xlaunch.llm.load_decoder``, no transformers;
``packed``: ``xlaunch.llm.from_pretrained``), decodes ``--new-tokens`` greedy tokens after a
``--prompt``-token prompt at one thread, and waits. When all k wait, ``Pss``, ``Rss`` and
``Anonymous`` of each are read from ``/proc/PID/smaps_rollup`` and summed. Before the counted runs,
one copy runs alone once, so the kernel choice's one-time timing (cached per machine) is not counted.

``--share-imports torch,xlaunch.llm`` starts the k copies as ``xlaunch --share-imports`` does: forked from
one process that imported those modules once (xlaunch's own fork server, unpinned; this bench adopts
them as xlaunch would), so torch's import is shared instead of held k times. Its "k over 1" is over one
copy started the same way (about one plain copy: the server's pages then count for that copy alone).

No timing and no pinning, so k may exceed the cores (``bench/llm.py --instances`` times k copies on
their own cores through ``xlaunch --ninstances``, which needs k x threads cores). Prints, per route
and k, the sums and **k over 1** (the PSS sum over the route's one-copy PSS); ``--json PATH`` writes
them. ``Pss`` splits shared pages among every process mapping them, other processes' included (a
library's pages under unrelated Python processes).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import _llm_instances
import _llm_model
from _args import modules
from _machine_bench import describe_machine, int_list, machine_line, node_cores
from _procmem import parse_rollup

from xlaunch.launcher.run.shared_imports.client import ServerUnavailable
from xlaunch.machine import load_machine

REPO = Path(__file__).resolve().parents[1]
ROUTES = ("xlaunch-bf16", "xlaunch-int8", "xlaunch-int4")
READY = "ready"
CHILD = r"""
import sys, torch
import xlaunch.llm
path, load, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
model = xlaunch.llm.load_decoder(path) if load == "decoder" else xlaunch.llm.from_pretrained(path)
vocab = model.spec.vocab_size if load == "decoder" else model.config.vocab_size
ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                     do_sample=False, pad_token_id=0)
assert out.shape[1] == prompt + new, out.shape
print("ready", "transformers" in sys.modules, flush=True)
sys.stdin.read()
"""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="a preset shape (default llama-168m; xlaunch/llm/shapes.py)")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory instead")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, of {', '.join(ROUTES)}")
    parser.add_argument("--instances", type=int_list, default=[1, 4], help="copies at once, a list (default 1,4)")
    parser.add_argument("--load", choices=("decoder", "packed"), default="decoder",
                        help="load_decoder (default: no transformers) or from_pretrained of the packed file")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--share-imports", metavar="MODULES", type=modules,
                        help="start the copies from xlaunch's fork server, which imported MODULES once "
                             "(e.g. torch,xlaunch.llm)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.route_names = [name for name in args.routes.split(",") if name]
    unknown = [name for name in args.route_names if name not in ROUTES]
    if unknown or not args.route_names:
        parser.error(f"--routes: unknown route {unknown[0] if unknown else args.routes!r} (routes: {', '.join(ROUTES)})")
    if args.shape and args.model:
        parser.error("--shape and --model exclude each other")
    if args.prompt < 1 or args.new_tokens < 1:
        parser.error("--prompt and --new-tokens must be at least 1")
    return args


def _copy_env() -> dict[str, str]:
    """A copy's environment: one thread, and this repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _summed(copies: int, each: list[dict[str, int]], imported: list[bool]) -> dict[str, Any]:
    """The copies' ``smaps_rollup`` fields (kB) summed, in MiB, as :func:`table` and ``--json`` take them."""
    total = {key: sum(fields.get(key, 0) for fields in each) / 1024 for key in ("Pss", "Rss", "Pss_Anon")}
    return {"copies": copies, "pss_sum_mib": total["Pss"], "rss_sum_mib": total["Rss"],
            "pss_anon_sum_mib": total["Pss_Anon"],
            "anonymous_each_mib": [fields.get("Anonymous", 0) / 1024 for fields in each],
            "transformers_imported": any(imported)}


def hold(packed: Path, copies: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``copies`` processes on ``packed``; once all have decoded, their memory summed (MiB)."""
    env = _copy_env()
    argv = [sys.executable, "-c", CHILD, str(packed), args.load, str(args.prompt), str(args.new_tokens)]
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(copies)]
    try:
        imported = []
        for proc in procs:
            line = proc.stdout.readline().split()
            if not line or line[0] != READY:
                proc.kill()
                raise RuntimeError(f"a copy exited ({proc.wait()}): {proc.stderr.read()[-500:]}")
            imported.append(line[1] == "True")
        each = [parse_rollup(Path(f"/proc/{proc.pid}/smaps_rollup").read_text()) for proc in procs]
    except BaseException:        # Ctrl-C, the bench's SIGTERM, a failed copy: a copy still loading never reads
        for proc in procs:       # its stdin's end, so it would load and decode on, orphaned
            if proc.poll() is None:
                proc.kill()
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
    return _summed(copies, each, imported)


def hold_forked(packed: Path, copies: int, args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """:func:`hold`, the copies forked from xlaunch's fork server after it imported ``--share-imports``."""
    from xlaunch.launcher.plan.records import ImportServer, Instance
    from xlaunch.launcher.run import binding
    from xlaunch.launcher.run.shared_imports.client import ForkServer
    from xlaunch.launcher.run.spawning import MemoryPolicy

    env = _copy_env()
    argv = (sys.executable, "-u", str(script), str(packed), args.load, str(args.prompt), str(args.new_tokens))
    instances = [Instance(index=i, cpus=(), mem_nodes=(), env=env, argv=argv, bind="none", membind="none")
                 for i in range(copies)]
    spec = ImportServer(modules=tuple(args.share_imports.split(",")), indices=tuple(range(copies)), cpus=(),
                        mem_nodes=(), membind="none", env=env)
    memory = MemoryPolicy()
    saved = binding.set_child_subreaper(True)          # the forked copies become this process's children
    server, procs, stdins = None, [], []
    try:
        server = ForkServer.start(spec, instances[0], die_with_parent=True, memory=memory, interrupted=lambda: False)
        for instance in instances:
            read_fd, write_fd = os.pipe()
            try:
                procs.append(server.spawn(instance, read_fd, memory))
            finally:
                os.close(read_fd)
            stdins.append(write_fd)
        server.close()                                 # as xlaunch does once every instance started
        imported = []
        for proc in procs:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").split()
                if line[:1] == [READY]:
                    imported.append(line[1] == "True")
                    break
            else:
                raise RuntimeError(f"a forked copy (pid {proc.pid}) ended before it was ready")
        each = [parse_rollup(Path(f"/proc/{proc.pid}/smaps_rollup").read_text()) for proc in procs]
    except BaseException:        # as in hold: the copies still loading are stopped (unreaped: the pids are theirs)
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
        raise
    finally:
        if server is not None:
            server.close(kill=True)
        for fd in stdins:
            os.close(fd)
        for proc in procs:
            os.waitpid(proc.pid, 0)
            proc.stdout.close()
        binding.set_child_subreaper(saved)
    return {**_summed(copies, each, imported), "share_imports": args.share_imports}


def table(rows: dict[str, list[dict[str, Any]]], load: str) -> str:
    lines = [f"| route ({load}) | copies | PSS sum MiB | RSS sum MiB | anonymous each MiB | k over 1 |",
             "|---|---:|---:|---:|---:|---:|"]
    for route, results in rows.items():
        one = next((r["pss_sum_mib"] for r in results if r["copies"] == 1), None)
        for r in results:
            ratio = f"{r['pss_sum_mib'] / one:.2f}" if one else ""
            anon = "-".join(f"{v:.0f}" for v in sorted({round(min(r['anonymous_each_mib'])),
                                                          round(max(r['anonymous_each_mib']))}))
            lines.append(f"| {route} | {r['copies']} | {r['pss_sum_mib']:.0f} | {r['rss_sum_mib']:.0f} | {anon} "
                         f"| {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        model = _llm_model.resolve(args.shape, args.model)
    except _llm_model.shapes.ShapeError as error:
        print(f"bench/llm_memory.py: {error}", file=sys.stderr)
        return 2
    needed = _llm_model.need_instances(model, args.route_names, [], max(args.instances), args.prompt,
                                       args.new_tokens)
    refused = _llm_model.footprint.refusal("bench/llm_memory.py", model.name, needed,
                                           hint=" (try fewer --instances or a smaller --shape)")
    if refused:
        print(refused, file=sys.stderr)
        return 2
    here = load_machine("/")
    description = describe_machine(here, node_cores(here))
    print(machine_line(description), flush=True)
    script = str(Path(__file__).with_name("llm.py"))
    _llm_model.written(model, script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    packed = _llm_instances.pack_all(args.route_names, model, script, env)
    rows: dict[str, list[dict[str, Any]]] = {}
    child = None
    if args.share_imports:
        import tempfile

        child = Path(tempfile.mkdtemp(prefix="xlaunch-llm-memory-")) / "llm_memory_copy.py"
        child.write_text(CHILD)
    failed = False
    try:
        for route in args.route_names:
            if packed.get(route) is None:
                print(f"{route}: no packed file, skipped", flush=True)
                continue
            rows[route] = []
            for copies in [0, *args.instances]:        # 0: one copy, the kernel choice's one-time timing, not counted
                began = time.monotonic()
                try:
                    got = (hold(packed[route], max(copies, 1), args) if not (child and copies) else
                           hold_forked(packed[route], copies, args, child))
                except (RuntimeError, OSError, ServerUnavailable) as error:   # that route's line says it, the rest go on
                    print(f"  {route} x {max(copies, 1)}: failed: {error}", flush=True)
                    failed = True
                    break
                if copies:
                    rows[route].append(got)
                    print(f"  {route} x {copies}: PSS sum {got['pss_sum_mib']:.0f} MiB, RSS sum "
                          f"{got['rss_sum_mib']:.0f} MiB ({time.monotonic() - began:.0f} s)", flush=True)
    finally:
        if child is not None:
            import shutil

            shutil.rmtree(child.parent, ignore_errors=True)
    print("\n" + table(rows, args.load + (f", shared {args.share_imports}" if child else "")))
    if args.json and not write_json(args.json, {
            "bench": "llm-memory", "machine": description, "model": model.name, "load": args.load,
            "share_imports": args.share_imports, "prompt": args.prompt, "new_tokens": args.new_tokens,
            "results": rows}):
        return 1
    return 1 if failed else 0


def write_json(path: str, doc: dict[str, Any]) -> bool:
    """``doc`` at ``path``, replaced whole: never written through a symlink or into a FIFO there (it was); a
    failure is one line on stderr."""
    from xlaunch.userfiles import UserFileError, write_atomically

    try:
        write_atomically(path, (json.dumps(doc, indent=1) + "\n").encode())
    except (OSError, UserFileError) as error:
        print(f"bench/llm_memory.py: --json {path}: {getattr(error, 'strerror', None) or error}", file=sys.stderr)
        return False
    print(f"wrote {path}")
    return True


if __name__ == "__main__":
    import _processes

    _processes.exit_on_sigterm()
    _processes.survive_closed_stdout()
    sys.exit(main())
