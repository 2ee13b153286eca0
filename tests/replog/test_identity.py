"""Who can speak as a replica (issue 16, section 2), against LIVE replica processes.

The cluster runs with a cluster secret; the attacker holds what an application gets: the
client credential (``kvmesh keys client``), or a credential issued for another replica id.
It speaks the handshake itself, claims the leader's id (as a client, and as a replica with
every key it holds) and pipelines the forged Raft message right behind its Hello, so a
server that let the claim through would act on it. The three forgeries of the issue -- an
Append that used to lose an acknowledged write, a well-formed InstallSnapshot 1,000 entries
ahead, a TimeoutNow that moved leadership -- must each be refused at the handshake, and
afterwards: no acknowledged write lost, no leadership moved, the replicas' digests equal.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from kvmesh.net import SecurityConfig, aread_frame, encode_frame
from kvmesh.net import handshake as H
from kvmesh.net import identity as I
from kvmesh.replog.kvsm import KvPut, KvStateMachine, encode_command
from kvmesh.replog.net.client import KvClient
from kvmesh.replog.net.protocol import PEER_SERVICE
from kvmesh.replog.net.server import LocalCluster
from kvmesh.replog.session import Plain, SessionStateMachine, encode_envelope
from kvmesh.replog.types import (
    Append,
    ConfState,
    Entry,
    InstallSnapshot,
    Snapshot,
    SnapshotMeta,
    TimeoutNow,
)

from .test_hostile import check_many, msg_frames, open_raw, put_many, run

SECRET = "identity-test-cluster-secret"
TICK_MS = 50


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(str(tmp_path), 3, tick_ms=TICK_MS, election_ticks=10, token=SECRET)
    try:
        c.start_all()
        yield c
    finally:
        c.close()


def app(cluster, **kw):
    """An honest application: it holds the client credential, never the secret."""
    kw.setdefault("timeout", 20.0)
    kw.setdefault("attempt_timeout", 1.0)
    return KvClient(cluster.client_addrs, security=cluster.client_security, **kw)


async def statuses(cluster, digest=False):
    out = {}
    async with app(cluster) as c:
        for i in cluster.ids:
            if cluster.alive(i):
                try:
                    out[i] = await c.status(cluster.client_addrs[i], digest=digest)
                except (TimeoutError, OSError, ConnectionError):
                    pass
    return out


async def leader(cluster, timeout=15.0):
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        st = await statuses(cluster)
        leaders = [i for i, s in st.items() if s["role"] == "LEADER"]
        if len(leaders) == 1 and len({s["leader"] for s in st.values()}) == 1:
            return leaders[0], st
        await asyncio.sleep(0.1)
    raise AssertionError(f"no leader within {timeout}s")


async def converged(cluster, timeout=30.0):
    end = asyncio.get_running_loop().time() + timeout
    st = {}
    while asyncio.get_running_loop().time() < end:
        st = await statuses(cluster, digest=True)
        seen = {(s["applied"], s["digest"]) for s in st.values()}
        if len(st) == len(cluster.ids) and len(seen) == 1:
            return st
        await asyncio.sleep(0.2)
    raise AssertionError(f"replicas did not converge: {st}")


def claims(lid: int, other: int) -> list[tuple[str, str, bytes]]:
    """(role, id, key) an attacker can try for the leader ``lid``: as a client under the
    leader's id (the client key), as the leader with the client key, and as the leader with
    the credential of replica ``other``."""
    client = I.parse(I.issue(SECRET, "client"))
    replica = I.parse(I.issue(SECRET, "replica", str(other)))
    return [
        ("client", str(lid), client.key),
        ("replica", str(lid), client.key),
        ("replica", str(lid), replica.key),
        ("replica", str(lid), replica.client_key),
    ]


async def forge(addr: str, role: str, cid: str, key: bytes, *msgs) -> str:
    """Claim ``role`` ``cid`` at a raft port with a proof made from ``key`` and pipeline
    ``msgs`` behind the Hello; hold the connection until the server closes it (or 2 s).
    Returns the server's answer (``welcome``, or the refusal code)."""
    r, w = await open_raw(addr)
    try:
        ch = msgspec.msgpack.decode(await asyncio.wait_for(aread_frame(r, 4096), 5))
        cnonce = os.urandom(32)
        mac = H.client_mac(key, PEER_SERVICE, ch["nonce"], cnonce, role, cid, b"", ch["server_id"])
        hello = {"type": "hello", "client_id": cid, "client_nonce": cnonce, "mac": mac,
                 "version": H.VERSION, "info": b"", "role": role}  # fmt: skip
        w.write(encode_frame(msgspec.msgpack.encode(hello)) + msg_frames(*msgs))
        await w.drain()
        answer = msgspec.msgpack.decode(await asyncio.wait_for(aread_frame(r, 4096), 5))
        try:
            await asyncio.wait_for(r.read(), 2.0)  # EOF once refused
        except TimeoutError:
            pass
        return answer["type"] if answer["type"] == "welcome" else answer["code"]
    finally:
        w.close()


async def refused_everywhere(cluster, target: int, make_msgs, lid: int, other: int):
    answers = []
    for role, cid, key in claims(lid, other):
        answers.append(await forge(cluster.peers[target], role, cid, key, *make_msgs()))
    return answers


def test_forged_append_by_a_client_credential_loses_no_acknowledged_write(cluster):
    """The issue's scenario: with one follower down, an Append claiming the leader's id puts
    foreign entries and a commit index on the other follower; the next write is acknowledged
    on that follower's ack; the leader fails over to it and the write is gone."""

    async def main():
        async with app(cluster) as c:
            await put_many(c, "a", 20)
            lid, st = await leader(cluster)
            f1, f2 = [i for i in cluster.ids if i != lid]
            cluster.kill(f2)
            term, last = st[f1]["term"], st[f1]["last_index"]
            body = encode_envelope(Plain(encode_command(KvPut("forged", b"x"))))

            def msgs():
                ents = [Entry(term, last + k, 0, body) for k in range(1, 40)]
                return [Append(lid, f1, term, last, term, last + 39, ents)]

            answers = await refused_everywhere(cluster, f1, msgs, lid, f2)
            await put_many(c, "b", 20)  # acknowledged
            cluster.kill(lid)
            cluster.start(f2)
            await check_many(c, "a", 20)
            await check_many(c, "b", 20)
            assert await c.get("forged") is None
            cluster.start(lid)
        st = await converged(cluster)
        assert all(s["peer_refused_handshakes"] >= 1 for i, s in st.items() if i == f1), st
        assert answers == ["forbidden", "auth", "auth", "auth"], answers

    run(main())


def test_forged_snapshot_1000_entries_ahead_is_refused(cluster):
    """A well-formed InstallSnapshot (a real image holding a forged key) 1,000 entries ahead
    of the follower, claiming the leader's id."""

    async def main():
        async with app(cluster) as c:
            await put_many(c, "a", 20)
            lid, st = await leader(cluster)
            f1, f2 = [i for i in cluster.ids if i != lid]
            term = st[lid]["term"]
            sm = SessionStateMachine(KvStateMachine())
            sm.inner.apply(1, encode_command(KvPut("forged", b"x")))
            meta = SnapshotMeta(st[f1]["commit"] + 1000, term, ConfState(tuple(cluster.ids)))
            snap = Snapshot(meta, sm.snapshot())

            def msgs():
                return [InstallSnapshot(lid, f1, term, snap)]

            answers = await refused_everywhere(cluster, f1, msgs, lid, f2)
            await put_many(c, "b", 20)
            st = await statuses(cluster)
            assert st[f1]["snapshots_installed"] == 0, st[f1]
            assert st[f1]["applied"] <= st[lid]["applied"], st
            cluster.kill(lid)  # fail over: f1 may lead now
            await check_many(c, "a", 20)
            await check_many(c, "b", 20)
            assert await c.get("forged") is None
            cluster.start(lid)
        await converged(cluster)
        assert answers == ["forbidden", "auth", "auth", "auth"], answers

    run(main())


def test_forged_timeout_now_moves_no_leadership(cluster):
    """TimeoutNow claiming the leader's id, to each follower, five rounds."""

    async def main():
        async with app(cluster) as c:
            await put_many(c, "a", 10)
            lid, st = await leader(cluster)
            term = st[lid]["term"]
            answers = []
            for _ in range(5):
                for f in (i for i in cluster.ids if i != lid):
                    other = next(i for i in cluster.ids if i not in (lid, f))
                    answers += await refused_everywhere(
                        cluster, f, lambda f=f: [TimeoutNow(lid, f, term)], lid, other
                    )
            await asyncio.sleep(1.0)  # an election it had triggered would be over by now
            lid2, st = await leader(cluster)
            assert lid2 == lid and {s["term"] for s in st.values()} == {term}, st
            await put_many(c, "b", 10)
            await check_many(c, "a", 10)
        await converged(cluster)
        assert set(answers) == {"forbidden", "auth"}, answers

    run(main())


def test_ids_outside_the_membership_and_non_canonical_ids_are_refused(cluster):
    """Keys an operator (the secret) could make for ids that are not members, and ids that
    would parse as a member's: refused; the members' own claims are still welcome."""

    async def main():
        lid, st = await leader(cluster)
        f = next(i for i in cluster.ids if i != lid)
        answers = {}
        for cid in ("7", "0", f"0{lid}", f" {lid}", str(f), "-1", "x"):
            key = I.derive_key(SECRET, "replica", cid)
            answers[cid] = await forge(cluster.peers[f], "replica", cid, key)
        for role in ("node", "client"):
            key = I.derive_key(SECRET, role, str(lid))
            answers[role] = await forge(cluster.peers[f], role, str(lid), key)
        assert set(answers.values()) == {"forbidden"}, answers
        # Control: the leader's real key for its own id is welcome (then says nothing).
        key = I.derive_key(SECRET, "replica", str(lid))
        assert await forge(cluster.peers[f], "replica", str(lid), key) == "welcome"
        lid2, st2 = await leader(cluster)
        assert lid2 == lid and {s["term"] for s in st2.values()} == {st[lid]["term"]}

    run(main())


def test_a_client_credential_serves_the_client_port_but_never_the_raft_port(cluster):
    """What an application can do with its credential: everything on the client port;
    the honest handshake refuses to claim a replica (before connecting anywhere)."""

    async def main():
        async with app(cluster) as c:
            await c.put("k", b"v")
            assert await c.get("k") == b"v"
        r, w = await open_raw(cluster.peers[1])
        try:
            with pytest.raises(Exception, match="cannot speak as replica"):
                await H.aclient_handshake(
                    r, w, cluster.client_security, PEER_SERVICE, "2", role="replica"
                )
        finally:
            w.close()
        assert SecurityConfig(credential=I.issue(SECRET, "client")).key_for("replica", "2") is None

    run(main())
