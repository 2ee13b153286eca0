"""``host:port`` addresses: the one parser of every kvmesh server's and client's address."""

from __future__ import annotations

__all__ = ["split_host_port"]


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``, the brackets removed (the host
    may be empty: callers that need one say so). ValueError without a port, for a port that
    is not ASCII digits, or one outside 0..65535: the socket layer would take 99999 modulo
    65536 and reach port 34463 instead of refusing it."""
    if not isinstance(address, str):
        raise TypeError(f"an address is a 'host:port' str, got {address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ValueError(f"bad address {address!r}, expected host:port")
    p = int(port)
    if p > 65535:
        raise ValueError(f"bad address {address!r}: port {p} is outside 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, p
