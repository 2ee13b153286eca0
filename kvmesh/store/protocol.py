"""The client <-> master RPC of the store: messages only (no sockets, no clocks).

Every message is a msgspec Struct of one tagged union, msgpack-encoded and sent in the frames
of :mod:`kvmesh.net.framing` on a connection that first passed the shared-secret handshake of
:mod:`kvmesh.net.handshake` with service name :data:`SERVICE`. Requests carry a ``rid`` echoed
by their reply, so one connection pipelines requests.

Every request is batch-shaped (a list of keys) and is one RPC; a mutating request becomes at
most one log entry. Mutating requests carry a :class:`Session` (``client_id`` from
:class:`RegisterReq`, a per-client ``seq``, and ``ack`` = every seq below it was answered):
the master proposes them through the replicated log's exactly-once sessions, so a retry with
the same ``seq`` after a lost reply or a failover returns the first result instead of
applying twice.

Replies: the request's own reply type, :class:`Redirect` (this replica is not the leader;
``leader_addr`` is the leader's store address when known) or :class:`ErrorResp` (a whole-
request failure with a :mod:`kvmesh.store.errors` code). Per-key outcomes are ints in
``codes`` (0 or a negative error code), so one bad key never fails a batch.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import Code
from .types import DemoteTask, ObjectReplica, PromoteTask, ReplicaRun, ReplicateConfig

__all__ = [
    "MUTATING",
    "PROTOCOL_VERSION",
    "SERVICE",
    "AdoptListReq",
    "AdoptListResp",
    "AdoptReq",
    "CodesResp",
    "CountResp",
    "DemoteEndReq",
    "DemoteTasksResp",
    "PromoteEndReq",
    "ErrorResp",
    "ExistsPartsReq",
    "ExistsReq",
    "GetPartsReq",
    "GetReplicasReq",
    "GetSizeReq",
    "HeartbeatReq",
    "MountReq",
    "PutCommitReq",
    "PutCommitResp",
    "PutEndReq",
    "PutRevokeReq",
    "PutStartReq",
    "PutStartResp",
    "Redirect",
    "RegisterReq",
    "RegisterResp",
    "RemoveAllReq",
    "RemovePrefixReq",
    "ReportCorruptReq",
    "RemovePrefixResp",
    "RemoveReq",
    "ReplicaTableResp",
    "ReplicasResp",
    "Request",
    "Response",
    "Session",
    "SizesResp",
    "StatusReq",
    "StatusResp",
    "UnmountReq",
    "decode_request",
    "decode_response",
    "encode",
    "parts_names",
    "request_key_count",
    "request_keys",
    "undecodable",
]

SERVICE = "store"
PROTOCOL_VERSION = 1


class Session(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Exactly-once tag of a mutating request (see the replog's sessions)."""

    client_id: int
    seq: int
    ack: int = 0


# ------------------------------------------------------------------------------- requests


class RegisterReq(msgspec.Struct, tag="register", array_like=True, frozen=True):
    """Open an exactly-once session; reply :class:`RegisterResp`."""

    rid: int


class PutStartReq(msgspec.Struct, tag="put_start", array_like=True, frozen=True):
    """Allocate PROCESSING replicas for ``keys`` (``sizes[i]`` bytes each); ``upsert``
    replaces a COMPLETE object instead of answering ObjectExists. Reply :class:`PutStartResp`."""

    rid: int
    session: Session
    keys: list[str]
    sizes: list[int]
    config: ReplicateConfig
    upsert: bool = False


class PutEndReq(msgspec.Struct, tag="put_end", array_like=True, frozen=True):
    """Mark the writer's PROCESSING replicas of ``keys`` COMPLETE; ``versions``: those
    :class:`PutStartResp` returned (a reclaimed and re-put key then answers InvalidWrite
    instead of completing someone else's put). Reply :class:`CodesResp`."""

    rid: int
    session: Session
    keys: list[str]
    versions: list[int] = []


class PutRevokeReq(msgspec.Struct, tag="put_revoke", array_like=True, frozen=True):
    """Free the PROCESSING replicas of ``keys`` (a failed write); reply :class:`CodesResp`."""

    rid: int
    session: Session
    keys: list[str]
    versions: list[int] = []


class PutCommitReq(msgspec.Struct, tag="put_commit", array_like=True, frozen=True):
    """The one-round-trip put (docs/store-master.md, "Reservations"): publish ``keys``
    (``sizes[i]`` bytes each), already written at ``offsets[i]`` of segment ``sid`` inside
    the caller's reservation ``tag``; then free the rest of it (``release``) and/or add
    ``reserve`` bytes to it. ``tag`` 0 with no keys: just reserve. Reply
    :class:`PutCommitResp`."""

    rid: int
    session: Session
    keys: list[str]
    sizes: list[int]
    tag: int
    sid: int
    offsets: list[int]
    config: ReplicateConfig
    reserve: int = 0
    release: bool = False


class GetReplicasReq(msgspec.Struct, tag="get_replicas", array_like=True, frozen=True):
    """COMPLETE replicas of ``keys`` under a read lease; reply :class:`ReplicasResp`.
    Served by the leader after a read-index barrier, without a log entry. ``host``: the
    reader's host id (copies on that host come first). ``table``: answer with the compact
    :class:`ReplicaTableResp` instead (what :class:`~kvmesh.store.StoreClient` asks for)."""

    rid: int
    keys: list[str]
    host: str = ""
    table: bool = False


class GetPartsReq(msgspec.Struct, tag="get_parts", array_like=True, frozen=True):
    """:class:`GetReplicasReq` for the names ``prefix + key + suffix``, every key with every
    suffix, key-major (as :class:`ExistsPartsReq`): the master joins the names, checked by
    parts as for ExistsPartsReq, so a client reading HiCache pages never builds them. The
    reply is that of a GetReplicasReq of the joined names, in their order. A master that
    predates it refuses the request as undecodable (InvalidParams)."""

    rid: int
    prefix: str
    keys: list[str]
    suffixes: list[str]
    host: str = ""
    table: bool = False


class ExistsReq(msgspec.Struct, tag="exists", array_like=True, frozen=True):
    """Per key 1 (a COMPLETE object) or 0 in :class:`CodesResp` ``codes``; no lease."""

    rid: int
    keys: list[str]


class ExistsPartsReq(msgspec.Struct, tag="exists_parts", array_like=True, frozen=True):
    """:class:`ExistsReq` for the names ``prefix + key + suffix``, every key with every suffix
    (key-major: the codes of one key's suffixes are adjacent). Names that share their start
    and end (a HiCache page's K and V objects, of one model and rank) cost the bytes of
    their middles only, on the wire and in the client and master key checks.

    ``leading``: reply :class:`CountResp` instead, the number of leading keys whose every
    name is a COMPLETE object (HiCache's ``batch_exists``: one int, not a flag per name, and
    the master stops at the first missing name). A master that predates the field ignores
    it (a trailing array element) and answers :class:`CodesResp`; clients take both."""

    rid: int
    prefix: str
    keys: list[str]
    suffixes: list[str]
    leading: bool = False


class GetSizeReq(msgspec.Struct, tag="get_size", array_like=True, frozen=True):
    """Object sizes; reply :class:`SizesResp` (code ObjectNotFound for a missing key)."""

    rid: int
    keys: list[str]


class RemoveReq(msgspec.Struct, tag="remove", array_like=True, frozen=True):
    """Remove ``keys``; a leased key answers ObjectHasLease unless ``force``. :class:`CodesResp`."""

    rid: int
    session: Session
    keys: list[str]
    force: bool = False


class RemoveAllReq(msgspec.Struct, tag="remove_all", array_like=True, frozen=True):
    """Remove every COMPLETE object (leased ones too with ``force``); :class:`CountResp`."""

    rid: int
    session: Session
    force: bool = False


class RemovePrefixReq(msgspec.Struct, tag="remove_prefix", array_like=True, frozen=True):
    """One round of removing the COMPLETE objects whose key starts with ``prefix`` (leased
    ones skipped, or with ``force`` removed with their bytes held until the leases end).
    A round removes at most the master's ``prefix_round_keys`` keys; while the reply says
    ``more`` the client sends another. :class:`RemovePrefixResp`."""

    rid: int
    session: Session
    prefix: str
    force: bool = False


class MountReq(msgspec.Struct, tag="mount", array_like=True, frozen=True):
    """A storage node gives ``size`` bytes of segment ``segment`` (published on the transfer
    engine at ``endpoint``) to the pool. :class:`CodesResp` with one code."""

    rid: int
    session: Session
    node_id: str
    segment: str
    endpoint: str
    host_id: str
    size: int
    medium: str = "memory"  # "disk": a disk segment (docs/store.md, "Disk tier")
    disk_id: str = ""  # a disk segment's identity (docs/store.md, "Restart re-adoption")


class UnmountReq(msgspec.Struct, tag="unmount", array_like=True, frozen=True):
    """Take a segment out of the pool. ``grace`` 0: its replicas are dropped now; else no
    new allocations and its copies stay readable for ``grace`` seconds. :class:`CodesResp`."""

    rid: int
    session: Session
    node_id: str
    segment: str
    grace: float = 0.0


class HeartbeatReq(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True):
    """A storage node is alive (leader soft state, no log entry). :class:`CodesResp` with one
    code: 0, or NodeNotFound when the master no longer knows the node (it must re-mount)."""

    rid: int
    node_id: str
    # a node with a disk segment asks for up to this many demotions to do (the disk tier):
    # the reply is then a DemoteTasksResp
    work: int = 0


class DemoteEndReq(msgspec.Struct, tag="demote_end", array_like=True, frozen=True):
    """Storage node ``node_id`` wrote and fdatasync-ed the disk copies of ``keys`` (the
    tasks' versions) whose bytes have crc32c ``crcs``. :class:`CodesResp`; with ``work`` a
    :class:`DemoteTasksResp` (per-key codes) naming up to that many demotions the node is to
    do next, the batch this end let the leader start among them. ``failed`` (at
    ``failed_versions``): demotions the node could not write (ENOSPC, EIO): the master
    revokes them (their memory copies stay) and backs off from that disk."""

    rid: int
    session: Session
    node_id: str
    keys: list[str]
    versions: list[int]
    crcs: list[int]
    work: int = 0
    failed: list[str] = []
    failed_versions: list[int] = []


class PromoteEndReq(msgspec.Struct, tag="promote_end", array_like=True, frozen=True):
    """Storage node ``node_id`` filled and checked the memory copies of promotion tasks
    (``PromoteTask``: their reservation ``tag``, keys, versions, where). :class:`CodesResp`."""

    rid: int
    session: Session
    node_id: str
    tag: int
    keys: list[str]
    versions: list[int]
    segments: list[str]
    offsets: list[int]


class AdoptListReq(msgspec.Struct, tag="adopt_list", array_like=True, frozen=True):
    """Storage node ``node_id`` mounted its disk id again as ``segment``: which copies does
    the master still list there? :class:`AdoptListResp` (``SegmentNotFound``: nothing to
    adopt, the segment is online)."""

    rid: int
    node_id: str
    segment: str


class AdoptReq(msgspec.Struct, tag="adopt", array_like=True, frozen=True):
    """Storage node ``node_id`` checked the copies listed in its disk segment ``segment``
    (disk id ``disk_id``): ``keys`` at ``versions`` failed (their disk copies are dropped),
    the rest are adopted and the segment is online again. :class:`CodesResp`."""

    rid: int
    session: Session
    node_id: str
    segment: str
    disk_id: str
    keys: list[str]
    versions: list[int]


class ReportCorruptReq(msgspec.Struct, tag="report_corrupt", array_like=True, frozen=True):
    """A reader found that the bytes of ``keys[i]`` fail ``crcs[i]``, the crc32c recorded for
    its disk copy: the master drops that disk copy (if it still records that crc), the
    object with it when it was its last copy. :class:`CodesResp`."""

    rid: int
    session: Session
    keys: list[str]
    crcs: list[int]


class StatusReq(msgspec.Struct, tag="status", array_like=True, frozen=True):
    """This replica's view (no leader needed); reply :class:`StatusResp`."""

    rid: int


Request = (
    RegisterReq
    | PutStartReq
    | PutEndReq
    | PutRevokeReq
    | PutCommitReq
    | GetReplicasReq
    | GetPartsReq
    | ExistsReq
    | ExistsPartsReq
    | GetSizeReq
    | RemoveReq
    | RemoveAllReq
    | MountReq
    | UnmountReq
    | HeartbeatReq
    | StatusReq
    | RemovePrefixReq
    | DemoteEndReq
    | PromoteEndReq
    | ReportCorruptReq
    | AdoptListReq
    | AdoptReq
)

MUTATING = (
    PutStartReq,
    PutEndReq,
    PutRevokeReq,
    PutCommitReq,
    RemoveReq,
    RemoveAllReq,
    MountReq,
    UnmountReq,
    RemovePrefixReq,
    DemoteEndReq,
    PromoteEndReq,
    ReportCorruptReq,
    AdoptReq,
)
"""Requests that become a log entry (and so carry a :class:`Session`)."""

# -------------------------------------------------------------------------------- replies


class RegisterResp(msgspec.Struct, tag="registered", array_like=True, frozen=True):
    rid: int
    client_id: int


class PutStartResp(msgspec.Struct, tag="put_started", array_like=True, frozen=True):
    """Per key a code and, when 0, the replicas to write (each a list of slices).
    ``hold_ms``: how long the master keeps the PROCESSING allocation before it may reclaim
    it (its put timeout); a writer must finish writing well within it, counted from before
    it sent the request, or revoke."""

    rid: int
    codes: list[int]
    replicas: list[list[ObjectReplica] | None]  # empty when ``run`` holds them
    versions: list[int]
    hold_ms: int = 0
    # the copies of a put where every key got one copy of one slice, compactly (the usual
    # batch put); ``replicas`` is then empty: read both through :meth:`copies`
    run: ReplicaRun | None = None

    def copies(self) -> list[list[ObjectReplica] | None]:
        """Per key the copies to write (None for a key whose code is not 0)."""
        return self.replicas if self.run is None else self.run.expand()

    def fits(self, n: int) -> bool:
        """Whether this answers ``n`` keys (one code, version and copy list each)."""
        if not len(self.codes) == len(self.versions) == n:
            return False
        return len(self.replicas) == n if self.run is None else self.run.fits(n)


class PutCommitResp(msgspec.Struct, tag="put_committed", array_like=True, frozen=True):
    """Per key a code (0: the object is COMPLETE); ``tag``: the caller's reservation now (0:
    none); ``added``: the extent added to it (``[sid, offset, length]``, empty if none) in
    segment ``seg`` (``(name, node_id, endpoint)``). ``hold_ms``: how long the master keeps
    the reservation from now without another commit; a writer writes into it only well
    within that, counted from before it sent the request. ``limit`` and ``align``: the
    master's slice limit and allocation alignment (how a writer lays a batch out)."""

    rid: int
    codes: list[int]
    tag: int
    added: list[int]
    seg: tuple[str, str, str] | None = None
    hold_ms: int = 0
    limit: int = 0  # the largest object a commit takes (one slice)
    align: int = 64  # the rounding of every extent (each object's bytes start aligned)


class CodesResp(msgspec.Struct, tag="codes", array_like=True, frozen=True):
    rid: int
    codes: list[int]


class ReplicasResp(msgspec.Struct, tag="replicas", array_like=True, frozen=True):
    """Per key a code, the object size and its COMPLETE replicas. ``lease_ms``: how long the
    leases granted by this reply last, counted by the master from before it looked the keys
    up; a client counts it from before it sent the request, so its view expires first."""

    rid: int
    codes: list[int]
    sizes: list[int]
    replicas: list[list[ObjectReplica] | None]
    lease_ms: int


class ReplicaTableResp(msgspec.Struct, tag="replica_table", array_like=True, frozen=True):
    """:class:`ReplicasResp` as a table (``GetReplicasReq(table=True)``): per key a code and
    the object size; ``segments``: ``[segment, node_id, endpoint]`` of every segment the
    rows name; ``rows``: little-endian int64, :data:`~kvmesh.store.types.ROW` per slice of
    the found keys -- key index, copy index, segment index, offset, length -- grouped by key
    in key order, copies in preference order, slices in byte order. No Python object per
    replica on either side. ``lease_ms`` as in :class:`ReplicasResp`."""

    rid: int
    codes: list[int]
    sizes: list[int]
    segments: list[tuple[str, str, str]]
    rows: bytes
    lease_ms: int
    # per key the crc32c of its COMPLETE disk copy, -1 for none (empty: no key has one);
    # a reader checks the bytes it got against it (the disk tier)
    crcs: list[int] = []


class AdoptListResp(msgspec.Struct, tag="adopt_list", array_like=True, frozen=True):
    """The copies an offline disk segment still lists, per key its version, the offset and
    length of its one slice there and its crc32c (``codes``: one code)."""

    rid: int
    codes: list[int]
    keys: list[str] = []
    versions: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    crcs: list[int] = []


class DemoteTasksResp(msgspec.Struct, tag="demote_tasks", array_like=True, frozen=True):
    """The reply to a :class:`HeartbeatReq` (its code, as CodesResp's) or a
    :class:`DemoteEndReq` (per-key codes) with ``work``: the demotions the node is to do."""

    rid: int
    codes: list[int]
    tasks: list[DemoteTask] = []
    promote: list[PromoteTask] = []  # promotions on hit for the node to do (docs/store.md)
    # no tasks yet, but the master is proposing a demotion batch now (a heartbeat asked):
    # ask again shortly rather than a heartbeat period later
    soon: bool = False


class SizesResp(msgspec.Struct, tag="sizes", array_like=True, frozen=True):
    rid: int
    codes: list[int]
    sizes: list[int]


class CountResp(msgspec.Struct, tag="count", array_like=True, frozen=True):
    rid: int
    count: int


class RemovePrefixResp(msgspec.Struct, tag="removed_prefix", array_like=True, frozen=True):
    """``removed`` by this round; ``skipped``: matching keys left (leased, or a put in
    flight); ``more``: the round stopped at its limit, send another."""

    rid: int
    removed: int
    skipped: int
    more: bool


class StatusResp(msgspec.Struct, tag="status", array_like=True, frozen=True):
    rid: int
    info: dict[str, Any]


class Redirect(msgspec.Struct, tag="redirect", array_like=True, frozen=True):
    """Not the leader. ``leader_addr``: the leader's store address ("" when unknown)."""

    rid: int
    leader_id: int = 0
    leader_addr: str = ""


class ErrorResp(msgspec.Struct, tag="error", array_like=True, frozen=True):
    """The whole request failed: ``code`` from :mod:`kvmesh.store.errors`. ``retry``: the
    outcome is unknown or transient (timeout, leader change) and the same request (same
    session seq) may be sent again."""

    rid: int
    code: int
    message: str
    retry: bool = False


Response = (
    RegisterResp
    | PutStartResp
    | PutCommitResp
    | CodesResp
    | ReplicasResp
    | ReplicaTableResp
    | SizesResp
    | CountResp
    | StatusResp
    | Redirect
    | ErrorResp
    | RemovePrefixResp
    | DemoteTasksResp
    | AdoptListResp
)

_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_resp_dec = msgspec.msgpack.Decoder(Response)


def encode(msg: Any) -> bytes:
    return _enc.encode(msg)


def decode_request(body: bytes | memoryview) -> Request:
    """Decode one request (raises ``msgspec.DecodeError``/``ValidationError`` on junk)."""
    return _req_dec.decode(body)


def decode_response(body: bytes | memoryview) -> Response:
    return _resp_dec.decode(body)


class _Head(msgspec.Struct, array_like=True):
    """The start every request shares (its tag and rid); the rest of the array is ignored."""

    tag: str
    rid: int


_head_dec = msgspec.msgpack.Decoder(_Head)


def undecodable(body: bytes | memoryview, err: Exception) -> ErrorResp:
    """The answer to a request :func:`decode_request` refused: InvalidParams, not retryable,
    under the request's rid when its head can be read (else 0), so the sender stops at once
    instead of retrying a request that can never be decoded until its deadline."""
    try:
        rid = _head_dec.decode(body).rid
    except (msgspec.DecodeError, msgspec.ValidationError):
        rid = 0
    why = f"undecodable request: {str(err)[:300]}"
    return ErrorResp(rid, int(Code.INVALID_PARAMS), why, retry=False)


_PARTS = (ExistsPartsReq, GetPartsReq)  # requests that name objects by parts


def request_keys(req: Any) -> list[str]:
    """The keys a request names (empty for requests without keys)."""
    if type(req) in _PARTS:
        return parts_names(req.prefix, req.keys, req.suffixes)
    return getattr(req, "keys", None) or []


def request_key_count(req: Any) -> int:
    """``len(request_keys(req))`` without building an :class:`ExistsPartsReq`'s names."""
    if type(req) in _PARTS:
        return len(req.keys) * len(req.suffixes)
    return len(getattr(req, "keys", None) or [])


def parts_names(prefix: str, keys: list[str], suffixes: list[str]) -> list[str]:
    """The object names of an :class:`ExistsPartsReq` (or :class:`GetPartsReq`), in the
    order of its codes."""
    if len(suffixes) == 1:
        s = suffixes[0]
        return [f"{prefix}{k}{s}" for k in keys]
    return [f"{prefix}{k}{s}" for k in keys for s in suffixes]
