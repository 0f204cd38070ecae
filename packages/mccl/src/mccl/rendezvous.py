"""Where an init meets its peers: the rendezvous address, and whether it accepts connections."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


def host_port(host: str, port: object) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:29500``) as in a URL."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def address(kwargs: dict[str, Any]) -> str:
    """The rendezvous of ``init_process_group(**kwargs)``, as a human reads it."""
    store = kwargs.get("store")
    if store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if not host:
            return f"store {type(store).__name__}"
        return f"store {host_port(host, port)}"
    init_method = kwargs.get("init_method")
    if init_method and init_method != "env://":
        return init_method
    unset = unset_master()
    if unset:
        return f"env:// ({' and '.join(unset)} unset)"
    return f"env://{host_port(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])}"


MASTER = ("MASTER_ADDR", "MASTER_PORT")
"""The environment variables that give torch's ``env://`` rendezvous its address."""


def unset_master() -> list[str]:
    """The names in :data:`MASTER` that are unset or empty in the environment, in that order."""
    return [name for name in MASTER if not os.environ.get(name)]


@dataclass(frozen=True)
class Probe:
    """One TCP connection attempt to a rendezvous: ``error`` is ``None`` when it connected;
    ``resolved`` is false when the host name resolved to no address."""

    host: str
    port: int
    error: str | None
    resolved: bool = True

    @property
    def reachable(self) -> bool:
        return self.error is None

    def hint(self, world_size: int = -1) -> str:
        """What the attempt means for an init of ``world_size`` ranks (-1: unknown) that is
        still waiting."""
        where = host_port(self.host, self.port)
        if self.reachable and world_size == 1:
            return (
                f"{where} accepts connections, and at world size 1 no peer is awaited: "
                f"torch's init itself has not finished"
            )
        if self.reachable:
            return f"{where} accepts connections, so a peer has not joined yet"
        if not self.resolved:
            return f"host {self.host!r} does not resolve ({self.error}): check the address"
        return f"{where} is not reachable ({self.error}): check the address"


def _resolve(host: str, port: int, timeout: float) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo`` for a TCP connection, waiting at most ``timeout`` seconds: the
    lookup runs in a daemon thread, as a slow or broken DNS can take many seconds."""
    found: list[Any] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=lookup, name="mccl-probe-dns", daemon=True)
    thread.start()
    thread.join(timeout)
    if not found:
        raise socket.gaierror(f"no answer from DNS within {timeout:g}s")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def probe(address: str, timeout: float = 0.5) -> Probe | None:
    """Try a TCP connection to the ``host:port`` in ``address`` (a URL such as
    ``tcp://[::1]:29500/``, or ``store host:port``); ``None`` if it names none. The host's
    lookup and the connection each take at most ``timeout`` seconds."""
    where = address.removeprefix("store ")
    try:
        parts = urlsplit(where if "//" in where else f"//{where}")
        host, port = parts.hostname, parts.port
    except ValueError:  # a port out of range or not a number
        return None
    if not host or port is None:
        return None
    try:
        addresses = _resolve(host, port, timeout)
    except socket.gaierror as exc:
        return Probe(host, port, exc.strerror or str(exc), resolved=False)
    except OSError as exc:
        return Probe(host, port, exc.strerror or str(exc))
    deadline = time.monotonic() + timeout
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(left)
            try:
                sock.connect(sockaddr)
                return Probe(host, port, None)
            except OSError as exc:
                error = exc
    return Probe(host, port, (error.strerror or str(error)) if error else "timed out")
