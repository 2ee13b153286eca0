"""Adversarial tests against a LIVE store master process (regressions of defects found by
attacking it): requests that must be refused without side effects, replies that must stay
bounded whatever a peer asks for, and storage-node identities a peer cannot take over.
Each test measures the master process (RSS, threads, fds) where the defect was a resource
one, and checks afterwards that a legitimate client still gets byte-exact data."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvmesh.net import framing
from kvmesh.net.handshake import client_handshake
from kvmesh.net.limits import Deadline
from kvmesh.net.security import SecurityConfig
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import ReplicateConfig

from .e2e_util import TOKEN


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-attack")
    cl = StoreCluster(
        str(d),
        1,
        token=TOKEN,
        durability="memory",
        extra_args=[
            "--lease-ttl-s",
            "1",
            "--request-timeout-s",
            "4",
            "--max-sessions",
            "2048",
            "--max-session-result-bytes",
            str(1 << 20),
        ],
    )
    cl.start_all()
    client = StoreClient(cl.address, token=TOKEN, timeout=10, segment_size=8 << 20)
    try:
        yield cl, client
    finally:
        client.close()
        cl.close()


def _proc(cl: StoreCluster) -> dict[str, int]:
    """RSS (KiB), peak RSS (KiB), threads and open fds of the master process."""
    pid = cl.procs[1].pid
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def _held_from(cl: StoreCluster, ports: set[int]) -> int:
    """How many sockets the master process holds whose remote port is in ``ports``."""
    pid = cl.procs[1].pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            rem_port = int(cols[2].rsplit(":", 1)[1], 16)
            if int(cols[9]) in inodes and rem_port in ports:
                held += 1
    return held


class Peer:
    """An authenticated raw connection speaking the store protocol (a hostile client).
    ``role="replica"``: an operator's connection (the secret), which may mount for any node
    id -- what the tests of lying storage nodes need."""

    def __init__(self, cl: StoreCluster, name: str = "attacker", role: str = "client") -> None:
        host, port = cl.addrs[1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        sec = SecurityConfig(token=TOKEN)
        client_handshake(self.sock, sec, P.SERVICE, name, 5.0, role=role)
        self.seq = 0
        self.cid = self.call(P.RegisterReq(1)).client_id

    def call(self, req, timeout: float = 30.0, max_reply: int = 1 << 30):
        self.sock.sendall(framing.encode_frame(P.encode(req)))
        return P.decode_response(framing.read_frame(self.sock, max_reply, Deadline(timeout)))

    def session(self) -> P.Session:
        self.seq += 1
        return P.Session(self.cid, self.seq, self.seq)

    def close(self) -> None:
        self.sock.close()


def _byte_exact(client: StoreClient, values: dict[str, bytes]) -> None:
    res = client.get(list(values))
    assert list(res) == list(values.values())


def test_a_put_that_can_never_fit_does_not_evict_the_pool(master):
    """A put asking for more than the whole pool (or an invalid copy count) used to make
    the leader evict every unleased object before apply refused it with NoSpace or
    InvalidParams: one request wiped the cache."""
    cl, client = master
    values = {f"fit-{i}": bytes([i]) * 65536 for i in range(20)}
    assert client.put(list(values), list(values.values())).codes == [0] * 20
    time.sleep(1.2)  # past the read leases of the put's own reads (lease TTL 1 s)
    p = Peer(cl)
    try:
        for sizes, cfg in [
            ([1 << 40], ReplicateConfig()),  # 1 TiB into an 8 MiB pool
            ([1 << 20] * 8, ReplicateConfig(replica_num=1000)),  # invalid copy count
            ([4 << 20, 4 << 20], ReplicateConfig(replica_num=2)),  # 2 copies, 1 node
        ]:
            keys = [f"never-{cfg.replica_num}-{i}" for i in range(len(sizes))]
            r = p.call(P.PutStartReq(7, p.session(), keys, sizes, cfg))
            if type(r) is P.PutStartResp:
                assert all(c != 0 for c in r.codes), r
            else:
                assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, r
            assert all(client.exists(list(values))), f"{sizes} x{cfg.replica_num} evicted objects"
    finally:
        p.close()
    _byte_exact(client, values)
    client.remove(list(values))


def _mount_fake(p: Peer, name: str, size: int = 1 << 40) -> None:
    """A 'storage node' that lies: a huge segment at an endpoint where nothing listens."""
    r = p.call(P.MountReq(2, p.session(), f"{name}-node", name, "127.0.0.1:1", "nohost", size))
    assert type(r) is P.CodesResp and r.codes == [0], r


def _unmount_fake(p: Peer, name: str) -> None:
    r = p.call(P.UnmountReq(3, p.session(), f"{name}-node", name, 0.0))
    assert type(r) is P.CodesResp and r.codes == [0], r


def test_get_replicas_reply_is_bounded_whatever_the_request_names(master):
    """One ~20 KB GetReplicas naming a 16 GiB object (1024 slices) 2048 times used to make
    a ~94 MB reply (and ~0.4 GB of master RSS, the event loop blocked for seconds; with a
    1 TiB object the master runs out of memory). Now a reply carries at most
    ``max_reply_bytes`` of descriptors; later keys answer InvalidParams."""
    cl, client = master
    p = Peer(cl, role="replica")
    try:
        _mount_fake(p, "liar")
        # The lying node's segment takes puts; their writes fail, nothing is published.
        res = client.put(
            ["lied-to"], [b"z" * 4096], config=ReplicateConfig(preferred_segment="liar")
        )
        assert res.codes[0] != 0
        assert client.exists("lied-to") is False
        cfg = ReplicateConfig(preferred_segment="liar")
        r = p.call(P.PutStartReq(4, p.session(), ["big"], [16 << 30], cfg))
        assert r.codes == [0] and len(r.replicas[0][0].slices) == 1024
        assert p.call(P.PutEndReq(5, p.session(), ["big"], r.versions)).codes == [0]
        before = _proc(cl)
        t0 = time.monotonic()
        req = P.GetReplicasReq(6, ["big"] * 2048)
        p.sock.sendall(framing.encode_frame(P.encode(req)))
        body = framing.read_frame(p.sock, 1 << 30, Deadline(60))
        took = time.monotonic() - t0
        resp = P.decode_response(body)
        after = _proc(cl)
        grew = (after["VmHWM"] - before["VmHWM"]) // 1024
        assert len(body) <= 9 << 20, f"reply of {len(body)} bytes, peak RSS +{grew} MiB"
        assert grew < 150, f"master peak RSS grew by {grew} MiB ({before} -> {after}, {took:.2f}s)"
        assert type(resp) is P.ReplicasResp
        assert resp.codes[0] == 0 and len(resp.replicas[0][0].slices) == 1024
        assert set(resp.codes[1:]) <= {0, E.InvalidParams.code}
        assert E.InvalidParams.code in resp.codes
        _unmount_fake(p, "liar")
    finally:
        p.close()
    values = {"after-amp": b"ok" * 1000}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


def test_a_client_that_never_reads_its_replies_cannot_grow_the_master(master):
    """Pipelining GetReplicas requests whose (bounded, ~8 MiB) replies are never read used
    to grow the master by ~200 MB a second per connection (every handler wrote its reply
    before checking the buffer): two such connections took it past 2 GB in 10 s. Now one
    connection has one large reply in the making at a time, writes wait for the peer to
    read, and a peer that reads nothing for ``request_timeout_s`` is disconnected."""
    cl, client = master
    p = Peer(cl, role="replica")
    hogs: list[socket.socket] = []
    try:
        _mount_fake(p, "liar2")
        cfg = ReplicateConfig(preferred_segment="liar2")
        r = p.call(P.PutStartReq(4, p.session(), ["big2"], [16 << 30], cfg))
        assert p.call(P.PutEndReq(5, p.session(), ["big2"], r.versions)).codes == [0]
        before = _proc(cl)
        req = framing.encode_frame(P.encode(P.GetReplicasReq(6, ["big2"] * 2048)))
        for i in range(2):
            h = Peer(cl, f"hog{i}").sock
            h.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            h.settimeout(0.2)
            hogs.append(h)
            sent = 0
            with __import__("contextlib").suppress(TimeoutError, OSError):
                for _ in range(100):  # ~2 MB of requests, ~800 MB of replies
                    h.sendall(req)
                    sent += 1
        peak = before
        for _ in range(6):
            time.sleep(0.5)
            peak = _proc(cl)
        grew = (peak["VmRSS"] - before["VmRSS"]) // 1024
        assert grew < 150, f"master RSS grew by {grew} MiB ({before} -> {peak})"
        assert peak["Threads"] <= before["Threads"] + 2
        _unmount_fake(p, "liar2")
    finally:
        for h in hogs:
            h.close()
        p.close()
    values = {"after-hog": b"hog" * 1000}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


def test_a_peer_cannot_act_for_another_storage_node(master):
    """Node ids and segment names are public (every replica descriptor carries them). Any
    authenticated peer used to be able to unmount another node's segment (dropping every
    object in it), heartbeat for a dead node (keeping its copies advertised) or mount
    segments under another node's id. Now a node id belongs to the peer that mounted it on
    the current leader, like a client session."""
    cl, client = master
    values = {f"victim-{i}": bytes([i + 1]) * 4096 for i in range(8)}
    assert client.put(list(values), list(values.values())).codes == [0] * 8
    p = Peer(cl)
    try:
        desc = p.call(P.GetReplicasReq(1, ["victim-0"])).replicas[0][0].slices[0]
        node, seg = desc.node_id, desc.segment
        for req in [
            P.UnmountReq(2, p.session(), node, seg, 0.0),
            P.MountReq(3, p.session(), node, "squat", "127.0.0.1:1", "h", 1 << 20),
            P.HeartbeatReq(4, node),
        ]:
            r = p.call(req)
            assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, (req, r)
        # A segment name that is taken stays taken (no overlap), for anyone.
        other = Peer(cl, "other-node", role="node")
        r = other.call(
            P.MountReq(5, other.session(), "other-node", seg, "127.0.0.1:1", "h", 1 << 20)
        )
        other.close()
        assert type(r) is P.CodesResp and r.codes == [E.SegmentExists.code], r
    finally:
        p.close()
    assert [s["name"] for s in client.rpc.status(cl.addrs[1])["segments"]] == [seg]
    _byte_exact(client, values)
    client.remove(list(values))


def test_silent_unauthenticated_connections_cannot_lock_clients_out(master):
    """``max_unauthenticated`` (64) silent connections used to make every new connection be
    refused until the handshake deadline dropped them -- and an attacker without the token
    simply opens them again: a new client got StoreUnavailable. Now a new connection takes
    the place of the oldest unauthenticated one."""
    cl, client = master
    host, port = cl.addrs[1].rsplit(":", 1)
    before = _proc(cl)
    t_open = time.monotonic()
    silent = [socket.create_connection((host, int(port))) for _ in range(64 + 16)]
    try:
        t0 = time.monotonic()
        fresh = StoreClient(cl.address, token=TOKEN, timeout=3)
        try:
            assert fresh.exists("nothing-here") is False
        finally:
            fresh.close()
        assert time.monotonic() - t0 < 3
        # Count exactly what the property is about -- the master's sockets whose peer is one
        # of ours -- not the process's fd total, which also moves with log segments, replica
        # links and the fixture client's reconnects when the machine is busy.
        ours = {s.getsockname()[1] for s in silent}
        # An evicted connection is closed on the server loop's next pass, so one newcomer may
        # briefly sit beside the 64 it displaces; a server that never closes holds all 80
        # until its 5 s handshake deadline, so the wait ends a second before that.
        deadline = t_open + 4
        while (held := _held_from(cl, ours)) > 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held <= 64, (held, before, _proc(cl))
    finally:
        for s in silent:
            s.close()
    values = {"after-loris": b"l" * 3000}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


def test_a_batch_larger_than_one_log_entry_is_split_or_refused_at_once(master):
    """The replicated log takes entries of at most 1 MiB; a valid batch of 4096 keys of
    ~300 bytes (keys may have 1024) is larger. Its ProposalTooLarge was answered as a
    retryable error: the client retried the same doomed proposal for its whole timeout
    and raised StoreUnavailable ("outcome unknown"). Now the client splits batches by
    key bytes, and the master answers an oversized request InvalidParams, not retryable."""
    cl, client = master
    keys = [f"{j:05d}" + "k" * 300 for j in range(4096)]
    t0 = time.monotonic()
    res = client.put(keys, [k[:5].encode() for k in keys])
    assert res.codes == [0] * len(keys)
    assert time.monotonic() - t0 < 8
    sample = keys[::512]
    assert list(client.get(sample)) == [k[:5].encode() for k in sample]
    assert client.remove(keys, force=True).codes == [0] * len(keys)
    p = Peer(cl)
    try:
        big = [f"{j:04d}" + "q" * 1000 for j in range(2000)]  # 2 MB of keys in one request
        t0 = time.monotonic()
        r = p.call(P.PutEndReq(9, p.session(), big, [1] * len(big)))
        assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code and not r.retry, r
        assert time.monotonic() - t0 < 3
    finally:
        p.close()


def test_segment_count_is_capped(master):
    """Mount takes any name and size and the master never touches the memory, so one peer
    could mount segments without end; placement scans them on every put (3000 fake
    segments made a 256-key put 20x slower, and the table only grew). Now the master
    holds at most ``max_segments`` (default 1024) and refuses more."""
    cl, client = master
    p = Peer(cl, role="replica")
    names = []
    try:
        refused = None
        seq0 = p.seq
        for b in range(0, 1100, 64):  # pipelined, 64 at a time
            batch = list(range(b, min(1100, b + 64)))
            for i in batch:
                p.seq += 1
                s = P.Session(p.cid, p.seq, seq0 + 1)
                req = P.MountReq(i, s, f"cap-{i}", f"cap-{i}", "127.0.0.1:1", "h", 1 << 20)
                p.sock.sendall(framing.encode_frame(P.encode(req)))
            for _ in batch:
                r = P.decode_response(framing.read_frame(p.sock, 1 << 20, Deadline(30)))
                if type(r) is P.CodesResp and r.codes == [0]:
                    names.append(f"cap-{r.rid}")
                elif refused is None:
                    refused = r
        assert len(names) == 1023, f"{len(names)} segments mounted"  # + the client's own
        code = refused.code if type(refused) is P.ErrorResp else refused.codes[0]
        assert code == E.NoSpace.code, refused
    finally:
        for n in names:
            p.call(P.UnmountReq(1, p.session(), n, n, 0.0))
        p.close()
    values = {"after-cap": b"c" * 5000}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


def test_a_peer_cannot_finish_or_revoke_another_writers_put(master):
    """A put's version is its log index, so it is easy to guess (the status reply shows the
    log's commit index, and one PutEnd may name the key with many versions). Another peer
    used to be able to PutEnd a writer's half-written put -- readers then got bytes that
    were never written -- or PutRevoke it. Now the leader answers InvalidWrite to a
    PutEnd/PutRevoke from any session but the one that started the put."""
    cl, client = master
    writer, attacker = Peer(cl, "writer"), Peer(cl, "attacker")
    try:
        r = writer.call(P.PutStartReq(1, writer.session(), ["half"], [4096], ReplicateConfig()))
        assert r.codes == [0]
        v = r.versions[0]
        guesses = list(range(max(1, v - 20), v + 20))
        for Req in (P.PutEndReq, P.PutRevokeReq):
            a = attacker.call(Req(2, attacker.session(), ["half"] * len(guesses), guesses))
            assert type(a) is P.CodesResp and 0 not in a.codes, (Req.__name__, a)
        assert client.exists("half") is False
        assert writer.call(P.PutRevokeReq(3, writer.session(), ["half"], [v])).codes == [0]
    finally:
        writer.close()
        attacker.close()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_frame_that_stalls_midway_is_dropped_at_the_request_deadline(master):
    """After the handshake, a peer that sends most of an 8 MiB frame and stops used to
    hold the connection and the buffered bytes until the idle timeout (600 s): 30 such
    connections held +250 MB of master RSS for ten minutes. Now a frame that has begun
    must end within ``request_timeout_s`` (4 s here)."""
    cl, client = master
    before = _proc(cl)
    stalled = []
    try:
        for i in range(6):
            s = Peer(cl, f"staller{i}").sock
            s.sendall(framing.HEADER.pack((8 << 20) - 100) + b"\0" * (4 << 20))
            stalled.append(s)
        t0 = time.monotonic()
        assert all(_closed_within(s, 8 - (time.monotonic() - t0)) for s in stalled)
        assert time.monotonic() - t0 < 8
        time.sleep(0.3)
        assert _proc(cl)["fds"] <= before["fds"] + 1
    finally:
        for s in stalled:
            s.close()
    values = {"after-stall": b"s" * 777}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


def test_session_registrations_are_bounded(master):
    """RegisterReq used to be unmetered: every call created a replicated session kept for
    the session TTL (1 h); 50,000 in 4 s added 41 MB. Live sessions are now capped
    (``--max-sessions``, 2,048 here) and a registration beyond it ends the least recently
    used session, deterministically inside the log's apply."""
    cl, client = master
    victim = Peer(cl, "idle-victim")  # registered first, then idle: the LRU session
    p = Peer(cl)
    try:
        for b in range(0, 6_000, 64):
            for i in range(64):
                p.sock.sendall(framing.encode_frame(P.encode(P.RegisterReq(b + i))))
            for _ in range(64):
                r = P.decode_response(framing.read_frame(p.sock, 1 << 20, Deadline(30)))
                assert type(r) is P.RegisterResp
        sessions = client.rpc.status(cl.addrs[1])["sessions"]
        assert 2000 <= sessions <= 2048, f"{sessions} live sessions"
        # The idle victim's session was ended (not applied, told so); the attacker's own
        # most recent sessions are live.
        r = victim.call(P.RemoveReq(1, victim.session(), ["nothing"]))
        assert type(r) is P.ErrorResp and r.message.startswith("session:"), r
    finally:
        victim.close()
        p.close()
    # A legitimate client whose session was ended too opens a new one and goes on.
    values = {"after-register-flood": b"r" * 4321}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


def test_unacknowledged_results_are_bounded_in_bytes(master):
    """A peer that never advances ``ack`` used to make every replica cache up to 4,096 of
    its results whatever their size (300 puts of 4,000 keys: +240 MB). Cached results are
    now bounded per session (``--max-session-result-bytes``, 1 MiB here); a retry of a
    request whose result was evicted is refused, never applied twice."""
    cl, client = master
    p = Peer(cl, "never-acks")
    keys = [f"noack-{i:05d}" for i in range(2000)]
    try:
        first = None
        # 60 rounds: 2,000 placements take about 26 kB as a cached (compact) result, so the
        # 1 MiB bound is passed well before the end
        for seq in range(1, 61):
            sess = P.Session(p.cid, 2 * seq - 1, 0)
            r = p.call(P.PutStartReq(1, sess, keys, [64] * len(keys), ReplicateConfig()))
            assert type(r) is P.PutStartResp and set(r.codes) == {0}, r
            first = first or (sess, r.versions[0])
            rv = p.call(P.PutRevokeReq(2, P.Session(p.cid, 2 * seq, 0), keys, r.versions))
            assert set(rv.codes) == {0}
        cached = client.rpc.status(cl.addrs[1])["session_result_bytes"]
        assert cached <= (1 << 20) + (64 << 10), f"{cached} bytes of results cached"
        # Retrying the first PutStart: its result was evicted; it must not allocate again.
        sess, _ = first
        r = p.call(P.PutStartReq(1, sess, keys, [64] * len(keys), ReplicateConfig()))
        assert type(r) is P.ErrorResp and "result_evicted" in r.message, r
        assert client.exists(keys[0]) is False
    finally:
        p.close()
    values = {"after-noack": b"n" * 999}
    client.put(list(values), list(values.values()))
    _byte_exact(client, values)


@pytest.mark.parametrize(
    ("reason", "sends"), [("unknown_session", 2), ("stale_seq", 2), ("result_evicted", 1)]
)
def test_client_never_resends_a_request_whose_result_was_evicted(monkeypatch, reason, sends):
    """After ``session: ... result_evicted`` the request may have been applied once: the
    client must surface the error, not open a new session and send it again (it still does
    so after its session was forgotten, as before)."""
    from kvmesh.store.rpc import MasterClient

    mc = MasterClient(["127.0.0.1:1"], SecurityConfig(token=TOKEN))
    mc._client_id = 7
    sent = []

    def call(build, timeout=None):
        req = build(1)
        sent.append(req)
        if type(req) is P.RegisterReq:
            return P.RegisterResp(1, 8)
        msg = f"session: client {req.session.client_id} seq {req.session.seq}: {reason}"
        # the master's codes (server.py): a forgotten session has its own; an evicted result
        # (maybe applied once) is StoreUnavailable
        code = E.StoreUnavailable.code if reason == "result_evicted" else E.SessionExpired.code
        return P.ErrorResp(1, code, msg)

    monkeypatch.setattr(mc, "call", call)
    resp = mc.mutate(lambda rid, s: P.RemoveReq(rid, s, ["k"]))
    assert type(resp) is P.ErrorResp and reason in resp.message
    assert sum(type(r) is P.RemoveReq for r in sent) == sends
