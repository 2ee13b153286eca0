"""Defect 5 of issue 6: a loopback-only engine must not open a UCX listener elsewhere.

UCX's TCP transport listens on every interface by default, and that port is outside
kvmesh's token. A live peer engine (another process, listening on 127.0.0.1) serves a NIXL
READ; then its listening TCP sockets are read from /proc/<pid>/net/tcp{,6} (sockets matched
to the process by inode) and every one must be on a loopback address.

Calibration in the same test: a peer whose user set ``UCX_NET_DEVICES=all`` (kept, as the
user's choice) must show a listener on a non-loopback address here -- otherwise this host has
no interface UCX would listen on, the check could not fail, and the test skips.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import numpy as np
import pytest

from kvmesh.transfer import TransportKind
from kvmesh.transfer import nixl as na

from .util import pattern

pytestmark = pytest.mark.skipif(not na.available(), reason=f"NIXL: {na.unavailable_reason()}")

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _addr(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hexaddr)
    # /proc prints the address as 32-bit words in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return ipaddress.ip_address(socket.inet_ntop(family, raw))


def tcp_listeners(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every listening TCP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                host, port = cols[1].split(":")
                out.append((_addr(host), int(port, 16)))
    return out


def _loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _ucx_listeners(make_engine, make_peer, env: dict[str, str]) -> list:
    """Serve one NIXL READ from a fresh loopback peer; its listeners other than kvmesh's."""
    peer = make_peer("--kind", "dram", "--size", str(1 << 20), "--listen", "127.0.0.1:0", env=env)
    eng = make_engine(transport="nixl")
    local = eng.register(np.zeros(1 << 20, np.uint8))
    seg = eng.open_segment(peer.address, "pool")
    res = eng.read(local, 0, seg, 4096, 8192)
    assert res.transports == [TransportKind.NIXL]
    assert (local.array()[:8192] == pattern(1, 4096, 8192)).all()
    control_port = int(peer.address.rsplit(":", 1)[1])
    listeners = tcp_listeners(peer.proc.pid)
    assert any(port == control_port for _, port in listeners), listeners  # the parser works
    return [(a, p) for a, p in listeners if p != control_port]


def test_loopback_engine_keeps_ucx_listeners_on_loopback(make_engine, make_peer, monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    everywhere = _ucx_listeners(make_engine, make_peer, {"UCX_NET_DEVICES": "all"})
    if not [a for a, _ in everywhere if not _loopback(a)]:
        pytest.skip(
            f"no non-loopback interface UCX listens on here ({everywhere}): "
            "the check could not fail"
        )
    confined = _ucx_listeners(make_engine, make_peer, {})
    assert confined, "the peer's NIXL agent opened no UCX listener at all: nothing was checked"
    outside = [(str(a), p) for a, p in confined if not _loopback(a)]
    assert not outside, f"a loopback engine's UCX listens beyond loopback: {outside}"


def test_device_choice_reaches_the_agent_config(monkeypatch):
    """``ucx_devices`` becomes the agent's NET_DEVICES; the user's own choice is kept."""
    from types import SimpleNamespace

    from kvmesh.transfer.nixl.agent import NixlAgent
    from kvmesh.transfer.transports.nixl import _devices_chosen

    def params(**kw):
        return NixlAgent._backend_params(SimpleNamespace(options=na.NixlOptions(**kw)))

    assert params(ucx_devices="lo")["engine_config"] == "NET_DEVICES=lo"
    assert params(ucx_devices="lo", ucx_tls="tcp")["engine_config"] == "NET_DEVICES=lo,TLS=tcp"
    assert params(ucx_devices="lo", engine_config="net_devices=eth1")["engine_config"] == (
        "net_devices=eth1"
    )
    assert "engine_config" not in params(ucx_devices="eth0,eth1")  # a list: environment only
    assert "engine_config" not in params()
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert not _devices_chosen(na.NixlOptions())
    assert _devices_chosen(na.NixlOptions(ucx_devices="eth0"))
    assert _devices_chosen(na.NixlOptions(engine_config="RNDV_THRESH=inf, NET_DEVICES=eth0"))
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    assert _devices_chosen(na.NixlOptions())
