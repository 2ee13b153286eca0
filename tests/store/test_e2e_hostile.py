"""Hostile input against a live master process: garbage, huge length prefixes, slow and
half-open connections, junk after authentication, oversized batches, connection floods.
After every attack the master still serves a real client."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvmesh.net import framing
from kvmesh.net.errors import AuthFailed
from kvmesh.net.handshake import client_handshake
from kvmesh.net.limits import Deadline
from kvmesh.net.security import SecurityConfig
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import ReplicateConfig
from kvmesh.transfer import TransferEngine

from .e2e_util import TOKEN

HANDSHAKE_S = 1.0
MAX_UNAUTH = 8


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-hostile")
    cl = StoreCluster(
        str(d),
        1,
        token=TOKEN,
        durability="memory",
        extra_args=[
            "--handshake-timeout-s",
            str(HANDSHAKE_S),
            "--idle-timeout-s",
            "3",
            "--max-unauthenticated",
            str(MAX_UNAUTH),
        ],
    )
    cl.start_all()
    client = StoreClient(cl.address, token=TOKEN, timeout=10, segment_size=8 << 20)
    try:
        yield cl, client
    finally:
        client.close()
        cl.close()


def _addr(cl: StoreCluster) -> tuple[str, int]:
    host, port = cl.addrs[1].rsplit(":", 1)
    return host, int(port)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closes the connection within ``seconds`` (reading whatever it sends)."""
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


def _still_serves(cl, client: StoreClient, tag: str) -> None:
    assert cl.alive(1)
    client.put(f"alive-{tag}", tag.encode())
    assert client.get(f"alive-{tag}") == tag.encode()


def _authed(cl) -> socket.socket:
    s = socket.create_connection(_addr(cl), timeout=5)
    client_handshake(s, SecurityConfig(token=TOKEN), P.SERVICE, "attacker", 5.0)
    return s


def test_garbage_before_auth(master):
    cl, client = master
    s = socket.create_connection(_addr(cl))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
    assert _closed_within(s, 5)
    s.close()
    _still_serves(cl, client, "garbage")


def test_huge_length_prefix_before_auth(master):
    cl, client = master
    s = socket.create_connection(_addr(cl))
    s.sendall(struct.pack("<I", 0xFFFFFFF0) + b"\0" * 64)
    assert _closed_within(s, 5)
    s.close()
    _still_serves(cl, client, "hugepre")


def test_slow_connection_is_dropped_at_the_handshake_deadline(master):
    cl, client = master
    s = socket.create_connection(_addr(cl))
    t0 = time.monotonic()
    assert _closed_within(s, HANDSHAKE_S + 5)
    assert time.monotonic() - t0 < HANDSHAKE_S + 4
    s.close()
    _still_serves(cl, client, "slow")


def test_wrong_mac_is_refused(master):
    cl, client = master
    s = socket.create_connection(_addr(cl), timeout=5)
    with pytest.raises(AuthFailed):
        client_handshake(s, SecurityConfig(token="guess"), P.SERVICE, "attacker", 5.0)
    assert _closed_within(s, 5)
    s.close()
    _still_serves(cl, client, "mac")


def _answer(s: socket.socket) -> object:
    return P.decode_response(framing.read_frame(s, 1 << 20, Deadline(5)))


def test_undecodable_requests_get_an_error_reply(master):
    """A frame the master cannot decode (not msgpack, an unknown tag, a field of the wrong
    type) is answered InvalidParams, not retryable, under its rid when the head is readable
    (0 when not), and the connection keeps serving: a dropped connection would read to a
    client as an outage, and it would retry the request until its deadline."""
    cl, client = master
    s = _authed(cl)
    try:
        s.sendall(framing.encode_frame(b"\xc1\xc1 not msgpack"))
        r = _answer(s)
        assert type(r) is P.ErrorResp and r.rid == 0 and r.code == E.InvalidParams.code
        assert not r.retry
        ok = P.encode(P.ExistsReq(9, ["k"]))
        forged = [
            (11, P.encode(["put_start", 11, [1, 1, 0], ["k"], [64], "not a config"])),
            (12, P.encode(["put_start", 12, [1, 1, 0], ["k"], [64], {"strategy": "bogus"}])),
            (13, P.encode(["put_start", 13, [1, 1, 0], ["k"], [64], {"preferred_segment": 5}])),
            (14, P.encode(["no_such_request", 14])),
            (15, P.encode(["get_replicas", 15, "not a list"])),
        ]
        for rid, body in forged:
            s.sendall(framing.encode_frame(body))
            r = _answer(s)
            assert type(r) is P.ErrorResp and r.rid == rid, r
            assert r.code == E.InvalidParams.code and not r.retry
            assert "undecodable" in r.message
        s.sendall(framing.encode_frame(ok))  # the same connection still serves
        r = _answer(s)
        assert type(r) is P.CodesResp and r.rid == 9 and r.codes == [0]
    finally:
        s.close()
    _still_serves(cl, client, "undecodable")


def test_junk_after_auth(master):
    cl, client = master
    s = _authed(cl)
    s.sendall(struct.pack("<I", 0x7FFFFFFF) + b"x" * 1000)  # far above the frame cap
    assert _closed_within(s, 5)
    s.close()
    s = _authed(cl)  # a truncated frame, then silence: the idle deadline closes it
    s.sendall(struct.pack("<I", 100) + b"x" * 10)
    assert _closed_within(s, 8)
    s.close()
    _still_serves(cl, client, "junk")


def test_silent_authenticated_connection_ends_at_the_idle_deadline(master):
    """The read loop's one timer per connection (``net.framing.ReadTimer``): a connection
    that authenticates and then says nothing is closed at ``--idle-timeout-s`` (3 s here),
    not earlier, while requests spaced closer than that keep another one open."""
    cl, client = master
    s = _authed(cl)
    busy = _authed(cl)
    t0 = time.monotonic()
    for rid in range(1, 5):  # one request every 0.9 s: over 3 s in all, never 3 s idle
        busy.sendall(framing.encode_frame(P.encode(P.ExistsReq(rid, ["k"]))))
        resp = P.decode_response(framing.read_frame(busy, 1 << 20, Deadline(5)))
        assert resp.rid == rid
        time.sleep(0.9)
        if rid == 2:  # 1.8 s in: the silent one is still open (no EOF, nothing to read)
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
            s.setblocking(True)
    assert time.monotonic() - t0 > 3.0
    assert _closed_within(s, 5)
    assert 2.5 < time.monotonic() - t0 < 7.0
    busy.sendall(framing.encode_frame(P.encode(P.ExistsReq(9, ["k"]))))
    assert P.decode_response(framing.read_frame(busy, 1 << 20, Deadline(5))).rid == 9
    s.close()
    busy.close()
    _still_serves(cl, client, "idle")


def test_forged_and_oversized_requests_get_errors_not_crashes(master):
    cl, client = master
    s = _authed(cl)
    # A mutation under a session nobody registered: refused, nothing applied.
    forged = P.PutStartReq(7, P.Session(999_999, 1, 0), ["forged"], [100], client.config)
    s.sendall(framing.encode_frame(P.encode(forged)))
    r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(5.0)))
    assert type(r) is P.ErrorResp and r.rid == 7
    # Too many keys in one batch.
    big = P.ExistsReq(8, ["k"] * 100_000)
    s.sendall(framing.encode_frame(P.encode(big)))
    r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(5.0)))
    assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code
    # The same by parts: 1,000 keys x 100 suffixes is past the limit, refused before any name
    # is built; names too long only once joined, NUL in a suffix, no suffix at all.
    for rid, req, err in (
        (20, P.ExistsPartsReq(20, "p", ["k"] * 1000, ["s"] * 100), E.InvalidParams),
        (21, P.ExistsPartsReq(21, "p" * 600, ["k"], ["s" * 600]), E.InvalidKey),
        (22, P.ExistsPartsReq(22, "p", ["k"], ["\0"]), E.InvalidKey),
        (23, P.ExistsPartsReq(23, "p", ["k"], []), E.InvalidKey),
        (24, P.ExistsPartsReq(24, "p", ["k"] * 1000, ["s"] * 100, True), E.InvalidParams),
        (25, P.ExistsPartsReq(25, "p", ["k"], ["\0"], True), E.InvalidKey),
    ):
        s.sendall(framing.encode_frame(P.encode(req)))
        r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(5.0)))
        assert type(r) is P.ErrorResp and r.rid == rid and r.code == err.code, (rid, r)
    # Mismatched list lengths, negative sizes, invalid keys.
    for rid, req in enumerate(
        [
            P.PutStartReq(9, P.Session(1, 1, 0), ["a", "b"], [1], client.config),
            P.GetReplicasReq(10, ["", "\udc80"]),
        ],
        start=9,
    ):
        try:
            s.sendall(framing.encode_frame(P.encode(req)))
        except UnicodeEncodeError:
            continue  # the encoder itself refuses lone surrogates
        r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(5.0)))
        assert r.rid == rid
        assert type(r) is P.ErrorResp or any(c != 0 for c in getattr(r, "codes", [1]))
    s.close()
    assert client.exists("forged") is False
    _still_serves(cl, client, "forged")


def test_connection_flood(master):
    cl, client = master
    socks = []
    try:
        for _ in range(MAX_UNAUTH * 4):
            socks.append(socket.create_connection(_addr(cl)))
        closed = sum(1 for s in socks[MAX_UNAUTH + 2 :] if _closed_within(s, 0.5))
        assert closed > 0  # past the unauthenticated cap, connections are dropped at once
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    _still_serves(cl, client, "flood")


def test_a_client_cannot_use_another_clients_session(master):
    cl, client = master
    victim = client.rpc._session()
    s = _authed(cl)  # another authenticated peer
    forged = P.RemoveAllReq(5, P.Session(victim, 999_999, 999_999), True)
    s.sendall(framing.encode_frame(P.encode(forged)))
    r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(5.0)))
    assert (
        type(r) is P.ErrorResp and r.code == E.InvalidParams.code and "another client" in r.message
    )
    s.close()
    _still_serves(cl, client, "session")  # the victim's session still works


def test_exists_by_parts_counts_suffixes_even_without_keys(master):
    """Per-request work is capped on the parts, not only on their product: with no keys the
    product is 0, yet every suffix would be checked one by one in Python (work per byte of
    the frame, on the master's event loop). Refused by count like as many keys; a request
    whose product is past the limit is refused before any part is checked."""
    cl, client = master
    s = _authed(cl)
    many = [""] * 100_000
    for rid, req in (
        (30, P.ExistsPartsReq(30, "p", [], many)),  # product 0: was answered codes=[]
        (31, P.ExistsPartsReq(31, "p", ["k"], [*many, "\0"])),  # a bad part past the limit
    ):
        s.sendall(framing.encode_frame(P.encode(req)))
        r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(10.0)))
        assert type(r) is P.ErrorResp and r.rid == rid, (rid, r)
        assert r.code == E.InvalidParams.code and "limit" in r.message, (rid, r)
    s.close()
    _still_serves(cl, client, "parts-count")


def test_a_pipelining_peer_does_not_hold_the_loop_for_other_connections(master):
    """One authenticated peer pipelines single-key gets as fast as it can (reading its
    replies, so no backpressure stops it): every read of the master's loop then holds up to
    256 KiB of frames, thousands of gets answered inline without a suspension. Another
    client's gets must not wait for a whole read's worth of them (before the read loop let
    others in every few requests: ~0.5 s median here against ~1 ms without the flood)."""
    cl, client = master
    client.put("fair", b"v" * 100)

    def median_get_s(n: int = 15) -> float:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            assert client.get("fair") == b"v" * 100
            out.append(time.perf_counter() - t)
        return sorted(out)[n // 2]

    quiet = median_get_s()
    s = _authed(cl)
    burst = b"".join(
        framing.encode_frame(P.encode(P.GetReplicasReq(i, ["fair"]))) for i in range(1000)
    )
    stop = threading.Event()
    got = [0]

    def flood() -> None:
        try:
            while not stop.is_set():
                s.sendall(burst)
        except OSError:
            pass

    def drain() -> None:
        s.settimeout(0.5)
        while not stop.is_set():
            try:
                b = s.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not b:
                return
            got[0] += len(b)

    threads = [threading.Thread(target=f, daemon=True) for f in (flood, drain)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        busy = median_get_s()
        answered = got[0]
    finally:
        stop.set()
        s.close()
        for t in threads:
            t.join(5)
    assert answered > 100_000, answered  # the flood was served meanwhile
    assert busy < max(0.05, 20 * quiet), (busy, quiet)
    _still_serves(cl, client, "pipelining")


def test_a_stalled_frame_behind_full_inflight_slots_is_still_cut(tmp_path):
    """The master pauses a connection's deadlines while its own in-flight limit stops the
    reading (``Watched.pause``); an attacker filling its slots with log proposals (puts) and
    then stalling a begun frame must still be closed by the deadlines once the slots free,
    never kept alive by the pause (a pause never ended, planted, leaves it open)."""
    cl = StoreCluster(
        str(tmp_path),
        1,
        token=TOKEN,
        durability="memory",
        extra_args=["--idle-timeout-s", "3", "--max-inflight", "2"],
    )
    cl.start_all()
    # Its own engine: the module's client already publishes this process's segment name.
    engine = TransferEngine()
    client = StoreClient(cl.address, token=TOKEN, timeout=10, segment_size=8 << 20, engine=engine)
    try:
        s = _authed(cl)
        s.sendall(framing.encode_frame(P.encode(P.RegisterReq(1))))
        reg = P.decode_response(framing.read_frame(s, 1 << 20))
        assert type(reg) is P.RegisterResp, reg
        cfg = ReplicateConfig()
        burst = b"".join(
            framing.encode_frame(
                P.encode(
                    P.PutStartReq(i, P.Session(reg.client_id, i, 2), [f"stall/{i}"], [64], cfg)
                )
            )
            for i in range(2, 202)
        )
        s.sendall(burst + b"\xff\x00\x00")  # then a length prefix cut short, and silence
        t0 = time.monotonic()
        s.settimeout(1.0)
        closed = answers = None
        got = b""
        try:
            while time.monotonic() - t0 < 20:
                try:
                    b = s.recv(1 << 20)
                except TimeoutError:
                    continue
                if not b:
                    closed = time.monotonic() - t0
                    break
                got += b
        finally:
            s.close()
        answers = got.count(b"put_started")
        assert answers == 200, answers  # every put was served before the stall
        assert closed is not None and closed < 10, closed  # the 3 s bound
        _still_serves(cl, client, "stalled behind full slots")
    finally:
        client.close()
        engine.close()
        cl.close()


def test_get_by_parts_checks_the_joined_names_and_the_caps(master):
    """GetPartsReq (a get by name parts, the master joins them): the parts are checked as
    an ExistsPartsReq's -- the count on the product and on the suffixes, every part's key
    rules, the joined length -- before any name is built or any lease granted; a valid one
    answers exactly what GetReplicasReq of the joined names answers; the old form still
    works."""
    cl, client = master
    names = [f"gp/{p}/{c}" for p in ("a", "b") for c in ("k", "v")]
    client.put(names, [n.encode() * 3 for n in names])
    s = _authed(cl)
    for rid, req, err in (
        (40, P.GetPartsReq(40, "p", ["k"] * 1000, ["s"] * 100), E.InvalidParams),
        (41, P.GetPartsReq(41, "p", [], [""] * 100_000), E.InvalidParams),
        (42, P.GetPartsReq(42, "p" * 600, ["k"], ["s" * 600]), E.InvalidKey),
        (43, P.GetPartsReq(43, "p", ["k"], ["\0"]), E.InvalidKey),
        (44, P.GetPartsReq(44, "p", ["k"], []), E.InvalidKey),
        (45, P.GetPartsReq(45, "gp/", ["a", ""], ["/k"]), E.InvalidKey),  # an empty key
        (46, P.GetPartsReq(46, "gp/", ["a"], ["/k"], "h" * 1000), E.InvalidParams),
    ):
        s.sendall(framing.encode_frame(P.encode(req)))
        r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(10.0)))
        assert type(r) is P.ErrorResp and r.rid == rid and r.code == err.code, (rid, r)
    asks = [
        P.GetPartsReq(47, "gp/", ["a", "nope", "b"], ["/k", "/v"], "", True),
        P.GetReplicasReq(47, P.parts_names("gp/", ["a", "nope", "b"], ["/k", "/v"]), "", True),
    ]
    answers = []
    for req in asks:
        s.sendall(framing.encode_frame(P.encode(req)))
        r = P.decode_response(framing.read_frame(s, 1 << 20, Deadline(10.0)))
        assert type(r) is P.ReplicaTableResp and r.rid == 47, r
        answers.append((r.codes, r.sizes, r.segments, r.rows))
    assert answers[0] == answers[1]
    assert answers[0][0] == [0, 0, E.ObjectNotFound.code, E.ObjectNotFound.code, 0, 0]
    assert answers[0][1] == [len(n) * 3 for n in names[:2]] + [0, 0] + [
        len(n) * 3 for n in names[2:]
    ]
    s.close()
    _still_serves(cl, client, "get-parts")
