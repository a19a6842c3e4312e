"""Claiming a TCP port before any slow work, so that a busy port is one error line at once
(``curvalign serve`` binds first, then loads the run, index and encoder, then listens)."""

from __future__ import annotations

import errno
import socket

from curvalign.errors import CurvalignError


class PortError(CurvalignError, OSError):
    """An address and port that cannot be bound (in use, not this machine's, not permitted)."""


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: connections are refused until the
    server listens on it). ``PortError`` names the address and why it cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise PortError(f"cannot serve on {host}:{port}: unknown host ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # lets a restart reuse a port in TIME_WAIT; on Linux it never shares a listening port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        reason = {
            errno.EADDRINUSE: "the port is already in use (choose another --port or stop what "
            "listens there)",
            errno.EACCES: "permission denied (ports below 1024 need privileges)",
            errno.EADDRNOTAVAIL: "the address is not one of this machine's",
        }.get(err.errno or -1, err.strerror or str(err))
        raise PortError(f"cannot serve on {host}:{port}: {reason}") from None
    return sock


__all__ = ["PortError", "bind_port"]
