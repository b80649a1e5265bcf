"""The front's channels to its ranks: a private directory of named pipes (FIFOs).

torch's agent starts the ranks (``close_fds=True``, stdout inherited), so nothing the front opens
can reach a rank as a descriptor. The directory (``mkdtemp``, mode 0700) is named in the ranks'
environment (:data:`CHANNELS_VAR`) instead, and holds:

* ``out_<i>``: local rank *i*'s stdout and stderr. ``xlaunch --per-rank`` opens it for writing
  and puts it on descriptors 1 and 2 before it becomes the program, so each rank has a pipe of
  its own (whole lines, ``[i]`` on the console, its own log) as instances of the single-node
  launcher have. A restarted rank opens the same FIFO again.
* ``ranks``: one line per rank start, ``+<pgid> <local rank> <pid>``, written before the exec:
  the front learns each rank's process (to observe it, to stop its group, to see it end) and its
  watchdog, which drains this FIFO if the front is killed, learns the group even then.

The front holds a write end of every FIFO itself, so a read never sees end-of-file between two
ranks' lifetimes. A rank that finds no reader (the front is gone) does not start.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Mapping, Optional

CHANNELS_VAR = "XLAUNCH_FRONT_CHANNELS"
GRACE_VAR = "XLAUNCH_FRONT_GRACE"          # the agent's cap on its waits before SIGKILL (.agent)
REGISTRY = "ranks"
RESULT = "result.json"      # the agent's report: exit status, and each failed rank's exit code


def output_name(local_rank: int) -> str:
    return f"out_{local_rank}"


class Channels:
    """The front's side: create, read, close (which removes the directory)."""

    def __init__(self, ranks: int) -> None:
        self.path = tempfile.mkdtemp(prefix="xlaunch-front-")
        self.outputs: dict[int, int] = {}       # local rank -> read end
        self._writers: list[int] = []
        self.registry: int = -1
        try:
            for rank in range(ranks):
                self.outputs[rank] = self._open(output_name(rank))
            self.registry = self._open(REGISTRY)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> int:
        path = os.path.join(self.path, name)
        os.mkfifo(path, 0o600)
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._writers.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        return reader

    @property
    def result_path(self) -> str:
        return os.path.join(self.path, RESULT)

    def read_registrations(self) -> list[tuple[int, int, int]]:
        """``(pgid, local rank, pid)`` for every complete line waiting in the registry."""
        data = b""
        while True:
            try:
                chunk = os.read(self.registry, 4096)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                break
            data += chunk
        return parse_registrations(data)

    def close_writers(self) -> None:
        """Let reads reach end-of-file once the ranks' own write ends are closed."""
        for fd in self._writers:
            os.close(fd)
        self._writers = []

    def close(self) -> None:
        self.close_writers()
        if self.registry >= 0:
            os.close(self.registry)
            self.registry = -1
        for fd in self.outputs.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.outputs = {}
        shutil.rmtree(self.path, ignore_errors=True)


def parse_registrations(data: bytes) -> list[tuple[int, int, int]]:
    found = []
    for line in data.split(b"\n"):
        parts = line[1:].split() if line[:1] == b"+" else []
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            found.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return found


def attach_rank(environ: Mapping[str, str], local_rank: int) -> Optional[str]:
    """In ``xlaunch --per-rank`` under the front, before the exec: send stdout and stderr to this
    rank's FIFO and register. Returns why it could not (the front is gone), or None."""
    path = environ.get(CHANNELS_VAR)
    if not path:
        return None
    try:
        out = os.open(os.path.join(path, output_name(local_rank)), os.O_WRONLY | os.O_NONBLOCK)
        registry = os.open(os.path.join(path, REGISTRY), os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:     # ENXIO: no reader, ENOENT: the directory is gone
        return f"the xlaunch front that started this rank is gone ({error.strerror or error})"
    try:
        flags = fcntl.fcntl(out, fcntl.F_GETFL)
        fcntl.fcntl(out, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)   # the program gets a blocking pipe
        os.write(registry, f"+{os.getpgid(0)} {local_rank} {os.getpid()}\n".encode())
        for fd in (1, 2):
            os.dup2(out, fd)
    except OSError as error:
        return f"cannot reach the xlaunch front ({error.strerror or error})"
    finally:
        os.close(registry)
        os.close(out)
    return None
