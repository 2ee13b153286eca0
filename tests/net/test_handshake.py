"""The handshake core (transcripts, forged and replayed proofs) and its socket/asyncio drivers."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import struct
import threading
import time
import tracemalloc

import msgspec
import pytest

from kvmesh.net import (
    PREAUTH_MAX_FRAME,
    AuthFailed,
    ClientHandshake,
    Deadline,
    FrameTooLarge,
    HandshakeError,
    HandshakeTimeout,
    PeerClosed,
    SecurityConfig,
    ServerHandshake,
    aclient_handshake,
    aserver_handshake,
    client_handshake,
    run_server,
    server_handshake,
)
from kvmesh.net import handshake as H

TOKEN = "s3cret"
SEC = SecurityConfig(token=TOKEN)
NOSEC = SecurityConfig()


def body(frame: bytes) -> bytes:
    (n,) = struct.unpack_from("<I", frame)
    assert n == len(frame) - 4
    return frame[4:]


def decode(frame: bytes) -> dict:
    return msgspec.msgpack.decode(body(frame))


def lp(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def ref_key(token: str, role: bytes, ident: bytes) -> bytes:
    """key(role, id) of kvmesh.net.identity, written out independently of the module."""
    return hmac.new(token.encode(), b"kvmesh-id/1" + lp(role, ident), hashlib.sha256).digest()


def ref_mac(token: str, label: bytes, *parts: bytes, role=b"client", ident=b"") -> bytes:
    """The transcript format written out independently of the module."""
    data = b"kvmesh-net/2 " + label + lp(*parts)
    return hmac.new(ref_key(token, role, ident), data, hashlib.sha256).digest()


def pair(service="transfer", ssec=SEC, csec=SEC, cid="client-1", sid="server-1", **kw):
    s = ServerHandshake(ssec, service, sid, info=kw.get("sinfo", b""), nonce=b"N" * 32)
    c = ClientHandshake(
        csec, kw.get("cservice", service), cid, info=kw.get("cinfo", b""), nonce=b"C" * 32
    )
    return s, c


def test_transcript_with_token():
    s, c = pair(sinfo=b"node=a", cinfo=b"watch")
    ch = s.start()
    d = decode(ch)
    assert d == {
        "type": "challenge",
        "nonce": b"N" * 32,
        "server_id": "server-1",
        "service": "transfer",
        "version": 2,
        "auth_required": True,
        "info": b"node=a",
    }
    assert len(ch) <= PREAUTH_MAX_FRAME
    hello = c.receive(body(ch))
    d = decode(hello)
    assert d["type"] == "hello" and d["client_id"] == "client-1" and d["client_nonce"] == b"C" * 32
    assert d["mac"] == ref_mac(
        TOKEN, b"c", b"transfer", b"N" * 32, b"C" * 32, b"client", b"client-1", b"watch",
        b"server-1",
    )  # fmt: skip
    assert TOKEN.encode() not in hello and TOKEN.encode() not in ch
    welcome = s.receive(body(hello))
    d = decode(welcome)
    assert d == {
        "type": "welcome",
        "mac": ref_mac(
            TOKEN,
            b"s",
            b"transfer",
            b"C" * 32,
            b"N" * 32,
            b"client",
            b"server-1",
            b"node=a",
            b"client-1",
        ),
    }
    assert s.done and s.peer_id == "client-1" and s.peer_info == b"watch"
    assert s.peer_role == "client"
    assert not c.done
    assert c.receive(body(welcome)) is None
    assert c.done and c.peer_id == "server-1" and c.peer_info == b"node=a"
    with pytest.raises(HandshakeError):
        s.receive(body(hello))  # one handshake per connection


def test_transcript_without_token():
    s, c = pair(ssec=NOSEC, csec=NOSEC)
    ch = s.start()
    assert decode(ch)["auth_required"] is False
    hello = c.receive(body(ch))
    assert decode(hello)["mac"] is None
    welcome = s.receive(body(hello))
    assert decode(welcome)["mac"] is None
    c.receive(body(welcome))
    assert c.done and s.peer_id == "client-1" and c.peer_id == "server-1"


def refused(exc: HandshakeError) -> dict:
    assert exc.reply is not None
    d = decode(exc.reply)
    assert d["type"] == "refused"
    return d


def test_bad_mac_is_refused_with_auth_code():
    s, c = pair()
    hello = decode(c.receive(body(s.start())))
    mac = bytearray(hello["mac"])
    mac[0] ^= 1
    forged = msgspec.msgpack.encode({**hello, "mac": bytes(mac)})
    with pytest.raises(AuthFailed) as ei:
        s.receive(forged)
    assert refused(ei.value)["code"] == "auth"
    assert not s.done and s.peer_id is None
    # The client turns the Refused frame into AuthFailed.
    c2 = ClientHandshake(SEC, "transfer", "x")
    c2.receive(body(ServerHandshake(SEC, "transfer", "y").start()))
    with pytest.raises(AuthFailed, match="refused"):
        c2.receive(body(ei.value.reply))


def test_wrong_token_either_side():
    s, c = pair(csec=SecurityConfig(token="other"))
    with pytest.raises(AuthFailed):
        s.receive(body(c.receive(body(s.start()))))
    # A server with the wrong token cannot produce a Welcome the client accepts.
    s, c = pair(ssec=SecurityConfig(token="other"))
    c.receive(body(s.start()))
    fake = H._frame(
        H.Welcome(
            ref_mac("other", b"s", b"transfer", b"C" * 32, b"N" * 32, b"server-1", b"", b"client-1")
        )
    )
    with pytest.raises(AuthFailed, match="could not prove"):
        c.receive(body(fake))
    s, c = pair()
    c.receive(body(s.start()))
    with pytest.raises(AuthFailed):
        c.receive(body(H._frame(H.Welcome(None))))


def test_token_on_one_side_only():
    s, c = pair(csec=NOSEC)
    with pytest.raises(AuthFailed, match="requires a token"):
        c.receive(body(s.start()))
    # A client without a token that sends a Hello anyway is refused by the server.
    hello = H._frame(H.Hello("client-1", b"C" * 32, None))
    with pytest.raises(AuthFailed):
        s.receive(body(hello))
    s, c = pair(ssec=NOSEC)
    with pytest.raises(AuthFailed, match="server has none"):
        c.receive(body(s.start()))


def test_proof_replayed_across_services_is_refused():
    # The same nonce offered by a "transfer" server and a "replog-peer" server: a proof made
    # for one does not open the other.
    s_log = ServerHandshake(SEC, "replog-peer", "server-1", nonce=b"N" * 32)
    c_log = ClientHandshake(SEC, "replog-peer", "client-1", nonce=b"C" * 32)
    hello_for_log = c_log.receive(body(s_log.start()))
    s_tr = ServerHandshake(SEC, "transfer", "server-1", nonce=b"N" * 32)
    s_tr.start()
    with pytest.raises(AuthFailed):
        s_tr.receive(body(hello_for_log))
    # And a Welcome of the log server does not satisfy a transfer client.
    welcome_log = s_log.receive(body(hello_for_log))
    c_tr = ClientHandshake(SEC, "transfer", "client-1", nonce=b"C" * 32)
    c_tr.receive(body(H._frame(H.Challenge(b"N" * 32, "server-1", "transfer", H.VERSION, True))))
    with pytest.raises(AuthFailed):
        c_tr.receive(body(welcome_log))


def test_client_refuses_the_wrong_service_port():
    s = ServerHandshake(NOSEC, "store", "srv")
    c = ClientHandshake(NOSEC, "transfer", "cli")
    with pytest.raises(HandshakeError, match="store") as ei:
        c.receive(body(s.start()))
    assert ei.value.code == "service"


def test_wrong_peer_id_is_refused():
    # A man in the middle that rewrites the claimed client id (to impersonate another node)
    # breaks the proof: the id is bound into the MAC.
    s, c = pair()
    hello = decode(c.receive(body(s.start())))
    forged = msgspec.msgpack.encode({**hello, "client_id": "node-7"})
    with pytest.raises(AuthFailed):
        s.receive(forged)
    # Rewriting the server id in the challenge breaks the client's proof as seen by the server.
    s, c = pair()
    ch = decode(s.start())
    hello = c.receive(msgspec.msgpack.encode({**ch, "server_id": "server-2"}))
    with pytest.raises(AuthFailed):
        s.receive(body(hello))
    # A client that expects a given server id refuses another.
    s = ServerHandshake(SEC, "transfer", "server-2")
    c = ClientHandshake(SEC, "transfer", "cli", expect_server_id="server-1")
    with pytest.raises(HandshakeError, match="server-1") as ei:
        c.receive(body(s.start()))
    assert ei.value.code == "identity"


@pytest.mark.parametrize(
    "hello",
    [
        {"type": "hello", "client_id": "x" * 257, "client_nonce": b"C" * 32, "mac": None},
        {"type": "hello", "client_id": "é" * 200, "client_nonce": b"C" * 32, "mac": None},
        {"type": "hello", "client_id": "x", "client_nonce": b"C" * 8, "mac": None},
        {"type": "hello", "client_id": "x", "client_nonce": b"C" * 65, "mac": None},
        {"type": "hello", "client_id": "x", "client_nonce": b"C" * 32, "mac": b"m" * 65},
        {
            "type": "hello",
            "client_id": "x",
            "client_nonce": b"C" * 32,
            "mac": None,
            "info": b"i" * 1025,
        },
        {"type": "hello", "client_id": "x", "client_nonce": b"C" * 32, "mac": None, "version": 99},
        {"type": "welcome", "mac": None},
        "not a struct",
    ],
)
def test_oversize_or_malformed_hello_is_refused_without_echo(hello):
    s = ServerHandshake(SEC, "transfer", "srv")
    s.start()
    with pytest.raises(HandshakeError) as ei:
        s.receive(msgspec.msgpack.encode(hello))
    d = refused(ei.value)
    assert d["code"] in ("protocol", "version")
    assert len(ei.value.reply) < 600 and len(str(ei.value)) < 600
    assert s.peer_id is None


def test_garbage_hello_is_a_protocol_refusal():
    s = ServerHandshake(SEC, "transfer", "srv")
    s.start()
    with pytest.raises(HandshakeError) as ei:
        s.receive(b"\xc1" * 3000)
    assert refused(ei.value)["code"] == "protocol"


def test_core_rejects_oversize_local_ids():
    with pytest.raises(ValueError):
        ServerHandshake(SEC, "transfer", "x" * 300)
    with pytest.raises(ValueError):
        ClientHandshake(SEC, "transfer", "x", info=b"i" * 2000)


# --- blocking driver over real sockets -----------------------------------------------------------


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    lsock = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(lsock.getsockname())
    s, _ = lsock.accept()
    lsock.close()
    return s, c


def _in_thread(fn, *args):
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("sec", [SEC, NOSEC], ids=["token", "no-token"])
def test_blocking_drivers_end_to_end(sec):
    s, c = _tcp_pair()
    t, box = _in_thread(server_handshake, s, sec, "transfer", "srv-1", 5.0)
    assert client_handshake(c, sec, "transfer", "cli-1", 5.0) == "srv-1"
    t.join(5)
    assert box == {"value": "cli-1"}
    # Frames after the handshake flow normally; the socket's own timeout was restored.
    assert s.gettimeout() is None and c.gettimeout() is None
    s.close()
    c.close()


def test_blocking_wrong_token_refused_over_socket():
    s, c = _tcp_pair()
    t, box = _in_thread(server_handshake, s, SEC, "transfer", "srv-1", 5.0)
    with pytest.raises(AuthFailed, match="wrong token"):
        client_handshake(c, SecurityConfig(token="nope"), "transfer", "cli-1", 5.0)
    t.join(5)
    assert isinstance(box["error"], AuthFailed)
    s.close()
    c.close()


def test_oversize_preauth_frame_closes_before_allocating():
    s, c = _tcp_pair()
    c.sendall(struct.pack("<I", 64 << 20) + b"x" * 100)
    hs = ServerHandshake(SEC, "transfer", "srv")
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(FrameTooLarge):
            run_server(s, hs, Deadline(5.0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 3.0  # refused at once, not at the 5 s deadline
    assert peak < 256 << 10, peak
    # Just over the pre-auth cap is refused as well.
    s2, c2 = _tcp_pair()
    c2.sendall(struct.pack("<I", PREAUTH_MAX_FRAME + 1))
    with pytest.raises(FrameTooLarge):
        run_server(s2, ServerHandshake(SEC, "transfer", "srv"), Deadline(5.0))
    for x in (s, c, s2, c2):
        x.close()


def test_deadline_is_absolute_over_a_trickling_socket():
    # The client announces a small hello and sends one byte every 50 ms: each recv succeeds
    # well within any per-recv timeout, but the whole handshake must end at the deadline.
    s, c = _tcp_pair()
    stop = threading.Event()

    def trickle():
        c.recv(4096)  # the challenge
        c.sendall(struct.pack("<I", 2000))
        while not stop.is_set():
            try:
                c.send(b"x")
            except OSError:
                return
            time.sleep(0.05)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeout):
        run_server(s, ServerHandshake(SEC, "transfer", "srv"), Deadline(0.6))
    took = time.monotonic() - t0
    stop.set()
    # Trickled to its end, the 2000-byte hello takes 100 s; the slack is for a loaded machine.
    assert 0.5 < took < 4.0, took
    s.close()
    c.close()
    t.join(2)


def test_peer_closing_mid_handshake():
    s, c = _tcp_pair()
    c.sendall(struct.pack("<I", 100) + b"abc")
    c.close()
    with pytest.raises(PeerClosed):
        run_server(s, ServerHandshake(SEC, "transfer", "srv"), Deadline(5.0))
    s.close()


# --- asyncio driver -------------------------------------------------------------------------------


def test_asyncio_drivers_end_to_end_and_refusal():
    async def main():
        results: list = []

        async def on_conn(reader, writer):
            try:
                results.append(
                    await aserver_handshake(reader, writer, SEC, "replog-peer", "n1", 5.0)
                )
            except Exception as exc:
                results.append(exc)
            finally:
                writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await aclient_handshake(r, w, SEC, "replog-peer", "n2", 5.0) == "n1"
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(AuthFailed):
            await aclient_handshake(r, w, SecurityConfig(token="bad"), "replog-peer", "n3", 5.0)
        w.close()
        # A silent client: the server gives up at its deadline.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0)
        server.close()
        return results, r, w

    async def silent():
        async def on_conn(reader, writer):
            try:
                box.append(await aserver_handshake(reader, writer, SEC, "store", "n1", 0.3))
            except Exception as exc:
                box.append(exc)
            writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        while not box and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        w.close()
        server.close()
        return time.monotonic() - t0

    results, _, w = asyncio.run(main())
    assert results[0] == "n2"
    assert isinstance(results[1], AuthFailed)
    box: list = []
    took = asyncio.run(silent())
    assert isinstance(box[0], HandshakeTimeout), box
    assert took < 5.0  # the 0.3 s deadline, with slack for a loaded machine
