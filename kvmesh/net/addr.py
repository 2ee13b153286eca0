"""Listen and connect addresses of every kvmesh server: the one parser and the one formatter.

An address is ``host:port``; an IPv6 host is written in brackets (``[::1]:7001``). Parsed,
the host is bare (``::1``), as ``socket`` and ``asyncio`` take it; :func:`family_of` picks
the socket family, so a server given an IPv6 address listens on an IPv6 socket.
"""

from __future__ import annotations

import ipaddress
import socket


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)`` with a bare host; a ValueError
    for anything else (no port, a port outside 0-65535 -- the socket layer would take 99999
    modulo 65536 and reach port 34463 --, an unbracketed IPv6 address); a TypeError for a
    non-str."""
    if not isinstance(address, str):
        raise TypeError(f"an address is a 'host:port' str, got {address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"bad address {address!r}: expected 'host:port' or '[v6]:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host:
            raise ValueError(f"bad address {address!r}: empty host")
    elif ":" in host:
        raise ValueError(f"bad address {address!r}: write an IPv6 host in brackets, '[{host}]'")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of :func:`split_host_port` (brackets around an IPv6 host)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def family_of(host: str) -> socket.AddressFamily:
    """The socket family to listen on ``host`` with: AF_INET6 for an IPv6 literal or a name
    that resolves only to IPv6 addresses, else AF_INET."""
    host = host.strip("[]")
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host or None, None, type=socket.SOCK_STREAM)
    except OSError:
        return socket.AF_INET
    families = {i[0] for i in infos}
    return socket.AF_INET if socket.AF_INET in families or not families else socket.AF_INET6
