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
travel with the first byte (``SCM_RIGHTS``). Standard library only, plus xlaunch's ``binding``
and ``runtime_ext`` in the instance, and ``--auto-optimize``'s hooks in an instance that asks for them.
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


def places_in(env: dict) -> Optional[list[tuple[int, ...]]]:
    """The CPUs of each OpenMP team thread as the instance's environment places them: ``OMP_PLACES``
    (``{0},{1}``) or ``KMP_AFFINITY``'s ``proclist=[{0,1},1]``; None when neither is written that way."""
    import re

    text = env.get("OMP_PLACES", "")
    if not text:
        found = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
        text = found.group(1) if found else ""
    places = []
    for match in re.finditer(r"\{([^}]*)\}|([^,{}]+)", text):
        items = (match.group(1) if match.group(1) is not None else match.group(2)).split(",")
        if not items or not all(item.strip().isdigit() for item in items):
            return None
        places.append(tuple(int(item) for item in items))
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and 0 < int(threads) < len(places):
        places = places[:int(threads)]
    return places or None


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


def become_program(request: dict, notes: Sequence[str]) -> None:
    """In the adopted instance: its environment, OpenMP team, fresh random state, then its program.
    (``notes``: a refused memory policy, which the runner reports once for every instance.)"""
    import gc

    env = {str(k): str(v) for k, v in request["env"].items()}
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    os.environ.update(env)
    gc.enable()
    _pin_openmp_team(env)
    if _hooks_dir() in env.get("PYTHONPATH", "").split(os.pathsep):
        _install_auto_optimize()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:        # a fresh process would have drawn its own seed
        numpy_random.seed()
    if hasattr(sys, "orig_argv"):              # Python 3.10+
        sys.orig_argv = list(request["argv"])
    retitle(request["argv"])
    _run(list(request["argv"]))


def _hooks_dir() -> str:
    """The ``sitecustomize`` folder ``--auto-optimize`` puts on an instance's ``PYTHONPATH`` (plan/shared.py
    leaves it off the server's), found beside the xlaunch this server imported."""
    return os.path.join(os.path.dirname(sys.modules["xlaunch"].__file__), "kernels", "inject", "site")


def _install_auto_optimize() -> None:
    """What that ``sitecustomize`` does at a plain instance's start, here after the fork: the hooks, from
    this instance's environment (torch, when the server imported it, is patched now)."""
    try:
        from xlaunch.kernels.inject import hooks

        hooks.install_from_environment()
    except Exception as error:   # the program must run even when the injection cannot
        sys.stderr.write(f"xlaunch --auto-optimize: not active ({type(error).__name__}: {error})\n")


def retitle(argv: Sequence[str]) -> bool:
    """Show ``argv`` as this process's command line (``ps``, ``pgrep -f``, ``/proc/PID/cmdline``), not the
    server's: written over the server's own argument strings, as setproctitle does (joined by spaces,
    the area's last byte left non-zero so the kernel reads up to the first NUL; cut to the area, which the
    server's JSON argument makes long). False when it cannot (a /proc without the fields)."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])     # arg_start, arg_end: fields 48 and 49
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if size < 2:
        return False
    title = b" ".join(os.fsencode(arg) for arg in argv)[:size - 2]
    ctypes.memmove(start, title + b"\0" * (size - 1 - len(title)) + b" ", size)
    return True


def _pin_openmp_team(env: dict) -> None:
    """The runtime the server loaded read its places there: pin this instance's team as they say."""
    from xlaunch.runtime_ext import openmp

    if not openmp.mapped_runtimes():
        return           # not loaded yet: it will read this instance's environment when it loads
    places = places_in(env)
    if places is None:
        return           # a user's own OMP_PLACES / KMP_AFFINITY spelling: the CPUs stay the process's
    try:
        from xlaunch.runtime_ext.pool import get_thread_count, set_thread_count

        runtime = openmp.loaded_runtime()
        if get_thread_count(runtime) != len(places):   # (setting it also starts torch's pthreadpool)
            set_thread_count(runtime, len(places))

        def pin(thread_num: int, team_size: int) -> None:
            if thread_num < len(places):
                os.sched_setaffinity(0, places[thread_num])

        runtime.run_on_team(len(places), pin)
    except (OSError, RuntimeError, ValueError) as error:
        sys.stderr.write(f"xlaunch: warning: the OpenMP team was not pinned ({error})\n")


def program_of(argv: Sequence[str]) -> tuple[bool, str, list[str]]:
    """``[python, -u, PROGRAM | -m MODULE, ARGS...]`` (an instance's argv) -> (a module?, PROGRAM or MODULE,
    ARGS)."""
    args = list(argv[1:])
    while args[:1] == ["-u"]:
        args = args[1:]
    if args[:1] == ["-m"]:
        return True, args[1], args[2:]
    return False, args[0], args[1:]


def path0(argv: Sequence[str]) -> str:
    """``sys.path[0]`` of that interpreter: the script's real folder, or the working one for ``-m``."""
    module, target, _args = program_of(argv)
    return os.getcwd() if module else os.path.dirname(os.path.realpath(target))


def _run(argv: list[str]) -> None:
    """Run ``[python, -u, PROGRAM | -m MODULE, ARGS...]`` as that interpreter would, as ``__main__``."""
    import runpy

    module, target, args = program_of(argv)
    if module:
        import types

        sys.argv = ["-m", *args]
        sys.modules["__main__"] = types.ModuleType("__main__")   # runpy runs the module in __main__'s dict
        runpy._run_module_as_main(target)   # what ``python -m`` itself calls
        return
    path, sys.argv = target, [target, *args]
    if not os.path.isfile(path):              # a folder or zip with __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    import builtins
    import importlib.machinery
    import io
    import types

    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


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


def _threads_past_a_fork() -> int:
    """This process's threads once the fork handlers ran: a trial fork lets libraries that stop their
    pools before a fork (OpenBLAS, which numpy loads with torch) do so; the threads left would be
    missing from every instance while the library counts on them."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _thread_count()


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
    sys.path[0] = path0(config["argv"])       # not this file's folder: the program's
    module, target, args = program_of(config["argv"])
    sys.argv = ["-m" if module else target, *args]   # what the imports would see (runpy's "-m" for a module)
    if hasattr(sys, "orig_argv"):              # Python 3.10+
        sys.orig_argv = list(config["argv"])
    borrowed = config["root"] not in sys.path
    if borrowed:
        sys.path.append(config["root"])       # last: never shadows the program's modules
    from xlaunch.launcher.run import binding

    started = time.monotonic()
    gc.disable()
    threads, starters = _thread_count(), []
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
        if _thread_count() > threads:          # this import started threads: do they survive a fork?
            after = _threads_past_a_fork()
            if after > threads:
                starters.append(f"{name} ({after - threads})")
                threads = after
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
        become_program(*became)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:             # as the interpreter reports it, without this file's frames
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename == main.__code__.co_filename:
            trace = trace.tb_next
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
