"""The runner's side of ``--share-imports``: start a fork server (:mod:`.server`) for each of the
plan's :class:`~xlaunch.launcher.plan.records.ImportServer` s and start instances through it.

A server that cannot start (an import fails, the imports start threads, xlaunch is no child
subreaper) is told once, and its instances start on their own, as without the option.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Callable, Optional

    from xlaunch.launcher.plan.records import ImportServer, Instance
    from xlaunch.launcher.run.spawning import MemoryPolicy

import xlaunch
from xlaunch._records import record
from xlaunch.launcher.run.child import RankProcess
from xlaunch.launcher.run.shared_imports import server as forkserver

SERVER_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")
XLAUNCH_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(xlaunch.__file__)))   # the folder holding xlaunch/
OUTPUT_CAP = 64 << 10          # what of the server's own output is read back
IMPORT_TIMEOUT = 600.0         # seconds a server's imports may take


class ServerUnavailable(Exception):
    """The fork server could not start or serve; the message says why."""


@record(frozen=False)
class ForkServer:
    """One running fork server: :meth:`launch` (or :meth:`start`), :meth:`spawn` per instance, :meth:`close`."""

    spec: ImportServer
    proc: subprocess.Popen
    sock: socket.socket
    output: object                 # the server's own stdout and stderr (a temporary file)
    launched: float                # time.monotonic() when it was started
    seconds: float = 0.0           # how long its imports took, once ready
    ready: bool = False            # it said ready (:meth:`wait_ready` returned)
    shown: int = 0                 # bytes of ``output`` already given out by :meth:`unshown_output`
    cut: int = 0                   # bytes past its cap already reported as left out

    @classmethod
    def start(cls, spec: ImportServer, instance: Instance, *, die_with_parent: bool, memory: MemoryPolicy,
              interrupted: Callable[[], bool], timeout: float = IMPORT_TIMEOUT) -> "ForkServer":
        """Start the server for ``spec`` with ``instance``'s interpreter; return once it imported."""
        server = cls.launch(spec, instance, die_with_parent=die_with_parent, memory=memory)
        server.wait_ready(interrupted, timeout)
        return server

    @classmethod
    def launch(cls, spec: ImportServer, instance: Instance, *, die_with_parent: bool,
               memory: MemoryPolicy) -> "ForkServer":
        """Start the server for ``spec`` with ``instance``'s interpreter, and return while it imports (the
        runner starts every server so, then waits for each: a 2-socket machine's two import at once)."""
        import fcntl
        import tempfile

        from xlaunch.launcher.run import spawning

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        config = {"modules": list(spec.modules), "argv": list(instance.argv), "root": XLAUNCH_ROOT}
        argv = [instance.argv[0], "-u", SERVER_PROGRAM, str(theirs.fileno()), json.dumps(config)]
        output = None
        try:
            output = tempfile.TemporaryFile()
            # the server's writes append wherever this side's reads left the shared offset
            fcntl.fcntl(output.fileno(), fcntl.F_SETFL, fcntl.fcntl(output.fileno(), fcntl.F_GETFL) | os.O_APPEND)
            proc = spawning.pinned_start(
                lambda: subprocess.Popen(
                    argv, env=dict(spec.env), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                    pass_fds=(theirs.fileno(),), start_new_session=True,
                    preexec_fn=spawning.die_with_parent_setup(os.getpid()) if die_with_parent else None),
                bind=instance.bind, cpus=spec.cpus, membind=spec.membind, mem_nodes=spec.mem_nodes, memory=memory)
        except (OSError, subprocess.SubprocessError) as error:
            ours.close()
            if output is not None:
                output.close()
            raise ServerUnavailable(f"cannot start {argv[0]}: {error}") from None
        finally:
            theirs.close()
        return cls(spec, proc, ours, output, time.monotonic())

    def wait_ready(self, interrupted: Callable[[], bool], timeout: float = IMPORT_TIMEOUT) -> None:
        """Until the server imported (``seconds`` says how long that took); :class:`ServerUnavailable`,
        the server stopped, when it cannot serve, ``interrupted()`` turns true or ``timeout`` s passed."""
        try:
            self.seconds = float(self._ready(interrupted, timeout).get("seconds", 0.0))
        except BaseException:
            self.close(kill=True)
            raise
        self.ready = True

    def _ready(self, interrupted: Callable[[], bool], timeout: float) -> dict:
        deadline = self.launched + timeout
        while True:
            if interrupted():
                raise ServerUnavailable("interrupted while it imported")
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"its imports took more than {timeout:g}s")
            readable, _, _ = select.select([self.sock], [], [], 0.1)
            if readable:
                break
        try:
            got = forkserver.receive_message(self.sock)
        except OSError as error:
            got = None
            detail = str(error)
        else:
            detail = ""
        if got is None:
            tail = self.printed().strip().splitlines()[-1:] or [detail or "no reason given"]
            raise ServerUnavailable(f"it ended before it was ready: {tail[0]}")
        reply = got[0]
        if not reply.get("ready"):
            raise ServerUnavailable(str(reply.get("error", "it was not ready")))
        return reply

    def spawn(self, instance: Instance, stdin: Optional[int], memory: MemoryPolicy) -> RankProcess:
        """Fork ``instance`` from the server (OSError when it could not be started). ``stdin``: None
        for xlaunch's own, a descriptor to pass, or ``subprocess.DEVNULL``."""
        from xlaunch.launcher.run import binding

        policy = None
        if instance.bind == "native" and memory.refused is None:
            policy = binding.mempolicy_for(instance.membind, instance.mem_nodes)
        request = {
            "argv": list(instance.argv),
            "env": dict(instance.env),
            "cpus": list(instance.cpus) if instance.bind == "native" else [],
            "mempolicy": [policy[0], list(policy[1])] if policy else None,
            "parent": os.getpid(),
        }
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        fds = [write_fd] + ([0] if stdin is None else [stdin] if stdin >= 0 else [])   # else /dev/null
        try:
            forkserver.send_message(self.sock, request, fds)
            got = forkserver.receive_message(self.sock)
        except OSError as error:
            os.close(read_fd)
            raise OSError(f"the fork server failed: {error}") from None
        finally:
            os.close(write_fd)
        if got is None or "pid" not in got[0]:
            os.close(read_fd)
            why = got[0].get("error", "no reason given") if got is not None else "it ended"
            raise OSError(f"the fork server could not start it ({why})")
        reply = got[0]
        if reply.get("refused") and memory.refused is None:
            memory.refused = OSError(0, str(reply["refused"][0]))
        pid = int(reply["pid"])
        return RankProcess(pid, pid, read_fd)              # its own session: its group is its pid

    def printed(self) -> str:
        """What the server itself printed (its imports' warnings), at most :data:`OUTPUT_CAP` bytes."""
        try:
            self.output.seek(0)
            return self.output.read(OUTPUT_CAP).decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def unshown_output(self, cap: int = OUTPUT_CAP) -> tuple[bytes, int]:
        """What the server printed since the last call (its imports' messages and warnings, in the order
        written), at most ``cap`` bytes in all calls together, and how many bytes past that were left out."""
        try:
            size = os.fstat(self.output.fileno()).st_size
            self.output.seek(self.shown)
            data = self.output.read(max(0, min(size, cap) - self.shown))
        except (OSError, ValueError):
            return b"", 0
        self.shown += len(data)
        left_out = max(0, size - max(cap, self.shown) - self.cut)
        self.cut += left_out
        return data, left_out

    def close(self, *, kill: bool = False, grace: float = 5.0) -> None:
        """End of stream to the server, which then exits; reap it."""
        try:
            self.sock.close()
        except OSError:
            pass
        if kill and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
