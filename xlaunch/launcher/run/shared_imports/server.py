"""The fork server of ``xlaunch --share-imports``: import once, fork every instance from that process.

The runner starts this file as a program (``python -u server.py FD CONFIG``) with its
instances' interpreter, common environment, CPUs and memory policy. It imports the named modules,
freezes what it imported out of the garbage collector's reach (``gc.freeze``: a collection would
otherwise write to every object and copy its page), says ``ready``, then serves one request per
instance on the socket ``FD``: the instance's argv, environment, CPUs and memory policy, with its
output pipe (and stdin) passed as file descriptors. The server ends when the runner closes the
socket; the instances it forked keep its pages, shared copy-on-write.

Each instance is forked twice (server -> intermediate -> instance) and the intermediate exits at
once, so the instance is adopted by xlaunch, the child subreaper above it: xlaunch reaps it and
its process group as it does an instance it started itself. Before it runs the program the
instance takes its own session, CPUs, memory policy and output; tells the server it is ready;
waits to be xlaunch's child, then asks to die with xlaunch (``PR_SET_PDEATHSIG``); takes its whole
environment; and, when the server loaded an OpenMP runtime (importing torch does), pins its
OpenMP team to the places its environment names, which that runtime read once, in the server.

Framing (both directions): a 4-byte big-endian length, then that much JSON; file descriptors
travel with the first byte (``SCM_RIGHTS``). Standard library only, plus xlaunch's ``binding``, and
:mod:`.program` for what the instance does once it is xlaunch's child.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional, Sequence

MAX_MESSAGE = 16 << 20        # an environment is a few KiB; anything this large is not ours
MAX_FDS = 4
ADOPTION_TIMEOUT = 10.0       # seconds an instance waits to become xlaunch's child


class ProtocolError(OSError):
    """A malformed or truncated message on the fork server's socket."""


def send_message(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """One framed JSON message, ``fds`` passed with its first byte."""
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else sock.send(payload)
    if sent < len(payload):
        sock.sendall(payload[sent:])


def receive_message(sock: socket.socket) -> Optional[tuple[dict, list[int]]]:
    """The next message and the descriptors that came with it; None at a clean end of stream."""
    head, fds, _flags, _address = socket.recv_fds(sock, 4, MAX_FDS)
    if not head:
        for fd in fds:
            os.close(fd)
        return None
    try:
        head += _receive_exactly(sock, 4 - len(head))
        (size,) = struct.unpack("!I", head)
        if size > MAX_MESSAGE:
            raise ProtocolError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
        message = json.loads(_receive_exactly(sock, size))
        if not isinstance(message, dict):
            raise ProtocolError("a message that is not a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ProtocolError("the stream ended inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------------------ server

def serve(sock: socket.socket, binding: Any) -> Optional[tuple[dict, Any]]:
    """Answer requests until the runner closes the socket (None); in a forked instance, return its
    request and what it noted (the instance then runs the program)."""
    while True:
        got = receive_message(sock)
        if got is None:
            return None
        request, fds = got
        became = _start_instance(sock, request, fds, binding)
        if became is not None:
            return became


def _start_instance(sock: socket.socket, request: dict, fds: list[int], binding: Any) -> Optional[tuple[dict, Any]]:
    report_r, report_w = os.pipe()
    try:
        intermediate = os.fork()
    except OSError as error:
        for fd in (report_r, report_w, *fds):
            os.close(fd)
        send_message(sock, {"error": f"fork: {error.strerror or error}"})
        return None
    if intermediate == 0:
        os.close(report_r)
        became = _intermediate(sock, request, fds, report_w, binding)
        if became is not None:
            return became
        os._exit(0)
    os.close(report_w)
    for fd in fds:
        os.close(fd)
    with os.fdopen(report_r, "rb") as report:
        text = report.read(1 << 16)
    os.waitpid(intermediate, 0)
    try:
        reply = json.loads(text) if text else {"error": "the forked instance ended before it was ready"}
    except ValueError:
        reply = {"error": "the forked instance sent a malformed report"}
    send_message(sock, reply)
    return None


def _intermediate(sock: socket.socket, request: dict, fds: list[int], report_w: int,
                  binding: Any) -> Optional[tuple[dict, Any]]:
    """Fork the instance, relay its readiness to the server, and exit (the instance is orphaned)."""
    try:
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(report_w)
            return request, _become_instance(sock, request, fds, ready_w, binding)
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            text = ready.read(1 << 16)
        try:
            report = json.loads(text) if text else {"error": "it ended before it was ready"}
        except ValueError:
            report = {"error": "malformed readiness"}
        os.write(report_w, json.dumps({"pid": pid, **report}).encode())
    except BaseException as error:   # the intermediate never returns into the server's loop
        try:
            os.write(report_w, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
        finally:
            os._exit(1)
    os._exit(0)


def _become_instance(sock: socket.socket, request: dict, fds: list[int], ready_w: int, binding: Any) -> list[str]:
    """In the forked instance: take its session, CPUs, memory policy, output; say ready; wait to be
    adopted by xlaunch. Returns why a memory policy was refused, if it was (the runner says it once).
    Never returns on failure."""
    notes: list[str] = []
    intermediate = os.getppid()
    try:
        os.setsid()
        policy = request.get("mempolicy")
        if policy:
            try:
                binding.set_mempolicy(int(policy[0]), [int(n) for n in policy[1]])
            except OSError as refused:
                notes.append(refused.strerror or str(refused))
        cpus = [int(c) for c in request.get("cpus") or ()]
        if cpus:
            os.sched_setaffinity(0, cpus)
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        if len(fds) > 1:
            os.dup2(fds[1], 0)
        else:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sock.close()
    except BaseException as error:
        os.write(ready_w, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
        os._exit(127)
    os.write(ready_w, json.dumps({"refused": notes}).encode())
    os.close(ready_w)
    parent = int(request["parent"])
    deadline = time.monotonic() + ADOPTION_TIMEOUT
    while True:
        now_parent = os.getppid()              # read once: the intermediate may exit between two reads
        if now_parent == parent:
            break
        if now_parent != intermediate or time.monotonic() > deadline:
            os._exit(128 + 15)   # adopted by someone else: xlaunch is gone or is no subreaper
        time.sleep(0.0005)
    binding.die_with_parent()
    if os.getppid() != parent:
        os._exit(128 + 15)
    return notes


def leave_without_exit_handlers() -> None:
    """The server's end, once every instance is forked: what the imports set up (``atexit`` handlers, a
    scratch folder they remove, finalizers, buffered files) is the instances' now, and they run it at
    their own exits; the server running it too would remove what they still use. Its streams are
    flushed, then it leaves at once (``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(0)


def _threads_a_fork_leaves(known: int) -> int:
    """How many threads beyond ``known`` this process has once the fork handlers ran (0 without a fork when
    none were started): a trial fork lets libraries that stop their pools before a fork (OpenBLAS, which
    numpy loads with torch) do so; the threads left would be missing from every instance while the
    library counts on them."""
    if _thread_count() <= known:
        return 0
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return max(0, _thread_count() - known)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def main(argv: list[str]) -> int:
    """``server.py FD CONFIG``: CONFIG is JSON with ``modules``, ``argv`` (an instance's, for its
    ``sys.path[0]``) and ``root`` (the folder xlaunch is imported from)."""
    import gc
    import importlib

    sock = socket.socket(fileno=int(argv[1]))
    config = json.loads(argv[2])
    sys.path.append(config["root"])           # for xlaunch's own parts, before the program's path is set
    from xlaunch.launcher.run import binding
    from xlaunch.launcher.run.shared_imports import program

    sys.path.pop()
    sys.path[0] = program.path0(config["argv"])   # not this file's folder: the program's
    program.take_command_line(config["argv"])   # what the imports would see in the program's interpreter
    borrowed = config["root"] not in sys.path
    if borrowed:
        sys.path.append(config["root"])       # last: never shadows the program's modules

    started = time.monotonic()
    gc.disable()
    threads, starters = 1, []                  # the main thread alone may be forked
    extra = _threads_a_fork_leaves(threads)
    if extra:
        send_message(sock, {"error": f"the interpreter's start-up (a sitecustomize or .pth file) started "
                                     f"{extra} thread(s) that a fork would leave behind"})
        return 1
    for name in config["modules"]:
        try:
            importlib.import_module(name)
        except BaseException as error:        # whatever the module raised: the runner says it, and where
            trace = error.__traceback__
            while trace is not None and trace.tb_next is not None:
                trace = trace.tb_next
            where = f" (at {trace.tb_frame.f_code.co_filename}:{trace.tb_lineno})" if trace is not None else ""
            if isinstance(error, ImportError) and error.name == name:
                where = ""                      # the module itself is missing: nothing to point at
            send_message(sock, {"error": f"import {name}: {type(error).__name__}: {error}{where}"})
            return 1
        extra = _threads_a_fork_leaves(threads)
        if extra:
            starters.append(f"{name} ({extra})")
            threads += extra
    if starters:
        them = "it" if len(starters) == 1 else "them"
        send_message(sock, {"error": f"importing {', '.join(starters)} started thread(s) that a fork would leave "
                                     f"behind (leave {them} out of --share-imports)"})
        return 1
    gc.collect()
    gc.freeze()
    send_message(sock, {"ready": True, "seconds": round(time.monotonic() - started, 3)})
    became = serve(sock, binding)
    if became is None:
        leave_without_exit_handlers()
    if borrowed:                              # the program sees its own sys.path (xlaunch stays imported)
        sys.path.remove(config["root"])
    try:
        program.become_program(*became)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:             # as the interpreter reports it, without the server's frames
        trace, ours = error.__traceback__, {main.__code__.co_filename, program.__file__}
        while trace is not None and trace.tb_frame.f_code.co_filename in ours:
            trace = trace.tb_next
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
