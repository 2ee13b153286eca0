"""Per-role, per-id identity (kvmesh.net.identity): derived keys, credentials, and the
handshake refusing every claim a credential does not cover."""

from __future__ import annotations

import struct

import msgspec
import pytest

from kvmesh.net import (
    AuthFailed,
    ClientHandshake,
    SecurityConfig,
    ServerHandshake,
    check_cert_identity,
)
from kvmesh.net import handshake as H
from kvmesh.net import identity as I

SECRET = "cluster-secret-for-identity-tests"
CLUSTER = SecurityConfig(token=SECRET)
CLIENT = SecurityConfig(credential=I.issue(SECRET, "client"))
NODE_A = SecurityConfig(credential=I.issue(SECRET, "node", "node-a"))


def body(frame: bytes) -> bytes:
    (n,) = struct.unpack_from("<I", frame)
    return frame[4:]


def handshake(ssec, csec, role, cid, *, accept=None, service="replog-peer"):
    """Run one in-memory handshake; returns the server core (raises what either side does)."""
    s = ServerHandshake(ssec, service, "server", accept=accept)
    c = ClientHandshake(csec, service, cid, role=role)
    hello = c.receive(body(s.start()))
    welcome = s.receive(body(hello))
    c.receive(body(welcome))
    assert c.done and s.done
    return s


def forged_hello(server: ServerHandshake, key: bytes, role: str, cid: str) -> bytes:
    """A Hello claiming ``role`` ``cid`` with a proof made from ``key`` (what a credential
    holder can compute for any claim)."""
    ch = msgspec.msgpack.decode(body(server.start()))
    cnonce = b"C" * 32
    mac = H.client_mac(key, server.service, ch["nonce"], cnonce, role, cid, b"", "server")
    return msgspec.msgpack.encode(
        {"type": "hello", "client_id": cid, "client_nonce": cnonce, "mac": mac, "version": 2,
         "info": b"", "role": role}
    )  # fmt: skip


def test_keys_bind_role_and_id_and_clients_share_one():
    keys = {
        (r, i): I.derive_key(SECRET, r, i)
        for r in ("replica", "node")
        for i in ("1", "2", "node-a")
    }
    keys[("client", "")] = I.derive_key(SECRET, "client", "")
    assert len(set(keys.values())) == len(keys)  # every (role, id) its own key
    assert I.derive_key(SECRET, "client", "anything") == keys[("client", "")]
    assert I.derive_key("another-secret", "replica", "1") != keys[("replica", "1")]
    with pytest.raises(ValueError):
        I.derive_key(SECRET, "admin", "1")


def test_credentials_round_trip_and_hide_their_keys():
    text = I.issue(SECRET, "node", "node-a")
    cred = I.parse(text)
    assert (cred.role, cred.id) == ("node", "node-a")
    assert cred.key == I.derive_key(SECRET, "node", "node-a")
    assert cred.client_key == I.derive_key(SECRET, "client", "")
    assert SECRET not in text
    assert cred.key.hex() not in repr(cred) and "hidden" in repr(cred)
    assert "kvmesh-cred1" not in repr(NODE_A) and NODE_A.identity == ("node", "node-a")
    for bad in ("", "kvmesh-cred1.", "kvmesh-cred1.!!!", SECRET, text[:-8]):
        with pytest.raises(ValueError):
            I.parse(bad)
    with pytest.raises(ValueError):
        SecurityConfig(credential="not-a-credential")
    with pytest.raises(ValueError):
        SecurityConfig(token=SECRET, credential=text)
    with pytest.raises(ValueError):
        I.issue(SECRET, "replica")  # needs an id
    with pytest.raises(ValueError):
        I.issue(SECRET, "client", "c1")  # clients carry none


def test_from_env_reads_a_credential(tmp_path):
    text = I.issue(SECRET, "client")
    assert SecurityConfig.from_env({"KVMESH_CREDENTIAL": text}).identity == ("client", "")
    f = tmp_path / "cred"
    f.write_text(text + "\n")
    assert SecurityConfig.from_env({"KVMESH_CREDENTIAL_FILE": str(f)}).credential == text
    with pytest.raises(ValueError):
        SecurityConfig.from_env({"KVMESH_CREDENTIAL": text, "KVMESH_CREDENTIAL_FILE": str(f)})
    with pytest.raises(ValueError):
        SecurityConfig.from_env({"KVMESH_CREDENTIAL": text, "KVMESH_TOKEN": SECRET})


def test_what_each_holder_can_prove():
    # The secret proves anything; a credential its own (role, id) and "a client".
    assert handshake(CLUSTER, CLUSTER, "replica", "1").peer_role == "replica"
    s = handshake(CLUSTER, NODE_A, "node", "node-a")
    assert (s.peer_role, s.peer_id) == ("node", "node-a")
    assert handshake(CLUSTER, NODE_A, "client", "engine-x").peer_role == "client"
    assert handshake(CLUSTER, CLIENT, "client", "whoever").peer_id == "whoever"
    # A server holding only a credential verifies clients (a storage node's engine) ...
    assert handshake(NODE_A, CLIENT, "client", "c").peer_role == "client"
    # ... but cannot verify (so refuses) anything else.
    with pytest.raises(AuthFailed, match="cannot verify"):
        handshake(CLIENT, CLUSTER, "replica", "1")


@pytest.mark.parametrize(
    ("csec", "role", "cid"),
    [
        (CLIENT, "replica", "1"),  # a client speaking as the leader
        (CLIENT, "node", "node-a"),  # a client acting as a storage node
        (NODE_A, "node", "node-b"),  # node a claiming node b's id
        (NODE_A, "replica", "node-a"),  # a node claiming a replica
    ],
)
def test_a_credential_cannot_claim_another_identity(csec, role, cid):
    # The honest client side refuses to try ...
    with pytest.raises(AuthFailed, match="cannot speak as"):
        handshake(CLUSTER, csec, role, cid)
    # ... and a forged Hello, the proof made with every key the holder has, is refused.
    cred = I.parse(csec.credential)
    for key in {cred.key, cred.client_key}:
        s = ServerHandshake(CLUSTER, "replog-peer", "server")
        with pytest.raises(AuthFailed) as ei:
            s.receive(forged_hello(s, key, role, cid))
        assert ei.value.code == "auth"
        assert not s.done and s.peer_id is None and s.peer_role is None


def test_role_is_bound_into_the_proof():
    # A real client proof re-labelled as a replica's (same id, same nonces) does not verify.
    s = ServerHandshake(CLUSTER, "replog-peer", "server", nonce=b"N" * 32)
    c = ClientHandshake(CLIENT, "replog-peer", "1", nonce=b"C" * 32)
    hello = msgspec.msgpack.decode(body(c.receive(body(s.start()))))
    assert hello["role"] == "client"
    with pytest.raises(AuthFailed):
        s.receive(msgspec.msgpack.encode({**hello, "role": "replica"}))


def test_accept_policy_refuses_authenticated_claims():
    members = {"1", "2", "3"}

    def accept(role, cid):
        if role != "replica":
            return "only replicas speak raft here"
        return None if cid in members else "not a member"

    assert handshake(CLUSTER, CLUSTER, "replica", "2", accept=accept).peer_id == "2"
    for role, cid in (("replica", "4"), ("client", "1"), ("node", "1")):
        with pytest.raises(AuthFailed) as ei:
            handshake(CLUSTER, CLUSTER, role, cid, accept=accept)
        assert ei.value.code == "forbidden"
    # Without keys the claim is unproven, but the policy still applies to it.
    with pytest.raises(AuthFailed):
        handshake(SecurityConfig(), SecurityConfig(), "client", "1", accept=accept)


def test_certificate_identities_bind_claims():
    mtls = SecurityConfig(token=SECRET, tls_cert="c", tls_key="k", tls_ca="ca")
    strict = SecurityConfig(token=SECRET, tls_cert="c", tls_key="k", tls_ca="ca",
                            tls_require_ids=True)  # fmt: skip
    r1 = {"subjectAltName": (("DNS", "host1"), ("URI", "kvmesh://replica/1"))}
    cl = {"subjectAltName": (("URI", "kvmesh://client"),)}
    plain = {"subject": ((("commonName", "x"),),)}
    assert check_cert_identity(mtls, r1, "replica", "1") is None
    assert "does not name" in check_cert_identity(mtls, r1, "replica", "2")
    assert "does not name" in check_cert_identity(mtls, r1, "client", "c")
    assert check_cert_identity(mtls, cl, "client", "any-name") is None
    assert "does not name" in check_cert_identity(mtls, cl, "replica", "1")
    assert check_cert_identity(mtls, plain, "replica", "1") is None  # names none: chain only
    assert "names no kvmesh identity" in check_cert_identity(strict, plain, "replica", "1")
    assert check_cert_identity(CLUSTER, r1, "replica", "9") is None  # no mutual TLS
    # In the handshake: the claim must match the certificate the driver saw.
    s = ServerHandshake(mtls, "replog-peer", "server", peer_cert=r1)
    c = ClientHandshake(CLUSTER, "replog-peer", "2", role="replica")
    with pytest.raises(AuthFailed) as ei:
        s.receive(body(c.receive(body(s.start()))))
    assert ei.value.code == "forbidden"
