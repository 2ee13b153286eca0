"""Certificates bound to identities, against LIVE replica processes under mutual TLS
(issue 16, section 2: "with TLS identities bound to node ids when TLS is on").

Each replica runs with a certificate naming ``kvmesh://replica/N`` (the CA every replica
trusts). The attacker holds the cluster secret -- keys for every (role, id), so the key
handshake alone would admit any claim -- and a certificate the CA issued: one naming only
``kvmesh://client``, or one naming another replica. Claiming the leader's id and
pipelining a TimeoutNow behind its Hello (a forgery that moved leadership in 5 of 5 rounds
without identities), it is refused (``forbidden``) at every follower, no leadership moves,
and the replicas converge. A certificate that names the claim is welcome (the control).
"""

from __future__ import annotations

import asyncio
import os

import msgspec

from kvmesh.net import (
    AuthFailed,
    SecurityConfig,
    aclient_handshake,
    aread_frame,
    client_ssl_context,
    encode_frame,
)
from kvmesh.net import handshake as H
from kvmesh.net import identity as I
from kvmesh.replog.net.protocol import PEER_SERVICE
from kvmesh.replog.net.server import LocalCluster
from kvmesh.replog.net.transport import parse_addr
from kvmesh.replog.types import TimeoutNow
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.protocol import SERVICE as STORE_SERVICE

from ..net.certs import TestCA
from .test_hostile import check_many, msg_frames, put_many, run
from .test_identity import SECRET, TICK_MS, app, converged, leader


class TlsCluster(LocalCluster):
    """A LocalCluster whose replica N presents a certificate naming ``kvmesh://replica/N``."""

    def __init__(self, base_dir: str) -> None:
        super().__init__(base_dir, 3, tick_ms=TICK_MS, election_ticks=10, token=SECRET)
        self.ca = TestCA(base_dir)
        self.certs = {i: self.ca.issue(f"replica{i}", f"kvmesh://replica/{i}") for i in self.ids}
        cert, key = self.ca.issue("app", "kvmesh://client")
        self.client_security = SecurityConfig(
            credential=I.issue(SECRET, "client"), tls_cert=cert, tls_key=key, tls_ca=self.ca.path
        )

    def command(self, i: int) -> list[str]:
        cert, key = self.certs[i]
        return [*super().command(i), "--tls-cert", cert, "--tls-key", key, "--tls-ca", self.ca.path]


async def claim_over_tls(addr: str, sec: SecurityConfig, role: str, cid: str, *msgs) -> str:
    """Claim ``role`` ``cid`` over TLS with ``sec``'s certificate and a proof made from the
    cluster secret (a valid key for the claim); pipeline ``msgs`` behind the Hello. Returns
    the server's answer (``welcome`` or the refusal code)."""
    host, port = parse_addr(addr)
    r, w = await asyncio.open_connection(host, port, ssl=client_ssl_context(sec))
    try:
        ch = msgspec.msgpack.decode(await asyncio.wait_for(aread_frame(r, 4096), 5))
        cnonce = os.urandom(32)
        key = I.derive_key(SECRET, role, cid)
        mac = H.client_mac(key, PEER_SERVICE, ch["nonce"], cnonce, role, cid, b"", ch["server_id"])
        hello = {"type": "hello", "client_id": cid, "client_nonce": cnonce, "mac": mac,
                 "version": H.VERSION, "info": b"", "role": role}  # fmt: skip
        w.write(encode_frame(msgspec.msgpack.encode(hello)) + msg_frames(*msgs))
        await w.drain()
        answer = msgspec.msgpack.decode(await asyncio.wait_for(aread_frame(r, 4096), 5))
        return answer["type"] if answer["type"] == "welcome" else answer["code"]
    finally:
        w.close()


def test_certificates_bind_claims_at_live_replicas(tmp_path):
    cluster = TlsCluster(str(tmp_path))
    try:
        cluster.start_all()

        async def main():
            async with app(cluster) as c:  # the cluster works under TLS with bound certificates
                await put_many(c, "a", 10)
                lid, st = await leader(cluster)
                term = st[lid]["term"]
                ca = cluster.ca
                as_client = ca.issue("attacker-client", "kvmesh://client")
                answers = {}
                for f in (i for i in cluster.ids if i != lid):
                    other = next(i for i in cluster.ids if i not in (lid, f))
                    as_other = ca.issue(f"attacker-replica{other}", f"kvmesh://replica/{other}")
                    for name, (cert, key) in (("client", as_client), ("other", as_other)):
                        sec = SecurityConfig(token=SECRET, tls_cert=cert, tls_key=key,
                                             tls_ca=ca.path)  # fmt: skip
                        answers[(f, name)] = await claim_over_tls(
                            cluster.peers[f], sec, "replica", str(lid), TimeoutNow(lid, f, term)
                        )
                # The control: the leader's own certificate for the leader's claim (no
                # message behind it) is welcome -- the refusals are the certificates'.
                cert, key = cluster.certs[lid]
                sec = SecurityConfig(token=SECRET, tls_cert=cert, tls_key=key, tls_ca=ca.path)
                f = next(i for i in cluster.ids if i != lid)
                control = await claim_over_tls(cluster.peers[f], sec, "replica", str(lid))
                await asyncio.sleep(1.0)  # an election a TimeoutNow had triggered: over by now
                lid2, st = await leader(cluster)
                assert lid2 == lid and {s["term"] for s in st.values()} == {term}, st
                await put_many(c, "b", 10)
                await check_many(c, "a", 10)
            await converged(cluster)
            assert set(answers.values()) == {"forbidden"}, answers
            assert control == "welcome", control

        run(main())
    finally:
        cluster.close()


class _TlsStore(StoreCluster):
    """One store master whose certificate names ``kvmesh://replica/1``."""

    def __init__(self, base_dir: str, ca: TestCA) -> None:
        super().__init__(base_dir, 1, token=SECRET, durability="memory")
        self.cert, self.key = ca.issue("master1", "kvmesh://replica/1")
        self.ca = ca

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(KVMESH_TLS_CERT=self.cert, KVMESH_TLS_KEY=self.key, KVMESH_TLS_CA=self.ca.path)
        return env


async def _store_claim(addr: str, sec: SecurityConfig, role: str, cid: str) -> str:
    host, port = parse_addr(addr)
    r, w = await asyncio.open_connection(host, port, ssl=client_ssl_context(sec))
    try:
        await aclient_handshake(r, w, sec, STORE_SERVICE, cid, role=role)
        return "welcome"
    except AuthFailed as exc:
        return exc.code or "auth"
    finally:
        w.close()


def test_node_certificates_bind_node_ids_at_a_live_store_master(tmp_path):
    """A storage node's certificate names ``kvmesh://node/A``: with keys for every identity
    (the cluster secret) it still cannot speak as node B, a replica or -- with a client
    certificate -- as node A; its own claim is welcome."""
    ca = TestCA(str(tmp_path))
    node_a = ca.issue("node-a", "kvmesh://node/A")
    app_cert = ca.issue("app", "kvmesh://client")
    with _TlsStore(str(tmp_path / "store"), ca) as cl:
        cl.start_all()
        addr = cl.addrs[1]

        def sec(pair: tuple[str, str]) -> SecurityConfig:
            return SecurityConfig(token=SECRET, tls_cert=pair[0], tls_key=pair[1], tls_ca=ca.path)

        async def main():
            return {
                "A as B": await _store_claim(addr, sec(node_a), "node", "B"),
                "A as replica": await _store_claim(addr, sec(node_a), "replica", "1"),
                "client as A": await _store_claim(addr, sec(app_cert), "node", "A"),
                "A as A": await _store_claim(addr, sec(node_a), "node", "A"),
                "client as client": await _store_claim(addr, sec(app_cert), "client", "app"),
            }

        got = run(main())
    assert got == {
        "A as B": "forbidden",
        "A as replica": "forbidden",
        "client as A": "forbidden",
        "A as A": "welcome",
        "client as client": "welcome",
    }, got
