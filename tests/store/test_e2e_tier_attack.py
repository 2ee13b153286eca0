"""Forged ends of disk-tier work against LIVE processes (issue 19; docs/store.md, "Disk
tier"): a ``kvmesh master`` with a cluster secret, a ``kvmesh node --disk`` holding its node
credential, this process as an application with the client credential -- and as attackers.

The master hands demotions and promotions to the node of the disk copy; the node copies and
reports ``DemoteEndReq`` / ``PromoteEndReq``. An end makes copies COMPLETE (a disk copy and
its crc, a memory copy), so a forged one would list bytes that were never written. Here the
node is stopped (SIGSTOP) while real work is in flight, and ends are forged:

* by an authenticated client (a client never speaks as a node), and by another node;
* by the node's own identity for work it was never given: an unstarted demotion or
  promotion, a promotion tag that is a writer's reservation, another object at a started
  promotion's offset, wrong versions, offsets, segments and checksums, unequal columns,
  oversized batches, replays of ended work with other fields;
* without any credential (refused at the handshake, before any request is decoded).

Each is refused with a clear error, the master's table of every object is unchanged, and the
master goes on serving: once the node runs again its real ends are taken, every object reads
byte-exact, and replays of them are refused. Nothing depends on speed: waits poll the
master's state under generous deadlines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from kvmesh.net import AuthFailed, SecurityConfig, framing
from kvmesh.net import identity as I
from kvmesh.net.handshake import client_handshake
from kvmesh.replog.net.server import free_ports
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.rpc import MasterClient
from kvmesh.store.types import ReplicateConfig
from kvmesh.transfer import EngineConfig, TransferEngine

from .test_e2e_cli import _line

SECRET = "tier-attack-secret"
NODE = "node-d"
MEM = 2 << 20
DISK = 32 << 20
SIZE = 64 << 10
BATCH = 4 * SIZE  # demotions in flight at most (master flags): some memory-only objects rest
HITS = 2  # promote_hits


def cred(role: str, ident: str = "") -> SecurityConfig:
    return SecurityConfig(credential=I.issue(SECRET, role, ident))


def _spawn(env_add: dict[str, str], *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(env_add)
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _value(i: int) -> bytes:
    return np.random.default_rng(1000 + i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def _idx(k: str) -> int:
    return int(k.split("-")[1])


def _until(what, timeout: float = 30.0, msg: str = ""):
    end = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < end, f"not in time: {msg}"
        time.sleep(0.05)


class Live:
    """The processes, the application's client, and a connection per identity."""

    def __init__(self, tmp) -> None:
        port, mport = free_ports(2)
        self.addr = f"127.0.0.1:{port}"
        self.path = tmp / "tier.seg"
        self.procs: list[subprocess.Popen] = []
        m = _spawn(
            {"KVMESH_TOKEN": SECRET},
            "master", "--listen", self.addr, "--dir", str(tmp / "m"),
            "--metrics-port", str(mport), "--ticker-s", "0.05", "--evict-ratio", "0.5",
            "--demote-timeout-s", "300", "--demote-batch-bytes", str(BATCH),
            "--demote-inflight-bytes", str(BATCH), "--promote-hits", str(HITS),
            "--node-ttl-s", "300", "--put-timeout-s", "300",
        )  # fmt: skip
        self.procs.append(m)
        _line(m, "READY")
        n = _spawn(
            {"KVMESH_CREDENTIAL": I.issue(SECRET, "node", NODE)},
            "node", "--master", self.addr, "--size", str(MEM), "--heartbeat-s", "0.05",
            "--disk", str(self.path), "--disk-size", str(DISK),
        )  # fmt: skip
        self.procs.append(n)
        _line(n, "READY node")
        self.node = n
        # the application: the client credential, for the master and its engine's peers
        self.engine = TransferEngine(config=EngineConfig(credential=I.issue(SECRET, "client")))
        self.c = StoreClient(
            self.addr, security=cred("client"), engine=self.engine, timeout=20, segment_size=0
        )
        # the attackers: the client credential, this node's own, another node's
        self.as_client = MasterClient([self.addr], cred("client"), timeout=10)
        self.as_node = MasterClient([self.addr], cred("node", NODE), node_id=NODE, timeout=10)
        self.as_other = MasterClient(
            [self.addr], cred("node", "node-e"), node_id="node-e", timeout=10
        )

    def close(self) -> None:
        for r in (self.as_client, self.as_node, self.as_other, self.c, self.engine):
            r.close()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(20)

    def status(self) -> dict:
        return self.c.status()

    def table(self, keys: list[str]) -> P.ReplicaTableResp:
        """The master's whole record of ``keys`` (copies, sizes, crcs), lease time aside."""
        host = self.c.engine.host_id
        t = self.as_client.call(lambda rid: P.GetReplicasReq(rid, keys, host, True))
        assert type(t) is P.ReplicaTableResp, t
        return msgspec.structs.replace(t, rid=0, lease_ms=0)

    def segment(self, medium: str) -> str:
        (name,) = [
            s["name"] for s in self.status()["segments"]
            if s["medium"] == medium and s["node_id"] == NODE and s["state"] == "mounted"
        ]  # fmt: skip
        return name

    def work(self) -> P.DemoteTasksResp:
        """The demotions and promotions in flight for the node (its heartbeat's answer)."""
        r = self.as_node.call(lambda rid: P.HeartbeatReq(rid, NODE, 256))
        assert type(r) is P.DemoteTasksResp and r.codes == [0], r
        return r

    def put(self, keys: list[str]) -> None:
        res = self.c.put(keys, [_value(_idx(k)) for k in keys])
        assert not any(isinstance(r, Exception) for r in res), res

    def settle(self) -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            mem = self.status()["media"]["memory"]
            if mem["used"] < 0.9 * mem["capacity"] and not self.work().tasks:
                return
            time.sleep(0.05)

    def copies(self, keys: list[str]) -> dict[str, list[bool]]:
        """Per key: for each listed copy, whether it is on disk."""
        out = {}
        for k, r in zip(keys, self.c.replicas(keys)):
            if not isinstance(r, Exception):
                out[k] = [all(s.segment.endswith(".disk") for s in d.slices) for d in r]
        return out


@pytest.fixture
def live(tmp_path):
    lv = Live(tmp_path)
    try:
        yield lv
    finally:
        lv.close()


def _demote_end(node_id, keys, versions, crcs):
    return lambda rid, s: P.DemoteEndReq(rid, s, node_id, keys, versions, crcs)


def _promote_end(node_id, tag, keys, versions, segments, offsets):
    return lambda rid, s: P.PromoteEndReq(rid, s, node_id, tag, keys, versions, segments, offsets)


def _send_and_drain(s: socket.socket, frame: bytes) -> None:
    """Send ``frame`` and read whatever comes back until the master closes the connection."""
    s.settimeout(10)
    try:
        s.sendall(frame)
        while s.recv(65536):
            pass
    except OSError:
        pass  # (reset: closed)


def _refused_params(r, why: str) -> None:
    assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, r
    assert why in r.message, r.message


def test_forged_tier_ends_are_refused_and_change_nothing(live: Live) -> None:
    lv = live
    keys = [f"obj-{i}" for i in range(40)]
    for lo in range(0, len(keys), 4):  # 2.5 x memory, paced: the oldest end up on disk only
        lv.put(keys[lo : lo + 4])
        lv.settle()
    copies = lv.copies(keys)
    assert set(copies) == set(keys), "an acknowledged put was lost"
    disk_only = [k for k in keys if copies[k] == [True]]
    assert len(disk_only) >= 4, copies
    # the rest removed: memory holds nothing, so no watermark eviction changes the table
    # while the forged ends are checked against it
    res = lv.c.remove([k for k in keys if k not in disk_only], force=True)
    assert not any(isinstance(r, Exception) for r in res), res
    keys = list(disk_only)
    _until(lambda: lv.status()["media"]["memory"]["used"] == 0, msg="memory freed")
    mem = lv.segment("memory")
    disk = lv.segment("disk")

    # -------- the node stops: the work the master starts now stays in flight
    lv.node.send_signal(signal.SIGSTOP)
    # a writer's reservation (the client's, in memory the leader settled), named below
    rsv = lv.as_client.mutate(
        lambda rid, s: P.PutCommitReq(rid, s, [], [], 0, 0, [], ReplicateConfig(), reserve=SIZE)
    )
    assert type(rsv) is P.PutCommitResp and rsv.tag and rsv.seg is not None, rsv
    prom = disk_only[:2]
    for _ in range(HITS):
        lv.c.replicas(prom)  # read hits: the leader starts their promotion
    got = _until(lambda: {p.key for p in lv.work().promote} >= set(prom) and lv.work(),
                 msg="promotions in flight")  # fmt: skip
    ptasks = {p.key: p for p in got.promote if p.key in prom}
    # puts until memory is over the demotion level and the leader starts a batch
    for i in range(40, 72, 2):
        lv.put([f"obj-{i}", f"obj-{i + 1}"])
        keys += [f"obj-{i}", f"obj-{i + 1}"]
        end = time.monotonic() + 1
        while not (got := lv.work()).tasks and time.monotonic() < end:
            time.sleep(0.05)
        if got.tasks:
            break
    assert got.tasks, f"no demotion started: {lv.status()['media']}"
    dtasks = {t.key: t for t in got.tasks}
    d0, dt = next(iter(dtasks.items()))
    p0, p1 = ptasks[prom[0]], ptasks[prom[1]]  # (disk-only objects: their versions, crcs)
    (pdst,) = p0.dst.slices
    # an object in memory only, no demotion started, whose version is known: put by hand
    # (PutStart / PutEnd; its bytes are not written, it is only named in ends)
    r = lv.as_client.mutate(
        lambda rid, s: P.PutStartReq(rid, s, ["fresh-0"], [SIZE], ReplicateConfig())
    )
    assert type(r) is P.PutStartResp and r.codes == [0], r
    fresh_v = r.versions[0]
    r = lv.as_client.mutate(lambda rid, s: P.PutEndReq(rid, s, ["fresh-0"], [fresh_v]))
    assert type(r) is P.CodesResp and r.codes == [0], r
    keys.append("fresh-0")
    before = lv.table(keys)

    def unchanged(what: str) -> None:
        assert lv.table(keys) == before, f"{what}: the master's table changed"

    # -------- (a) the client identity speaks as the node: refused whatever it names
    for make in (
        _demote_end(NODE, [d0], [dt.version], [12345]),
        _promote_end(NODE, p0.tag, [p0.key], [p0.version], [pdst.segment], [pdst.offset]),
    ):
        _refused_params(lv.as_client.mutate(make), "only storage node")
        unchanged("a client's end")
    # it cannot even claim the node role at the handshake
    rpc = MasterClient([lv.addr], cred("client"), node_id=NODE, timeout=3)
    with pytest.raises((AuthFailed, E.StoreError), match="cannot speak as node|Auth|auth"):
        rpc.call(lambda rid: P.StatusReq(rid))
    rpc.close()
    # another node names this node's id: refused at admission
    _refused_params(
        lv.as_other.mutate(_demote_end(NODE, [d0], [dt.version], [12345])), "only storage node"
    )
    unchanged("another node's end under this node's id")

    # -------- (b) node identities for work they were never given: per-key InvalidWrite
    bad = E.InvalidWrite.code
    nf = E.ObjectNotFound.code
    cases = [
        # another node ends this node's demotion (its disk copy is on this node's disk)
        (lv.as_other, _demote_end("node-e", [d0], [dt.version], [12345]), [bad]),
        # an unstarted demotion (memory only, none in flight), an absent key
        (lv.as_node, _demote_end(NODE, ["fresh-0"], [fresh_v], [12345]), [bad]),
        (lv.as_node, _demote_end(NODE, ["nothing-here"], [1], [12345]), [nf]),
        # a started demotion with the wrong version, or a crc that is no crc32c
        (lv.as_node, _demote_end(NODE, [d0], [dt.version + 1], [12345]), [bad]),
        (lv.as_node, _demote_end(NODE, [d0], [dt.version], [-1]), [bad]),
        (lv.as_node, _demote_end(NODE, [d0], [dt.version], [1 << 32]), [bad]),
        # an ended demotion again, with another crc (its bytes would then read as corrupt)
        (lv.as_node, _demote_end(NODE, [p1.key], [p1.version], [p1.crc ^ 1]), [bad]),
    ]
    # promotions: an unstarted tag, tag 0, a started one naming other fields
    v0 = p0.version
    for tag in (0, 1 << 40, p0.tag + 1):
        cases.append(
            (lv.as_node, _promote_end(NODE, tag, [p0.key], [v0], [mem], [pdst.offset]), [bad])
        )
    for k, v, seg, off in (
        (p0.key, v0 + 1, mem, pdst.offset),  # wrong version
        (p0.key, v0, mem, pdst.offset + 4096),  # wrong offsets
        (p0.key, v0, mem, pdst.offset + 1),
        (p0.key, v0, mem, pdst.offset - 4096),
        (p0.key, v0, mem, 1 << 40),
        (p0.key, v0, disk, pdst.offset),  # its disk segment as the memory copy
        (p0.key, v0, "no-such-segment", pdst.offset),
        (p1.key, p1.version, mem, pdst.offset),  # another object into its reservation
    ):
        cases.append((lv.as_node, _promote_end(NODE, p0.tag, [k], [v], [seg], [off]), [bad]))
    # another node ends this node's promotion, exactly as started
    cases.append(
        (lv.as_other, _promote_end("node-e", p0.tag, [p0.key], [v0], [mem], [pdst.offset]), [bad])
    )
    # a writer's reservation (the client's) named as a promotion: a disk-only object's memory
    # copy would be memory the writer is filling
    wsid, woff, _ = rsv.added
    forged = _promote_end(NODE, rsv.tag, [p1.key], [p1.version], [rsv.seg[0]], [woff])
    cases.append((lv.as_node, forged, [bad]))
    for who, make, codes in cases:
        r = who.mutate(make)
        assert type(r) is P.CodesResp and r.codes == codes, (make(0, P.Session(0, 0)), r)
        unchanged(repr(make(0, P.Session(0, 0))))

    # demotions reported failed (DemoteEndReq.failed) by another node, or at another
    # version: not revoked (still handed to the node), nothing counted
    for who, nid, v in ((lv.as_other, "node-e", dt.version), (lv.as_node, NODE, dt.version + 1)):
        r = who.mutate(
            lambda rid, s, n=nid, v=v: P.DemoteEndReq(rid, s, n, [], [], [], 0, [d0], [v])
        )
        assert type(r) is P.CodesResp and r.codes == [], r
        assert d0 in {t.key for t in lv.work().tasks}, "another's failure report revoked it"
        assert lv.status()["requests"].get("demote_failed", 0) == 0
        unchanged("a forged failure report")

    # malformed batches: refused whole with the reason
    for make, why in (
        (_demote_end(NODE, [d0], [dt.version], []), "1 keys with 1 versions and 0 crcs"),
        (_demote_end(NODE, [d0], [], [1]), "1 keys with 0 versions and 1 crcs"),
        (_demote_end(NODE, [d0, d0], [dt.version], [1, 1]), "versions"),
        (
            lambda rid, s: P.DemoteEndReq(rid, s, NODE, [], [], [], 0, [d0], []),
            "1 failed demotions with 0 versions",
        ),
        (
            lambda rid, s: P.DemoteEndReq(rid, s, NODE, [], [], [], 0, ["k"] * 8193, [1] * 8193),
            "limit",
        ),
        (_promote_end(NODE, p0.tag, [p0.key], [v0], [], [pdst.offset]), "unequal"),
        (_promote_end(NODE, p0.tag, [p0.key], [v0], [mem], []), "unequal"),
        (_demote_end(NODE, [f"k{i}" for i in range(8193)], [1] * 8193, [1] * 8193), "limit"),
        (
            _promote_end(
                NODE, p0.tag, [f"k{i}" for i in range(8193)], [1] * 8193, [mem] * 8193, [0] * 8193
            ),
            "limit",
        ),  # fmt: skip
    ):
        _refused_params(lv.as_node.mutate(make), why)
        unchanged(f"malformed ({why})")

    # -------- no credential: refused at the handshake, before a request is decoded
    n_end = lv.status()["requests"].get("DemoteEndReq", 0)
    host, port = lv.addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    frame = framing.encode_frame(P.encode(P.DemoteEndReq(1, P.Session(1, 1), NODE, [d0],
                                                         [dt.version], [1])))  # fmt: skip
    try:
        _send_and_drain(s, frame)
    finally:
        s.close()
    # a node credential of another secret: refused; the end sent anyway is never read
    forged = SecurityConfig(credential=I.issue("another-secret", "node", NODE))
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        with pytest.raises(AuthFailed):
            client_handshake(s, forged, P.SERVICE, NODE, 5.0, role="node")
        _send_and_drain(s, frame)
    finally:
        s.close()
    assert lv.status()["requests"].get("DemoteEndReq", 0) == n_end
    unchanged("unauthenticated ends")
    # meanwhile the application is served: its objects in memory read byte-exact
    fresh = [k for k in keys if k.startswith("obj-") and _idx(k) >= 40]
    assert lv.c.get(fresh) == [_value(_idx(k)) for k in fresh]

    # -------- the master goes on serving: the node runs again and ends its real work
    lv.node.send_signal(signal.SIGCONT)
    _until(lambda: not lv.work().tasks, msg="the real demotions ended")
    _until(lambda: all(False in cs for cs in [lv.copies(prom)[k] for k in prom]),
           msg="the real promotions ended")  # fmt: skip
    lv.as_client.mutate(
        lambda rid, s: P.PutCommitReq(rid, s, [], [], rsv.tag, wsid, [], ReplicateConfig(),
                                      release=True)
    )  # fmt: skip
    keys.remove("fresh-0")  # (its bytes were never written)
    got = lv.c.get(keys)
    wrong = [k for k, g in zip(keys, got) if g != _value(_idx(k))]
    assert wrong == [], wrong
    # replays of the real ends, with other fields: refused, nothing changes (the node
    # stopped again: no end of the work the reads here start changes the table meanwhile)
    _until(lambda: not lv.work().tasks, msg="the real demotions ended")
    lv.node.send_signal(signal.SIGSTOP)
    after = lv.table(keys)
    crc_of = dict(zip(keys, after.crcs))
    assert crc_of[d0] >= 0, "the real demotion did not end"
    for make, codes in (
        (_demote_end(NODE, [d0], [dt.version], [crc_of[d0] ^ 1]), [bad]),
        (_demote_end(NODE, [d0], [dt.version + 1], [crc_of[d0]]), [bad]),
        (_promote_end(NODE, p0.tag, [p0.key], [v0], [mem], [pdst.offset]), [bad]),
    ):
        r = lv.as_node.mutate(make)
        assert type(r) is P.CodesResp and r.codes == codes, r
        assert lv.table(keys) == after
    # the same end again (a retry whose reply was lost) is answered done and changes nothing
    r = lv.as_node.mutate(_demote_end(NODE, [d0], [dt.version], [crc_of[d0]]))
    assert type(r) is P.CodesResp and r.codes == [0], r
    assert lv.table(keys) == after
    lv.node.send_signal(signal.SIGCONT)
    got = lv.c.get(keys)
    assert [k for k, g in zip(keys, got) if g != _value(_idx(k))] == []
    # and a new put: once the leases of these reads end, memory copies on disk make room
    _until(lambda: not isinstance(lv.c.put(["obj-99"], [_value(99)])[0], Exception),
           msg="a put after the attacks")  # fmt: skip
    assert lv.c.get(["obj-99"]) == [_value(99)]
