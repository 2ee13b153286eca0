"""Who can act as a storage node (issue 16, section 2), against a LIVE master replica.

Mount, Unmount and Heartbeat decide where the store sends writers and readers and which
copies it drops, so only storage node X (its credential, ``kvmesh keys node X``) acts for
node X. An application holds the client credential: it can put and get, never mount a
segment (which would draw other clients' writes to an endpoint it controls), unmount a
node's segment or keep a dead node alive. A node's credential does not reach another node.
"""

from __future__ import annotations

import pytest

from kvmesh.net import AuthFailed, SecurityConfig
from kvmesh.net import identity as I
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.node import StorageNode
from kvmesh.store.rpc import MasterClient
from kvmesh.transfer import TransferEngine

SECRET = "store-identity-test-secret"


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    cl = StoreCluster(str(tmp_path_factory.mktemp("store-identity")), 1, token=SECRET,
                      durability="memory")  # fmt: skip
    cl.start_all()
    try:
        yield cl
    finally:
        cl.close()


def cred(role, ident=""):
    return SecurityConfig(credential=I.issue(SECRET, role, ident))


def test_node_and_client_credentials_serve_a_store_end_to_end(master):
    """The deployment the identity model is for: a storage node with its node credential,
    an application with the client credential, nobody but the master with the secret."""
    engine = TransferEngine(node_id="node-a", config=None)
    rpc = MasterClient([master.address], cred("node", "node-a"), node_id="node-a", timeout=10)
    node = StorageNode(rpc, 8 << 20, engine=engine).start()
    client = StoreClient(master.address, security=cred("client"), timeout=10)
    try:
        vals = [bytes([i + 1]) * 4096 for i in range(4)]
        keys = [f"id-{i}" for i in range(4)]
        assert client.put(keys, vals).codes == [0] * 4
        assert client.get(keys) == vals
        client.remove(keys)
    finally:
        client.close()
        node.close(grace_s=0.0)
        rpc.close()
        engine.close()


def _mutations(node_id: str):
    return [
        lambda rid, s: P.MountReq(rid, s, node_id, f"{node_id}-seg", "127.0.0.1:1", "h", 1 << 20),
        lambda rid, s: P.UnmountReq(rid, s, node_id, f"{node_id}-seg", 0.0),
    ]


def test_a_client_credential_cannot_act_as_a_storage_node(master):
    # Honest code refuses to claim a node with a client credential ...
    rpc = MasterClient([master.address], cred("client"), node_id="node-b", timeout=3)
    with pytest.raises((AuthFailed, E.StoreError), match="cannot speak as node|Auth|auth"):
        rpc.call(lambda rid: P.StatusReq(rid))
    rpc.close()
    # ... and as a client it is refused every request that acts for a node.
    rpc = MasterClient([master.address], cred("client"), timeout=5)
    try:
        for make in _mutations("node-b"):
            r = rpc.mutate(make)
            assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, r
            assert "only storage node" in r.message
        r = rpc.call(lambda rid: P.HeartbeatReq(rid, "node-b"))
        assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, r
        assert not rpc.status(master.addrs[1])["segments"]
    finally:
        rpc.close()


def test_a_node_credential_acts_only_for_its_own_node(master):
    rpc_a = MasterClient([master.address], cred("node", "node-c"), node_id="node-c", timeout=5)
    try:
        # Its own id: allowed.
        mount, unmount = _mutations("node-c")
        assert rpc_a.mutate(mount).codes == [0]
        # Another node's id, through node-c's connection: refused.
        for make in _mutations("node-d"):
            r = rpc_a.mutate(make)
            assert type(r) is P.ErrorResp and r.code == E.InvalidParams.code, r
        assert rpc_a.mutate(unmount).codes == [0]
    finally:
        rpc_a.close()
    # Claiming node-d with node-c's credential fails at the handshake.
    rpc = MasterClient([master.address], cred("node", "node-c"), node_id="node-d", timeout=3)
    with pytest.raises((AuthFailed, E.StoreError), match="cannot speak as node|Auth|auth"):
        rpc.call(lambda rid: P.StatusReq(rid))
    rpc.close()
    names = [s["name"] for s in MasterClient([master.address], cred("client")).status(
        master.addrs[1])["segments"]]  # fmt: skip
    assert "node-d-seg" not in names and "node-c-seg" not in names
