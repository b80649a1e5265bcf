"""Record this machine's topology files into a directory usable as ``XLAUNCH_FSROOT``.

    python tests/machines/record.py tests/machines/<name>            # from /
    taskset -c 0-3 python tests/machines/record.py OUT               # proc/self/status of a pinned process
    python tests/machines/record.py OUT --source tests/machines/x    # re-record a tree (tests)

Copies only what xlaunch reads (and the few siblings that make a tree faithful): the CPU and
node lists, each CPU's ``online``, ``topology/`` and ``cache/index*/`` small files, node
``cpulist/cpumap/distance/meminfo``, the hybrid ``cpu_core|cpu_atom/cpus`` lists,
``proc/cpuinfo``, ``proc/meminfo``, this process's ``proc/self/status`` and ``proc/self/cgroup``,
and the cgroup CPU quota files on the path of this process's cgroups. Nothing else (no
serial numbers, no environment) is copied; review ``proc/self/status`` before committing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
CPU_LISTS = ("online", "possible", "present", "offline", "kernel_max")
NODE_LISTS = ("online", "possible", "has_cpu", "has_memory", "has_normal_memory")
CACHE_FILES = ("level", "type", "size", "id", "shared_cpu_list", "shared_cpu_map",
               "coherency_line_size", "ways_of_associativity", "number_of_sets")
NODE_FILES = ("cpulist", "cpumap", "distance", "meminfo")
PROC_FILES = ("proc/cpuinfo", "proc/meminfo", "proc/self/status", "proc/self/cgroup")
QUOTA_FILES = ("cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us")


def copy(source: str, out: str, relative: str) -> bool:
    """Copy one small file's bytes (sysfs sizes lie, so read, don't stat)."""
    try:
        with open(os.path.join(source, relative), "rb") as handle:
            data = handle.read()
    except OSError:
        return False
    target = os.path.join(out, relative)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as handle:
        handle.write(data)
    return True


def numbered(path: str, prefix: str) -> list[str]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted((n for n in names if n.startswith(prefix) and n[len(prefix):].isdigit()),
                  key=lambda n: int(n[len(prefix):]))


def record(source: str, out: str) -> int:
    """Copy the machine under ``source`` into ``out``; returns the number of files written."""
    written = 0
    for name in CPU_LISTS:
        written += copy(source, out, f"{CPU}/{name}")
    for cpu in numbered(os.path.join(source, CPU), "cpu"):
        base = f"{CPU}/{cpu}"
        os.makedirs(os.path.join(out, base), exist_ok=True)
        written += copy(source, out, f"{base}/online")
        topology = os.path.join(source, base, "topology")
        for name in sorted(os.listdir(topology)) if os.path.isdir(topology) else ():
            written += copy(source, out, f"{base}/topology/{name}")
        for index in numbered(os.path.join(source, base, "cache"), "index"):
            for name in CACHE_FILES:
                written += copy(source, out, f"{base}/cache/{index}/{name}")
    if os.path.isdir(os.path.join(source, NODE)):
        for name in NODE_LISTS:
            written += copy(source, out, f"{NODE}/{name}")
        for node in numbered(os.path.join(source, NODE), "node"):
            for name in NODE_FILES:
                written += copy(source, out, f"{NODE}/{node}/{name}")
    for kind in ("cpu_core", "cpu_atom"):
        written += copy(source, out, f"sys/devices/{kind}/cpus")
    for relative in PROC_FILES:
        written += copy(source, out, relative)
    written += record_cgroup_quotas(source, out)
    return written


def record_cgroup_quotas(source: str, out: str) -> int:
    written = 0
    try:
        with open(os.path.join(source, "proc/self/cgroup")) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return 0
    mounts = ["sys/fs/cgroup", "sys/fs/cgroup/unified"]
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            mounts += [f"sys/fs/cgroup/{parts[1]}", "sys/fs/cgroup/cpu", "sys/fs/cgroup/cpu,cpuacct"]
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        steps = [p for p in parts[2].strip().split("/") if p and p != ".."]
        for mount in dict.fromkeys(mounts):
            for depth in range(len(steps), -1, -1):
                directory = "/".join([mount, *steps[:depth]])
                for name in QUOTA_FILES:
                    written += copy(source, out, f"{directory}/{name}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to create (must not exist)")
    parser.add_argument("--source", default="/", help="machine root to read (default: /)")
    args = parser.parse_args(argv)
    if os.path.exists(args.out):
        parser.error(f"{args.out} already exists")
    count = record(args.source, args.out)
    if count == 0:
        shutil.rmtree(args.out, ignore_errors=True)
        print(f"nothing readable under {args.source}", file=sys.stderr)
        return 1
    print(f"recorded {count} files into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
