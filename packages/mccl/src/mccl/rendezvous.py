"""Where an init meets its peers: the rendezvous address, and whether it accepts connections."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any


def address(kwargs: dict[str, Any]) -> str:
    """The rendezvous of ``init_process_group(**kwargs)``, as a human reads it."""
    store = kwargs.get("store")
    if store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        return f"store {host}:{port}" if host else f"store {type(store).__name__}"
    init_method = kwargs.get("init_method")
    if init_method and init_method != "env://":
        return init_method
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"env://{host}:{port}" if host and port else "env:// (MASTER_ADDR/MASTER_PORT unset)"


@dataclass(frozen=True)
class Probe:
    """One TCP connection attempt to a rendezvous: ``error`` is ``None`` when it connected."""

    host: str
    port: int
    error: str | None

    @property
    def reachable(self) -> bool:
        return self.error is None

    def hint(self) -> str:
        """What the attempt means for an init that is still waiting."""
        if self.reachable:
            return f"{self.host}:{self.port} accepts connections, so a peer has not joined yet"
        return f"{self.host}:{self.port} is not reachable ({self.error}): check the address"


def probe(address: str, timeout: float = 0.5) -> Probe | None:
    """Try a TCP connection to the ``host:port`` in ``address``; ``None`` if it names none."""
    hostport = address.split("//", 1)[-1].split(" ", 1)[-1].split("?", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return Probe(host, int(port), None)
    except OSError as exc:
        return Probe(host, int(port), exc.strerror or str(exc))
