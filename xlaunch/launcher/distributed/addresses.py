"""torchrun's addresses checked as torch's agent will parse them (``parse_rendezvous_endpoint``):
``--rdzv-endpoint HOST[:PORT]`` and ``--master-addr HOST``. A typo (``:29400``, ``node 0``,
``host:29400x``) is one line naming the option before anything starts (exit 2), not the agent's
``ValueError`` once it has started (exit 1, the option unnamed). Decisions only: no torch, no
name lookup (a host that does not resolve is the rendezvous' to time out on, with its own line)."""
from __future__ import annotations

import re

from xlaunch.launcher.errors import OptionError

_HOST = re.compile(r"[\w.:-]+")          # torch's own test of a rendezvous host
_PORT = re.compile(r"[0-9]{1,5}")


def check_endpoint(flag: str, text: str) -> None:
    """``HOST[:PORT]`` (an IPv6 host in brackets), as torch reads ``--rdzv-endpoint``; OptionError."""
    endpoint = text.strip()
    if endpoint[:1] == "[" and endpoint[-1:] == "]":
        host, port = endpoint[1:-1], None
    else:
        host, colon, port = endpoint.rpartition(":")
        if not colon:
            host, port = endpoint, None
        elif len(host) > 1 and host[0] == "[" and host[-1] == "]":
            host = host[1:-1]
    if port is not None and not (_PORT.fullmatch(port) and int(port) < 1 << 16):
        raise OptionError(flag, f"{text!r}: the port after the last ':' must be a number 0-65535")
    check_host(flag, host, shown=text)


def check_host(flag: str, host: str, *, shown: str | None = None) -> None:
    """A host name or address torch accepts: letters, digits, ``.``, ``-``, ``_``, ``:``; OptionError."""
    if not _HOST.fullmatch(host):
        what = ("no host before the port" if not host
                else f"{host!r} is not a host name or address (letters, digits, '.', '-', '_', ':')")
        raise OptionError(flag, what if shown is None else f"{shown!r}: {what}")
