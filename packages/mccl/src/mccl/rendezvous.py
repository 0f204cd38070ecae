"""Where an init meets its peers: the rendezvous address, and whether it accepts connections."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


def address(kwargs: dict[str, Any]) -> str:
    """The rendezvous of ``init_process_group(**kwargs)``, as a human reads it."""
    store = kwargs.get("store")
    if store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if not host:
            return f"store {type(store).__name__}"
        return f"store [{host}]:{port}" if ":" in host else f"store {host}:{port}"
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
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6, as in a URL
        if self.reachable:
            return f"{host}:{self.port} accepts connections, so a peer has not joined yet"
        return f"{host}:{self.port} is not reachable ({self.error}): check the address"


def probe(address: str, timeout: float = 0.5) -> Probe | None:
    """Try a TCP connection to the ``host:port`` in ``address`` (a URL such as
    ``tcp://[::1]:29500/``, or ``store host:port``); ``None`` if it names none."""
    where = address.removeprefix("store ")
    try:
        parts = urlsplit(where if "//" in where else f"//{where}")
        host, port = parts.hostname, parts.port
    except ValueError:  # a port out of range or not a number
        return None
    if not host or port is None:
        return None
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return Probe(host, port, None)
    except OSError as exc:
        return Probe(host, port, exc.strerror or str(exc))
