"""Two network namespaces joined by a veth pair: the engine across a real interface.

Skipped where ``ip netns`` is not permitted (not root, no iproute2, no CAP_NET_ADMIN).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from .util import Peer, pattern, sha

pytestmark = pytest.mark.netns

CLIENT = r"""
import json, sys, numpy as np
from kvmesh.transfer import EngineConfig, Op, TransferEngine
from tests.transfer.util import pattern, sha
addr = sys.argv[1]
out = {}
for label, host in (("far", "host-a"), ("near", None)):
    eng = TransferEngine(config=EngineConfig(listen="10.77.%s.1:0" % sys.argv[2], host_id=host,
                                             transports_disable=["nixl"], token="netns-secret"))
    buf = eng.register(np.zeros(8 << 20, np.uint8))
    seg = eng.open_segment(addr, "pool")
    r = eng.read(buf, 0, seg, 0, 8 << 20)
    ok_read = bool((buf.array() == pattern(1, 0, 8 << 20)).all())
    buf.array()[:] = pattern(40, 0, 8 << 20)
    w = eng.transfer(Op.WRITE, buf, np.arange(8) * (1 << 20), seg,
                     (8 + np.arange(8)[::-1]) * (1 << 20), 1 << 20)
    out[label] = {"read": [k.value for k in r.transports], "write": [k.value for k in w.transports],
                  "ok_read": ok_read, "wrote_sha": sha(buf.array()[(7 << 20):])}
    eng.close()
print(json.dumps(out), flush=True)
"""


def _sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    tag = f"{os.getpid() % 100000}"
    na, nb, subnet = f"kvm-a{tag}", f"kvm-b{tag}", str(os.getpid() % 250 + 1)
    try:
        _sh("ip", "netns", "add", na)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"ip netns not permitted here: {exc}")
    try:
        _sh("ip", "netns", "add", nb)
        _sh(
            "ip", "-n", na, "link", "add", "kva", "type", "veth", "peer", "name", "kvb", "netns", nb
        )
        for ns, dev, ip in (
            (na, "kva", f"10.77.{subnet}.1/24"),
            (nb, "kvb", f"10.77.{subnet}.2/24"),
        ):
            _sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", nb, "route", "add", "default", "dev", "kvb")  # what "primary address" means
        yield na, nb, subnet
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot build the veth pair: {exc.stderr!r}")
    finally:
        for ns in (na, nb):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_transfers_across_a_veth_pair(namespaces):
    na, nb, subnet = namespaces
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The peer runs inside namespace b on the wildcard address: it must advertise its veth
    # address (the one on its default route), not 0.0.0.0. A non-loopback listener needs a
    # token (kvmesh.net check_bind).
    with Peer(
        "--size",
        str(16 << 20),
        "--listen",
        "0.0.0.0:0",
        "--token",
        "netns-secret",
        prefix=("ip", "netns", "exec", nb),
    ) as peer:
        assert peer.address.startswith(f"10.77.{subnet}.2:")
        out = subprocess.run(
            ["ip", "netns", "exec", na, sys.executable, "-c", CLIENT, peer.address, subnet],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=root,
        )
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        # Other host id: the network path over the veth. Same host id (namespaces share
        # /dev/shm): shared memory, although the peer is only reachable over that veth.
        assert res["far"]["read"] == ["tcp"] and res["far"]["write"] == ["tcp"]
        assert res["near"]["read"] == ["shm"] and res["near"]["write"] == ["shm"]
        assert res["far"]["ok_read"] and res["near"]["ok_read"]
        want = sha(pattern(40, 7 << 20, 1 << 20))
        assert res["far"]["wrote_sha"] == res["near"]["wrote_sha"] == want
        assert peer.cmd("sha", offset=8 << 20, length=1 << 20)["sha"] == want  # reversed pages
