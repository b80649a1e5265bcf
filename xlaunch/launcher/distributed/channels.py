"""The front's private channels to its ranks and its agent (:class:`Channels`): a directory of
FIFOs and report files, named in the agent's environment. Light on purpose: ``xlaunch
--per-rank`` (:func:`xlaunch.launcher.distributed.launch.attach_rank`) and torch's agent
(:mod:`xlaunch.launcher.distributed.agent`) read its names without the front's supervisor."""
from __future__ import annotations

import os
import shutil
import tempfile


REGISTRY = "ranks"
RESULT = "result.json"      # the agent's report: exit status, and each failed rank's exit code
FIRST_FAILURE = "first_failure.json"   # the front's note to the agent: the rank it saw fail first
AGENT_STOPPING = "agent_stopping"      # the agent's note: pids of the ranks it signals to stop, a line a time
AGENT_EXITS = "agent_exits"            # the agent's note: ``PID RETURNCODE`` of each rank it stopped and reaped


def output_name(local_rank: int) -> str:
    return f"out_{local_rank}"


class Channels:
    """A private directory of FIFOs to the ranks (torch's agent starts them with ``close_fds``, so
    no descriptor of xlaunch's reaches them; the directory is named in their environment):
    ``out_<i>`` is local rank *i*'s stdout and stderr (``xlaunch --per-rank`` puts it on fds 1 and 2
    before the exec; a restart opens it again); ``ranks`` gets ``+<pgid> <local rank> <pid>`` as
    each rank starts (the watchdog drains it if xlaunch is killed); ``result.json`` is the agent's
    report; ``first_failure.json`` names the rank xlaunch saw fail first, written before it stops
    the others (torch's agent may see those stopped ranks in the same poll, and would take the
    lowest rank as the root cause); ``agent_stopping`` gets a line of pids each time the agent is about
    to stop its ranks (a rank that ended before then failed on its own), ``agent_exits`` how each rank
    it stopped ended (``PID RETURNCODE``, -N after signal N). xlaunch holds a write end of each FIFO, so reads never see end-of-file between ranks;
    a rank finding no reader (xlaunch gone) does not start. :meth:`close` removes it all."""

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

    def note_first_failure(self, local_rank: int, pid: int, status: int) -> None:
        """Tell the agent which rank failed first (:func:`xlaunch.launcher.distributed.agent.root_cause`)."""
        import json

        path = os.path.join(self.path, FIRST_FAILURE)
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as out:
                json.dump({"local_rank": local_rank, "pid": pid, "status": status}, out)
            os.replace(path + ".tmp", path)
        except OSError:
            pass    # the front's own exit status still names that rank

    def agent_stopping(self) -> set[int]:
        """The pids torch's agent has signalled (or is about to signal) to stop, from its note."""
        try:
            with open(os.path.join(self.path, AGENT_STOPPING), "rb") as note:
                text = note.read(1 << 20)
        except OSError:
            return set()
        return {int(word) for word in text.split() if word.isdigit()}

    def agent_exits(self) -> dict[int, int]:
        """pid -> ``Popen.returncode`` (-N: killed by signal N) of the ranks the agent reaped when it stopped them."""
        try:
            with open(os.path.join(self.path, AGENT_EXITS), "rb") as note:
                text = note.read(1 << 20)
        except OSError:
            return {}
        found = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].lstrip(b"-").isdigit():
                found[int(parts[0])] = int(parts[1])
        return found

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
