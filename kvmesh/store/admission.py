"""What every request to the store master passes before any work: it is counted, well
formed (sizes, names, batch bounds: a conforming client validates before sending, so a bad
field comes from a broken or hostile peer and is refused whole), this replica leads, and a
session or storage-node id is used only by the authenticated peer that owns it.
"""

from __future__ import annotations

import logging
from typing import Any

from ..net.identity import speaks_for_node
from ..replog import (
    NodeStopped,
    NotLeaderError,
    RaftNode,
)
from . import errors as E
from . import protocol as P
from .types import (
    MAX_OBJECT_SIZE,
    MAX_REPLICAS,
    bad_key,
    bad_parts,
)

__all__ = ["Admission", "Busy", "MAX_NAME", "MAX_OWNERS", "checked_fields"]

log = logging.getLogger(__name__)


MAX_NAME = 256  # node ids, segment names, endpoints, host ids
MAX_OWNERS = 65536  # session -> peer bindings kept by a leader


class Busy(E.StoreUnavailable):
    """A bounded queue of this master is full: the request did nothing, retry it."""


class _Fields(frozenset):
    """The fields of a request type that :meth:`MasterService._check` looks at."""

    counted: tuple[str, ...]
    names: tuple[str, ...]


_FIELDS: dict[type, _Fields] = {}


def checked_fields(t: type) -> _Fields:
    """Which checked fields request type ``t`` has, worked out once per type (per request
    this was a dozen ``getattr`` probes, a fifth of a single-key lookup's checks)."""
    f = _FIELDS.get(t)
    if f is None:
        have = set(getattr(t, "__struct_fields__", ()))
        f = _Fields(have)
        f.counted = tuple(n for n in ("sizes", "versions", "offsets") if n in have)
        f.names = tuple(n for n in ("node_id", "segment", "endpoint", "host_id") if n in have)
        _FIELDS[t] = f
    return f


class Admission:
    """The admission checks (a part of :class:`~kvmesh.store.service.MasterService`)."""

    def _leader(self) -> RaftNode:
        node = self.node
        if node is None:
            raise NodeStopped("not started")
        if not node.is_leader:
            lid = node.leader_id
            raise NotLeaderError(lid, node.address_of(lid))
        return node

    def _check(self, req: Any) -> None:
        # Conforming clients validate before sending; a request with a bad field comes from
        # a broken or hostile peer and is refused whole, before any work.
        t = type(req)
        fields = checked_fields(t)
        parts = t is P.ExistsPartsReq or t is P.GetPartsReq
        if parts:
            # Checked by parts (types.bad_parts), never expanded before the count is known.
            # The suffixes count on their own too: with no keys the product is 0, yet
            # bad_parts would still check every suffix (Python work per part of the frame).
            n = max(P.request_key_count(req), len(req.suffixes))
            keys: list[Any] = []
        else:
            keys = req.keys if "keys" in fields else []
            n = len(keys)
        if n > self.cfg.max_batch_keys:
            raise E.InvalidParams(
                f"{n} keys in one request; the limit is {self.cfg.max_batch_keys}"
            )
        why = bad_parts(req.prefix, req.keys, req.suffixes) if parts else None
        if keys:
            why = bad_key(keys)
        if why is not None:
            raise E.InvalidKey(why)
        for name in fields.counted:  # sizes, versions: one per key
            vals = getattr(req, name)
            if vals and len(vals) != len(keys):
                raise E.InvalidParams(f"{len(vals)} {name} for {len(keys)} keys")
        sizes = req.sizes if "sizes" in fields else None
        if sizes is not None and (
            # list[int] as decoded (msgspec): C-level min/max instead of a test per key
            len(sizes) != len(keys)
            or (sizes and not 0 < min(sizes) <= max(sizes) <= MAX_OBJECT_SIZE)
        ):
            raise E.InvalidParams(f"sizes must be 1..{MAX_OBJECT_SIZE}, one per key")
        config = req.config if "config" in fields else None
        if config is not None and not 1 <= config.replica_num <= MAX_REPLICAS:
            raise E.InvalidParams(f"replica_num must be 1..{MAX_REPLICAS}")
        for name in fields.names:  # node_id, segment, endpoint, host_id
            v = getattr(req, name)
            if v is not None and not 0 < len(v) <= MAX_NAME:
                raise E.InvalidParams(f"{name} must be 1..{MAX_NAME} characters")
        if "host" in fields and len(req.host) > MAX_NAME:  # GetReplicas: "" means none
            raise E.InvalidParams(f"host must be at most {MAX_NAME} characters")

    def _admit(self, req: Any, peer: str) -> RaftNode:
        """Checks every request passes before any work: counted, well-formed, this replica
        leads, and a session is used only by the peer that owns it."""
        name = type(req).__name__
        self.counters[name] = self.counters.get(name, 0) + 1
        self._check(req)
        node = self._leader()
        fields = checked_fields(type(req))
        sess = req.session if "session" in fields else None
        if sess is not None:
            # A session belongs to the authenticated peer that used it first on this leader
            # (after a failover: first use again). Another peer naming it -- a confused or
            # buggy client -- could otherwise get someone else's cached results or move
            # their acknowledgement floor.
            owner = self._owners.get(sess.client_id)
            if owner is None:
                owner = self._owners[sess.client_id] = peer
                if len(self._owners) > MAX_OWNERS:
                    self._owners.popitem(last=False)
            if owner != peer:
                raise E.InvalidParams(f"session {sess.client_id} belongs to another client")
        node_id = req.node_id if "node_id" in fields else None
        if node_id is not None:
            # Mount, Unmount, Heartbeat: only storage node X (its credential) acts for node
            # X (and the sub-nodes X/... its process hosts), or a replica-role peer (an
            # operator: it holds the cluster secret, which derives node X's key anyway); a
            # client credential never can.
            role, _, who = peer.partition(":")
            if not (role == "replica" or (role == "node" and speaks_for_node(who, node_id))):
                raise E.InvalidParams(
                    f"only storage node {node_id[:MAX_NAME]!r} may {name[:-3].lower()} it "
                    f"(this connection is {peer[:MAX_NAME]!r})"
                )
            self._check_node_owner(node_id, peer)
        return node

    def _check_node_owner(self, node_id: str, peer: str) -> None:
        """A storage node id with mounted segments belongs to the authenticated peer that
        mounted them (on this leader; after a failover, to the first peer naming it, like a
        session). Node ids and segment names are in every replica descriptor, so without
        this any peer could unmount another node's segment (dropping its objects), keep a
        dead node alive with heartbeats, or mount under another node's id. A node id with no
        segment left (expired, unmounted) is free again: a restarted node may reuse it."""
        owners = self._node_owners
        if node_id not in self.sm.nodes():
            return  # nothing to protect; a successful Mount binds it
        owner = owners.get(node_id)
        if owner is None:
            owners[node_id] = peer
            while len(owners) > MAX_OWNERS:
                owners.popitem(last=False)
        elif owner != peer:
            raise E.InvalidParams(f"storage node {node_id[:MAX_NAME]!r} belongs to another peer")
