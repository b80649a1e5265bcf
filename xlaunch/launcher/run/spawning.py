"""Starting one instance: ``argv`` exec'd directly (never a shell) with its complete ``env``, in
its own session and process group, stdout and stderr merged into one pipe, pinned when the plan
binds natively, and set to die with xlaunch.

Pinning (``bind == "native"``) pins the spawning thread around the fork: affinity and memory
policy are inherited across fork and exec, see :mod:`xlaunch.launcher.run.binding`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Sequence

from xlaunch.launcher.plan.records import Instance


class MemoryPolicy:
    """Whether the kernel accepts memory policies here; refused once, never asked again."""

    def __init__(self) -> None:
        self.refused: Optional[OSError] = None


def spawn(instance: Instance, *, stdin: Optional[int], die_with_parent: bool,
          memory: MemoryPolicy) -> subprocess.Popen:
    """Start ``instance``; raises OSError when it cannot be started."""
    return pinned_start(lambda: _popen(instance, stdin, die_with_parent), bind=instance.bind, cpus=instance.cpus,
                        membind=instance.membind, mem_nodes=instance.mem_nodes, memory=memory)


def pinned_start(start: Callable[[], Any], *, bind: str, cpus: Sequence[int], membind: str,
                 mem_nodes: Sequence[int], memory: MemoryPolicy) -> Any:
    """``start()`` (a fork) with the spawning thread pinned to ``cpus`` and ``membind`` on ``mem_nodes`` when
    ``bind`` is native; a refused memory policy is noted in ``memory`` and the start retried on the CPUs alone."""
    if bind != "native":
        return start()
    from xlaunch.launcher.run import binding

    policy = None if memory.refused else binding.mempolicy_for(membind, mem_nodes)
    try:
        with binding.pinned_thread(cpus, policy):
            return start()
    except binding.MemoryPolicyRefused as refused:
        memory.refused = refused
    with binding.pinned_thread(cpus, None):
        return start()


def _popen(instance: Instance, stdin: Optional[int], die_with_parent: bool) -> subprocess.Popen:
    return subprocess.Popen(
        list(instance.argv),
        env=dict(instance.env),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
        preexec_fn=die_with_parent_setup(os.getpid()) if die_with_parent else None,
    )


def die_with_parent_setup(parent_pid: int) -> Callable[[], None]:
    """The child's only pre-exec step: SIGTERM when xlaunch dies, even if it already has."""
    from xlaunch.launcher.run import binding

    def setup() -> None:
        binding.die_with_parent(signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(128 + signal.SIGTERM)

    return setup


def start_failure(error: OSError, instance: Instance) -> tuple[int, str]:
    """Shell-style status and a message for an instance that could not start."""
    program = instance.argv[0] if instance.argv else "(empty argv)"
    if isinstance(error, FileNotFoundError):
        if os.path.isfile(program):        # it is there: the interpreter its #! line names is not
            return 127, f"{program}: its interpreter (the #! line) was not found{_shebang(program)}"
        return 127, f"{program}: command not found"
    if isinstance(error, PermissionError):
        return 126, f"{program}: permission denied"
    return 1, f"{program}: {error}"


def _shebang(program: str) -> str:
    """`` ('/usr/bin/pyton3')``: the interpreter a script's ``#!`` line names, said how the kernel read it
    (a Windows line end makes ``/bin/sh\\r``); empty when it cannot be read."""
    from xlaunch.userfiles import read_head

    head = read_head(program, 256)
    if not head.startswith(b"#!"):
        return ""
    words = head[2:].split(b"\n", 1)[0].lstrip(b" \t").split(None, 1)
    if not words:
        return ""
    interpreter = words[0].decode("utf-8", "replace")
    if len(words) == 1 and head[2:].split(b"\n", 1)[0].endswith(b"\r"):
        interpreter += "\r"                  # split() took the \r; the kernel did not
    windows = ": the file has Windows line ends, \\r\\n" if interpreter.endswith("\r") else ""
    return f" ({interpreter!r}{windows})"


def single_threaded() -> bool:
    """A pre-exec function is only safe when the launcher has no other thread."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return threading.active_count() == 1


def stdin_for(count: int) -> Optional[int]:
    """Several instances, or a terminal: no instance reads xlaunch's stdin."""
    try:
        tty = os.isatty(0)
    except OSError:
        tty = False
    return subprocess.DEVNULL if count > 1 or tty else None
