"""A forked ``--share-imports`` instance becoming its program (see :mod:`.server`): its environment, OpenMP
team, random state, ``--auto-optimize`` hooks and command line, then the program run as ``python -u`` would
run it (``__main__``, ``sys.argv``, ``sys.path[0]``, ``-m`` through runpy).

Imported by the server once xlaunch is on its path; standard library only, plus xlaunch's ``runtime_ext``
and, in an instance that asks for them, the ``--auto-optimize`` hooks.
"""
from __future__ import annotations

import os
import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional, Sequence


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


def take_command_line(argv: Sequence[str]) -> None:
    """``sys.argv`` and ``sys.orig_argv`` as that interpreter has them before the program runs (runpy's ``-m``
    first for a module, which ``python -m`` replaces by the module's path)."""
    module, target, args = program_of(argv)
    sys.argv = ["-m" if module else target, *args]
    if hasattr(sys, "orig_argv"):              # Python 3.10+
        sys.orig_argv = list(argv)


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
    if _asks_for_hooks(env):
        _install_auto_optimize()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:        # a fresh process would have drawn its own seed
        numpy_random.seed()
    retitle(request["argv"])
    _run(list(request["argv"]))


def _asks_for_hooks(env: dict) -> bool:
    """``--auto-optimize`` put its ``sitecustomize`` folder on this instance's ``PYTHONPATH`` (plan/shared.py
    leaves it off the server's). Its dtype variable comes with it: without that, nothing is imported."""
    if "XLAUNCH_AUTO_OPTIMIZE" not in env:
        return False
    from xlaunch.kernels.inject import SITE_DIR

    return SITE_DIR in env.get("PYTHONPATH", "").split(os.pathsep)


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


def _run(argv: list[str]) -> None:
    """Run ``[python, -u, PROGRAM | -m MODULE, ARGS...]`` as that interpreter would, as ``__main__``."""
    import runpy

    module, path, _args = program_of(argv)
    take_command_line(argv)
    if module:
        import types

        sys.modules["__main__"] = types.ModuleType("__main__")   # runpy runs the module in __main__'s dict
        runpy._run_module_as_main(path)   # what ``python -m`` itself calls
        return
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
