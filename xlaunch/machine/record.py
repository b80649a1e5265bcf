"""``xlaunch-record-machine``: copy this machine's topology files into a tree ``XLAUNCH_FSROOT`` reads.

    xlaunch-record-machine my-box                   # a directory (must not exist)
    xlaunch-record-machine my-box --archive         # my-box.tar.xz (XLAUNCH_FSROOT takes it as is)
    taskset -c 0-3 xlaunch-record-machine pinned    # proc/self/status of a pinned process

Copies only what xlaunch reads, and the few siblings that make a tree faithful: the CPU and node
lists, each CPU's ``online``, ``topology/``, ``cache/index*/`` small files and
``cpufreq/scaling_governor``, the ``cpu/cpufreq/policyN`` directory names, SMT ``control``/``active``, node ``cpulist/cpumap/distance/meminfo``,
the hybrid ``cpu_core|cpu_atom/cpus`` lists, transparent huge page ``enabled``/``defrag``,
``proc/sys/kernel/numa_balancing``, ``proc/cpuinfo``, ``proc/meminfo``, the recording process's
``proc/self/status`` and ``proc/self/cgroup``, and the cgroup CPU quota files on that process's
cgroup paths. Nothing else (no serial numbers, no environment); review ``proc/self/status``
before sharing a recording.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import NoReturn, Optional

from xlaunch.machine._files import list_numbered
from xlaunch.userfiles import UserFileError, open_user_file

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
CPU_LISTS = ("online", "possible", "present", "offline", "kernel_max", "isolated", "nohz_full",
             "smt/control", "smt/active")
NODE_LISTS = ("online", "possible", "has_cpu", "has_memory", "has_normal_memory")
CACHE_FILES = ("level", "type", "size", "id", "shared_cpu_list", "shared_cpu_map",
               "coherency_line_size", "ways_of_associativity", "number_of_sets")
NODE_FILES = ("cpulist", "cpumap", "distance", "meminfo")
HOST_FILES = ("sys/kernel/mm/transparent_hugepage/enabled", "sys/kernel/mm/transparent_hugepage/defrag",
              "proc/sys/kernel/numa_balancing")
PROC_FILES = ("proc/cpuinfo", "proc/meminfo", "proc/self/status", "proc/self/cgroup")
QUOTA_FILES = ("cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us")
ARCHIVE_SUFFIX = ".tar.xz"
MAX_FILE_BYTES = 32 << 20   # proc/cpuinfo of an 8192-CPU machine is about 12 MiB; sysfs files are a page


def copy(source: str, out: str, relative: str) -> bool:
    """Copy one file's bytes (:func:`read_small`); False when there is nothing to copy."""
    data = read_small(os.path.join(source, relative))
    if data is None:
        return False
    target = os.path.join(out, relative)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as handle:
        handle.write(data)
    return True


def read_small(path: str) -> Optional[bytes]:
    """A file's bytes, read to the end (sysfs sizes lie) up to MAX_FILE_BYTES; None when missing or
    unreadable (an offline CPU's ``scaling_governor`` reads EBUSY).

    Only a regular file is read: a FIFO, device, directory or symlink loop in a ``--source`` tree, or a
    file over the cap, is skipped with a warning line, never opened blocking or read without end."""
    try:
        os.stat(path)
        fd = open_user_file(path, MAX_FILE_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return _skipped(f"{path}: {exc.strerror or exc}")
    except UserFileError as exc:
        return _skipped(str(exc))
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                return _skipped(f"{path} holds more than {MAX_FILE_BYTES} bytes")
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def _skipped(problem: str) -> None:
    print(f"xlaunch-record-machine: warning: {problem}; not recorded", file=sys.stderr)


def numbered(path: str, prefix: str) -> list[str]:
    """``prefix<N>`` entries of ``path`` in numeric order (the kernel writes N without leading zeros)."""
    return [f"{prefix}{n}" for n in list_numbered(path, prefix)]


def record(source: str, out: str) -> int:
    """Copy the machine under ``source`` into ``out``; returns the number of files written."""
    written = 0
    for name in CPU_LISTS:
        written += copy(source, out, f"{CPU}/{name}")
    written += copy_cpufreq_dirs(source, out)
    for cpu in numbered(os.path.join(source, CPU), "cpu"):
        base = f"{CPU}/{cpu}"
        os.makedirs(os.path.join(out, base), exist_ok=True)
        written += copy(source, out, f"{base}/online")
        written += copy(source, out, f"{base}/cpufreq/scaling_governor")
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
    for relative in HOST_FILES + PROC_FILES:
        written += copy(source, out, relative)
    written += record_cgroup_quotas(source, out)
    return written


def copy_cpufreq_dirs(source: str, out: str) -> int:
    """``cpu/cpufreq/`` and its ``policyN`` names, as empty directories: an empty ``cpufreq``
    is how a kernel says "no frequency driver" (most VMs), which the reader reports as ``none``;
    without it a recording would read ``unknown``. Returns 1 when the directory exists."""
    cpufreq = os.path.join(source, CPU, "cpufreq")
    if not os.path.isdir(cpufreq):
        return 0
    os.makedirs(os.path.join(out, CPU, "cpufreq"), exist_ok=True)
    for policy in numbered(cpufreq, "policy"):
        os.makedirs(os.path.join(out, CPU, "cpufreq", policy), exist_ok=True)
    return 1


def record_cgroup_quotas(source: str, out: str) -> int:
    """Copy the quota files of every directory on this process's cgroup paths (v1 and v2), as the
    recorded ``proc/self/cgroup`` names them."""
    written = 0
    data = read_small(os.path.join(out, "proc/self/cgroup"))    # as copied (or skipped, said once)
    if data is None:
        return 0
    lines = data.decode("utf-8", "replace").splitlines()
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


def archive_path(out: str) -> str:
    """``out`` with the ``.tar.xz`` suffix (added unless already there)."""
    return out if out.endswith(ARCHIVE_SUFFIX) else out + ARCHIVE_SUFFIX


def record_archive(source: str, archive: str) -> int:
    """Record ``source`` into the ``.tar.xz`` file ``archive``; returns the number of files."""
    from xlaunch.machine.archive import write_archive

    staging = tempfile.mkdtemp(prefix=".xlaunch-record-", dir=os.path.dirname(os.path.abspath(archive)))
    try:
        count = record(source, staging)
        if count:
            write_archive(staging, archive)
        return count
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _OneLineParser(argparse.ArgumentParser):
    """Bad input is one line, ``xlaunch-record-machine: error: ...``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = _OneLineParser(
        prog="xlaunch-record-machine",
        description="Record this machine's topology files for XLAUNCH_FSROOT.",
    )
    parser.add_argument("out", metavar="DIR", help="directory to create (must not exist)")
    parser.add_argument("--archive", action="store_true",
                        help=f"write DIR{ARCHIVE_SUFFIX} (one compressed file) instead of a directory")
    parser.add_argument("--source", default="/", help="machine root to read (default: /)")
    args = parser.parse_args(argv)
    if not args.out.strip() or not os.path.basename(os.path.normpath(args.out)).strip("."):
        # '' wrote sys/ and proc/ into the current directory (or a hidden '.tar.xz' there)
        parser.error(f"DIR: {args.out!r} names no new directory")
    target = archive_path(args.out) if args.archive else args.out
    if os.path.lexists(target):
        parser.error(f"DIR: {target} already exists")
    if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
        parser.error(f"DIR: the directory holding {target} does not exist")
    if not os.path.isdir(args.source):
        parser.error(f"--source: {args.source} is not a directory")
    try:
        count = record_archive(args.source, target) if args.archive else record(args.source, target)
    except KeyboardInterrupt:      # nothing half-written is left behind
        _remove(target)
        return 130
    except OSError as exc:         # a full disk, a read-only target: one line, nothing half-written
        _remove(target)
        print(f"{parser.prog}: error: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if count == 0:
        if not args.archive:
            shutil.rmtree(target, ignore_errors=True)
        parser.error(f"--source: nothing readable under {args.source}")
    print(f"recorded {count} files into {target}")
    return 0


def _remove(target: str) -> None:
    if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target, ignore_errors=True)
    elif os.path.isfile(target) and not os.path.islink(target):
        os.unlink(target)


if __name__ == "__main__":
    sys.exit(main())
