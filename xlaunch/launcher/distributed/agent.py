"""torch's elastic agent, run by the xlaunch front as its child:
``python -m xlaunch.launcher.distributed.agent TORCHRUN_OPTIONS -- WORKER_COMMAND...``.

The agent (``torch.distributed.run``) keeps rendezvous, restarts and failure detection. This
entry adds three things:

* every wait of the agent for its workers to stop is capped at the front's grace period
  (``XLAUNCH_FRONT_GRACE``): torch's agent sends SIGTERM to the other workers when one fails, and
  between restarts, then waits a fixed 30 s before SIGKILL whatever ``--shutdown-timeout`` says
  (``PContext.close``'s default). The front enforces the grace period on the rank groups as well.
  Before it signals, the agent notes the pids it stops (``AGENT_STOPPING``), so the front does not
  take a rank that ended on its own at the same moment for one it stopped; after, how each ended
  (``AGENT_EXITS``), for a rank it reaped before the front read its status;
* the outcome goes to the front's result file (:data:`xlaunch.launcher.distributed.channels.RESULT`): the job's status,
  the exit code of every rank the agent saw fail and the first of them, for the front's summary;
* the exit status is the job's: 0, the first failed rank's exit code (128+N when it was killed
  by signal N), 128+N when the agent got signal N, 1 when the agent itself failed. The first
  failed rank is the one the front saw fail first (its note), else the first not killed by
  SIGTERM (:func:`root_cause`): the front stops the other ranks at once, and torch's agent
  stops them too, then takes the lowest rank among failures of the same second (often one
  stopped by SIGTERM) for the root cause;
* SIGINT before torch's own handlers (which come with the ranks) ends the agent as SIGTERM
  does, without a ``KeyboardInterrupt`` traceback out of an import or the rendezvous;
* torch's per-attempt folders (each rank's ``error.json``) go under the front's private folder, which
  the front removes at the end (``AGENT_LOGS``): left to torch, every job left a
  ``/tmp/torchelastic_*`` tree behind (2,069 on this project's VM);
* a rendezvous that does not complete within its bound (``--rdzv-conf``, from ``--rdzv-timeout``)
  is one error line that says what was waited for: the other nodes, node 0's store at the
  master address and port, or the rendezvous endpoint (:func:`rendezvous_wait`).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

from xlaunch._errors import error_line
from xlaunch.launcher.distributed.ranks import CHANNELS_VAR, GRACE_VAR
from xlaunch.launcher.distributed.channels import AGENT_EXITS, AGENT_STOPPING, FIRST_FAILURE, RESULT

AGENT_LOGS = "torchelastic"     # torchrun's --log-dir, in the front's private folder


def cap_shutdown_waits(grace: Optional[float], stopping: Optional[str] = None) -> bool:
    """Make ``PContext.close`` wait at most ``grace`` seconds before SIGKILL (None: torch's own wait),
    and first append the pids it is about to signal to the file ``stopping`` (the front's
    :data:`~xlaunch.launcher.distributed.channels.AGENT_STOPPING`: a rank that ended before the agent
    signalled it failed on its own); False if ``close`` cannot be wrapped."""
    import inspect

    from torch.distributed.elastic.multiprocessing import api

    original = getattr(api.PContext, "close", None)
    if original is None or "timeout" not in inspect.signature(original).parameters:
        return False

    def close(self: Any, death_sig: Any = None, timeout: float = 30) -> Any:
        if stopping:
            _note_stopping(self, stopping)
        try:
            return original(self, death_sig, timeout if grace is None else min(timeout, grace))
        finally:
            if stopping:
                _note_exits(self, os.path.join(os.path.dirname(stopping), AGENT_EXITS))

    api.PContext.close = close  # type: ignore[method-assign]
    return True


def _note_stopping(context: Any, path: str) -> None:
    """Append the pids of ``context``'s workers still running (torch signals only those), one line;
    every worker when they cannot be told apart. Written before any signal is sent."""
    handlers = getattr(context, "subprocess_handlers", None)
    try:
        if handlers:
            pids = [h.proc.pid for h in handlers.values() if h.proc.poll() is None]
        else:
            pids = list(context.pids().values())
        with open(path, "a", encoding="ascii") as note:
            note.write(" ".join(map(str, pids)) + "\n")
    except Exception:    # noqa: BLE001 - the front then keeps labelling such ranks as stopped
        pass


def _note_exits(context: Any, path: str) -> None:
    """Append ``PID CODE`` for each worker the agent reaped (``Popen.returncode``: -N after signal N), so
    that the front knows how a rank ended whose zombie it did not see (one of an earlier attempt too)."""
    try:
        lines = "".join(f"{h.proc.pid} {h.proc.returncode}\n" for h in context.subprocess_handlers.values()
                        if h.proc.returncode is not None)
        with open(path, "a", encoding="ascii") as note:
            note.write(lines)
    except Exception:    # noqa: BLE001 - the front then says "ended", or takes the agent's report
        pass


def _conf(text: Optional[str]) -> dict[str, str]:
    return dict(part.split("=", 1) for part in (text or "").split(",") if "=" in part)


def rendezvous_wait(args: Any) -> tuple[str, str]:
    """``(what the agent waits for before its ranks can start, for how long)`` from torchrun's
    parsed arguments, in words for an error line."""
    conf = _conf(getattr(args, "rdzv_conf", None))
    bound = conf.get("join_timeout") or conf.get("timeout") or "torch's default"
    backend = (getattr(args, "rdzv_backend", None) or "static").lower()
    nnodes = str(getattr(args, "nnodes", "1"))
    if backend == "static":
        endpoint = getattr(args, "rdzv_endpoint", None) or f"{args.master_addr}:{args.master_port}"
        rank = int(getattr(args, "node_rank", 0) or 0)
        if rank == 0:
            what = (f"the other nodes of --nnodes {nnodes} at the master address {endpoint} "
                    "(node 0 hosts the rendezvous store there)")
        else:
            what = f"node 0's rendezvous store at the master address {endpoint} (this is node {rank} of {nnodes})"
    else:
        what = f"the rendezvous of --nnodes {nnodes} ({backend} at {getattr(args, 'rdzv_endpoint', None)})"
    return what, (f"{bound} s" if bound[:1].isdigit() else bound)


def is_rendezvous_failure(error: BaseException) -> bool:
    """A rendezvous or store wait that ran out (or could not reach its endpoint)."""
    names = {klass.__name__ for klass in type(error).__mro__}
    return bool(names & {"RendezvousError", "DistError", "TimeoutError", "ConnectionError", "socket.timeout"}) \
        or "timed out" in str(error).lower() or "timeout" in str(error).lower()


def root_cause(failed: Any, note_path: Optional[str]) -> Any:
    """``failed`` (torch's ``ChildFailedError``) with its root cause (its first failure) set to the
    rank that failed on its own: the one the front noted as failing first, else the first (by
    torch's order) not killed by SIGTERM or SIGKILL, else the first killed by SIGKILL. torch takes the
    smallest timestamp, in whole seconds, and the lowest rank on a tie: often a rank that it, or the
    front, had just stopped with SIGTERM, or with SIGKILL when the rank ignored SIGTERM for the grace
    period (seen under load: the job ended 137 where rank 1's own exit 3 came first)."""
    import signal

    failures = failed.failures
    stopped, killed = -int(signal.SIGTERM), -int(signal.SIGKILL)
    try:
        with open(note_path or "", encoding="utf-8") as note:
            pid = int(json.load(note)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        pid = None
    noted = [r for r, f in failures.items() if f.pid == pid and f.exitcode != stopped]
    ordered = sorted(failures, key=lambda r: failures[r].timestamp)    # stable: torch's order on ties
    own = [r for r in ordered if failures[r].exitcode not in (stopped, killed)]
    escalated = [r for r in ordered if failures[r].exitcode == killed]   # SIGKILL: a stop that waited, or OOM
    rank = (noted or own or escalated or ordered)[0]
    if rank == failed.get_first_failure()[0]:
        return failed
    root = failures[rank]
    root.timestamp = min(f.timestamp for f in failures.values())
    return type(failed)(failed.name, {rank: root, **{r: f for r, f in failures.items() if r != rank}})


def _write_result(path: Optional[str], result: dict[str, Any]) -> None:
    if not path:
        return
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as out:
            json.dump(result, out)
        os.replace(path + ".tmp", path)
    except OSError:
        pass   # the front then relies on what it saw itself


def run(argv: list[str], environ: dict[str, str]) -> int:
    at = argv.index("--")
    options, worker = argv[:at], argv[at + 1:]
    channels = environ.get(CHANNELS_VAR)
    result_path = os.path.join(channels, RESULT) if channels else None
    note_path = os.path.join(channels, FIRST_FAILURE) if channels else None
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError as exc:
        sys.stderr.write(f"xlaunch: error: --nproc-per-node needs torch.distributed ({exc})\n")
        _write_result(result_path, {"status": 1, "error": str(exc)})
        return 1
    grace = environ.get(GRACE_VAR)
    stopping = os.path.join(channels, AGENT_STOPPING) if channels else None
    if not cap_shutdown_waits(float(grace) if grace is not None else None, stopping) and grace is not None:
        sys.stderr.write("xlaunch: note: this torch's agent waits its own time before SIGKILL; "
                         "the front still kills the ranks after --grace-period\n")
    parser = torchrun.get_args_parser()
    known = getattr(parser, "_option_string_actions", None)
    if known is not None and "--shutdown-timeout" not in known and "--shutdown-timeout" in options:
        at = options.index("--shutdown-timeout")          # older torch: its fixed 30 s
        options = options[:at] + options[at + 2:]
    if channels and not {"--log-dir", "--log_dir"} & set(options):
        options = [*options, "--log-dir", os.path.join(channels, AGENT_LOGS)]
    args = parser.parse_args([*options, worker[0]])
    args.training_script_args = worker[1:]
    result: dict[str, Any] = {"status": 0, "failures": {}}
    try:
        torchrun.run(args)
    except ChildFailedError as reported:
        failed = root_cause(reported, note_path)
        sys.stderr.write(failed.format_msg() + "\n")
        _rank, first = failed.get_first_failure()
        code = first.exitcode
        result["status"] = 128 - code if code < 0 else code or 1
        result["first"] = first.local_rank
        result["failures"] = {str(f.local_rank): (128 - f.exitcode if f.exitcode < 0 else f.exitcode)
                              for f in failed.failures.values()}
    except SignalException as stopped:
        result["status"] = 128 + int(stopped.sigval)
    except Exception as error:   # rendezvous timeouts, unreachable endpoints, bad backend names
        if is_rendezvous_failure(error):
            what, bound = rendezvous_wait(args)
            message = f"rendezvous: waited {bound} for {what}; the ranks were not started ({error_line(error)})"
        else:
            message = f"torch's elastic agent failed: {error_line(error)}"
        sys.stderr.write(f"xlaunch: error: {message}\n")
        result = {"status": 1, "error": message}
    _write_result(result_path, result)
    return int(result["status"])


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)   # until torch's handlers: SIGINT ends it as SIGTERM does
    sys.exit(run(sys.argv[1:], dict(os.environ)))
