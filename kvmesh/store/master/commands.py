"""Log entries of the store master and their results (one tagged msgspec union each).

Every mutation of the master's metadata is one of these commands, proposed by the leader as
ONE log entry and applied by :class:`~kvmesh.store.master.state.StoreStateMachine` on every
replica. All are batch-shaped (a list of keys, one result code per key) so that a client's
batch is one RPC and at most one entry. Time and randomness enter only as values inside the
commands: ``now`` is the proposing leader's wall clock in seconds, and the "random" placement
strategy is seeded from the entry's log index.

Commands (effect per key unless noted) and their results:

* ``Mount``: add a segment of ``size`` bytes owned by ``node_id`` (``NoSpace`` past
  ``max_segments``), of ``medium`` memory or disk. ``Codes`` (one code).
* ``Unmount``: ``grace=0`` drops the segment and every copy in it now; ``grace>0`` stops
  allocating in it and keeps its copies readable until ``now+grace``, then a later
  ``Reclaim`` drops it. ``ExpireResult`` (one code, the keys lost).
* ``ExpireNodes``: drop every segment of each node and every copy in them. ``ExpireResult``.
* ``PutStart``: allocate PROCESSING copies (``ObjectExists`` if COMPLETE, ``ReplicaNotReady``
  if another put of the key is in flight, ``NoSpace`` if no room). ``PutStartResult``, or
  the same answer in the compact ``PutStartRun`` (one copy of one slice per key).
* ``PutEnd``: PROCESSING -> COMPLETE, only for the put named by ``versions``. ``Codes``.
* ``PutRevoke``: free a PROCESSING put (named by ``versions``). ``Codes``.
* ``PutCommit``: the one-round-trip put (docs/store-master.md, "Reservations"): publish
  as COMPLETE objects the keys a client wrote into its reservation (held bytes under the
  tag ``tag``: every extent must lie in it, unused, in a mounted segment, else
  ``InvalidWrite``), then free the rest (``release``) and/or add ``reserve`` bytes to it (a
  new reservation, tagged with this entry's index, when ``tag`` is 0, gone or released).
  ``PutCommitResult``.
* ``Upsert``: like PutStart, but a COMPLETE key is replaced (its allocation reused when size
  and copy count match). ``PutStartResult``.
* ``Remove``: free COMPLETE objects (``ReplicaNotReady`` for PROCESSING ones; ``hold`` keeps
  the bytes allocated until ``Release``). ``Codes``.
* ``RemoveAll``: remove every COMPLETE object except ``skip``. ``RemoveAllResult``.
* ``Reclaim``: free PROCESSING puts started before ``now - put_timeout``; finish graceful
  unmounts whose grace has passed. ``ReclaimResult``.
* ``Evict``: free the victims the leader chose, re-checking each. ``EvictResult``.
* ``Pin`` / ``Unpin``: set / clear soft (TTL) or hard pins. ``Codes``.
* ``Release``: free the bytes held under these tags (log indices). ``Codes`` (per tag).
* ``DemoteStart`` / ``DemoteEnd`` / ``DemoteRevoke`` / ``DropReplica``: the disk tier
  (``tiers.py``; their docstrings below).
* ``Adopt``: a restarted node's verdict on the copies of its offline disk segment
  (``segments.py``).
* ``RemovePrefix``: remove the listed COMPLETE keys that start with ``prefix`` (the leader
  found them with a bounded scan and applied the lease rules of ``Remove``).
  ``RemovePrefixResult``.

Leases are leader soft state (``leases.py``): the service refuses ``Remove``/``Upsert``/
``Evict`` of leased keys before proposing them (``ObjectHasLease``), or proposes a forced
``Remove`` with ``hold=True`` and a ``Release`` once the leases are over, so leased bytes are
never freed or reused.

Versions: the log index of a key's ``PutStart``/``Upsert`` is its ``version``. ``PutEnd`` and
``PutRevoke`` must name the versions they act on (one per key, else ``InvalidParams``), so a
late or foreign call never publishes or frees another writer's put; ``Evict`` may (an empty list
skips the check). A stale version gets ``InvalidWrite`` (``NotEvictable`` for Evict).
"""

from __future__ import annotations

import msgspec

from ..types import ObjectReplica, ReplicaRun, ReplicateConfig

__all__ = [
    "COMMAND_TYPES",
    "Adopt",
    "Codes",
    "Command",
    "DemoteEnd",
    "DemoteRevoke",
    "DemoteStart",
    "PromoteEnd",
    "PromoteResult",
    "PromoteStart",
    "DropReplica",
    "Evict",
    "EvictResult",
    "ExpireNodes",
    "ExpireResult",
    "Mount",
    "Pin",
    "PutCommit",
    "PutCommitResult",
    "PutEnd",
    "PutRevoke",
    "PutStart",
    "PutStartResult",
    "PutStartRun",
    "Reclaim",
    "ReclaimResult",
    "Release",
    "Remove",
    "RemoveAll",
    "RemoveAllResult",
    "RemovePrefix",
    "RemovePrefixResult",
    "Result",
    "Unmount",
    "Unpin",
    "Upsert",
    "decode_command",
    "decode_result",
    "encode_command",
    "encode_result",
]

_S = {"array_like": True, "frozen": True}


class Mount(msgspec.Struct, tag="mount", **_S):
    """Storage node ``node_id`` (on host ``host_id``, transfer engine at ``endpoint``)
    contributes segment ``segment`` of ``size`` bytes. Refused (``SegmentExists``) while a
    segment of that name is mounted or draining, and (``NoSpace``) when ``max_segments``
    (the leader's configured cap; 0: none) segments are already mounted or draining: the
    cap is judged here, in log order, so concurrent mounts can never overshoot it."""

    node_id: str
    segment: str
    endpoint: str
    host_id: str
    size: int
    now: float
    max_segments: int = 0
    # the tier of the segment (docs/store.md, "Disk tier"): an entry without it is memory
    medium: str = "memory"
    # a disk segment's identity (docs/store.md, "Restart re-adoption"): a mount naming the
    # id of a listed disk segment takes it over, offline until ``Adopt``; ``offline_ttl``:
    # how long it then waits for that Adopt
    disk_id: str = ""
    offline_ttl: float = 0.0


class Unmount(msgspec.Struct, tag="unmount", **_S):
    """Node ``node_id`` withdraws ``segment`` (``SegmentNotFound`` if it has no such one)."""

    node_id: str
    segment: str
    now: float
    grace: float = 0.0


class ExpireNodes(msgspec.Struct, tag="expire", **_S):
    """The leader saw no heartbeat from these nodes for the TTL: unmount all their segments
    at once and drop every copy in them (objects left without copies disappear)."""

    node_ids: list[str]
    now: float
    # > 0: a disk segment with a disk id goes offline for this long instead (its COMPLETE
    # copies kept, unreadable, for a restart to re-adopt); 0: dropped as the memory
    disk_offline_ttl: float = 0.0


class PutStart(msgspec.Struct, tag="put_start", **_S):
    """Allocate copies for ``keys[i]`` of ``sizes[i]`` bytes with ``config``."""

    keys: list[str]
    sizes: list[int]
    config: ReplicateConfig
    now: float
    pin_ttl: float = 1800.0  # soft pin lifetime when config.soft_pin


class PutEnd(msgspec.Struct, tag="put_end", **_S):
    """Publish the puts named by ``versions[i]`` (from PutStartResult; required, one per
    key: a missing or stale version gets ``InvalidParams`` / ``InvalidWrite``)."""

    keys: list[str]
    versions: list[int] = []


class PutRevoke(msgspec.Struct, tag="put_revoke", **_S):
    """Free the PROCESSING puts named by ``versions[i]`` (required, as for PutEnd)."""

    keys: list[str]
    versions: list[int] = []


class PutCommit(msgspec.Struct, tag="put_commit", **_S):
    """Publish ``keys[i]`` (``sizes[i]`` bytes, one slice) written at ``offsets[i]`` of
    segment ``sid`` inside reservation ``tag``; then ``release`` frees what is left of it
    and ``reserve`` (bytes, > 0) adds one extent placed with ``config``. Built by the
    leader, never by a client: the session check (the tag's owner) is the leader's."""

    keys: list[str]
    sizes: list[int]
    tag: int
    sid: int
    offsets: list[int]
    config: ReplicateConfig
    now: float
    reserve: int = 0
    release: bool = False
    pin_ttl: float = 1800.0


class Upsert(msgspec.Struct, tag="upsert", **_S):
    """Put that replaces a COMPLETE key (the service checked it is not leased)."""

    keys: list[str]
    sizes: list[int]
    config: ReplicateConfig
    now: float
    pin_ttl: float = 1800.0


class Remove(msgspec.Struct, tag="remove", **_S):
    """Remove COMPLETE objects; a PROCESSING key answers ``ReplicaNotReady`` (its writer may
    still be writing; PutRevoke or Reclaim free it). ``force`` records that the caller
    overrode read leases, which the leader implements with ``hold``: the bytes stay
    allocated (invisible to readers, not reusable) until a ``Release`` naming this entry's
    index. ``apply`` acts on ``hold`` only."""

    keys: list[str]
    force: bool = False
    hold: bool = False


class RemoveAll(msgspec.Struct, tag="remove_all", **_S):
    """Remove every COMPLETE object except ``skip`` (the keys the leader knows to be
    leased; with ``force`` the leader passes none and sets ``hold``)."""

    skip: list[str] = []
    force: bool = False
    hold: bool = False


class Reclaim(msgspec.Struct, tag="reclaim", **_S):
    """Periodic housekeeping proposed by the leader: free PROCESSING puts whose writer
    started them before ``now - put_timeout`` and finish due graceful unmounts. Writers
    must stop writing ``put_timeout`` after they sent PutStart (their own clock)."""

    now: float
    put_timeout: float


class Evict(msgspec.Struct, tag="evict", **_S):
    """Free the victims chosen by the leader's eviction policy. ``apply`` re-checks each:
    it must be COMPLETE, not hard-pinned, not soft-pinned unless ``allow_soft`` or the pin
    expired at ``now``, and (if given) still at ``versions[i]``; else ``NotEvictable``."""

    keys: list[str]
    versions: list[int] = []
    now: float = 0.0
    allow_soft: bool = False


class Pin(msgspec.Struct, tag="pin", **_S):
    """Pin COMPLETE or PROCESSING keys: ``hard`` forever, else soft until ``now + ttl``."""

    keys: list[str]
    hard: bool
    now: float
    ttl: float = 1800.0


class Unpin(msgspec.Struct, tag="unpin", **_S):
    keys: list[str]


class Release(msgspec.Struct, tag="release", **_S):
    """Free the bytes held by the ``hold`` removes applied at these log indices."""

    tags: list[int]


class RemovePrefix(msgspec.Struct, tag="remove_prefix", **_S):
    """One round of a remove by prefix. The leader scanned its table for COMPLETE keys
    starting with ``prefix`` (at most ``limit`` of the service per round, so apply's work
    is bounded by the entry's length, not by the table's size) and applied the lease rules
    of ``Remove``: ``keys`` are the ones to remove (held under this entry's index when
    ``hold``), ``skipped`` counts leased keys it left (without ``force``), ``more`` says the
    scan stopped at its limit (the client sends another round). ``apply`` re-checks each
    key (present, COMPLETE, starts with ``prefix``); one that is not is left alone."""

    prefix: str
    keys: list[str]
    skipped: int = 0
    more: bool = False
    force: bool = False
    hold: bool = False


class DemoteStart(msgspec.Struct, tag="demote_start", **_S):
    """The disk tier (``tiers.py``): give each COMPLETE memory object ``keys[i]`` at
    ``versions[i]`` a PROCESSING disk copy (preferably on the node of its memory copy), for
    that node to fill. Refused per key (``NotEvictable``) as ``Evict`` refuses, and when
    the object already has a disk copy; ``NoSpace`` when no disk segment has room.
    ``avoid``: ids of disk segments to place nothing on (their node reported failed
    demotions: the leader's per-disk backoff)."""

    keys: list[str]
    versions: list[int]
    now: float = 0.0
    allow_soft: bool = False
    avoid: list[int] = []


class DemoteEnd(msgspec.Struct, tag="demote_end", **_S):
    """Node ``node_id`` wrote (and fdatasync-ed) the disk copies of ``keys[i]`` at
    ``versions[i]``, whose bytes have crc32c ``crcs[i]``: they become COMPLETE. Only the
    node owning the disk copy may end it (``InvalidWrite`` else)."""

    node_id: str
    keys: list[str]
    versions: list[int]
    crcs: list[int]


class DemoteRevoke(msgspec.Struct, tag="demote_revoke", **_S):
    """Free the PROCESSING disk copies of ``keys[i]`` at ``versions[i]`` (the demotion
    timed out); the memory copies stay."""

    keys: list[str]
    versions: list[int]


class PromoteStart(msgspec.Struct, tag="promote_start", **_S):
    """Promotion on hit (``tiers.py``): reserve a memory copy for each disk-only COMPLETE
    single-slice object ``keys[i]`` at ``versions[i]``, on the memory segment of its disk
    copy's node, for that node to fill (``PromoteResult``). The extents are a reservation
    with this entry's index as tag, released by ``Release`` unless ``PromoteEnd`` takes
    them: the object itself is unchanged (served from disk) until then."""

    keys: list[str]
    versions: list[int]


class PromoteEnd(msgspec.Struct, tag="promote_end", **_S):
    """Node ``node_id`` filled the memory copies of ``keys[i]`` at ``versions[i]`` at
    ``offsets[i]`` of its memory segment ``segments[i]``, inside reservation ``tag`` (and
    checked them against the disk copy's crc): each becomes the object's memory copy, the
    disk copy kept (``Codes``)."""

    node_id: str
    tag: int
    keys: list[str]
    versions: list[int]
    segments: list[str]
    offsets: list[int]


class DropReplica(msgspec.Struct, tag="drop_replica", **_S):
    """Free one medium's copies of ``keys[i]`` at ``versions[i]``. ``memory``: only of
    objects whose disk copy is COMPLETE (else ``NotEvictable``: the memory copy is never
    freed before the disk copy is durable); ``disk``: the COMPLETE disk copy (a read found
    it corrupt, or disk eviction), the object going with it when it was its last copy.
    ``EvictResult``."""

    keys: list[str]
    versions: list[int]
    medium: str = "memory"


class Adopt(msgspec.Struct, tag="adopt", **_S):
    """Node ``node_id`` mounted offline disk segment ``segment`` (disk id ``disk_id``) again
    and checked the copies it lists: the disk copies of ``keys[i]`` at ``versions[i]``
    (bytes gone or differing) are dropped, with every copy it could not check (one not a
    single slice in the segment), and the segment is back online. ``Codes`` (one code)."""

    node_id: str
    segment: str
    disk_id: str
    keys: list[str]
    versions: list[int]


Command = (
    Mount
    | Unmount
    | ExpireNodes
    | PutStart
    | PutEnd
    | PutRevoke
    | PutCommit
    | Upsert
    | Remove
    | RemoveAll
    | Reclaim
    | Evict
    | Pin
    | Unpin
    | Release
    | RemovePrefix
    | DemoteStart
    | DemoteEnd
    | DemoteRevoke
    | DropReplica
    | Adopt
    | PromoteStart
    | PromoteEnd
)
COMMAND_TYPES: tuple[type, ...] = Command.__args__  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# Results


class Codes(msgspec.Struct, tag="codes", **_S):
    """One code per key (or per node / tag): 0 or a ``kvmesh.store.errors.Code``."""

    codes: list[int]


class PromoteResult(msgspec.Struct, tag="promote", **_S):
    """Per key ``codes[i]``; when 0 its memory copy is reserved at ``offsets[i]`` of segment
    id ``sids[i]``, in reservation ``tag`` (0: none reserved)."""

    codes: list[int]
    tag: int = 0
    sids: list[int] = []
    offsets: list[int] = []


class PutStartResult(msgspec.Struct, tag="put_start", **_S):
    """Per key: ``codes[i]``; when 0, ``replicas[i]`` are the copies to write and
    ``versions[i]`` the put's version (pass it to PutEnd/PutRevoke)."""

    codes: list[int]
    replicas: list[list[ObjectReplica] | None]
    versions: list[int]


class PutStartRun(msgspec.Struct, tag="put_start_run", **_S):
    """The result of a ``PutStart`` that placed one copy of one slice per key (the batch
    path, ``StoreStateMachine._put_start_batch``): the answer of :class:`PutStartResult`,
    compact (:class:`~kvmesh.store.types.ReplicaRun`). Every replica builds and caches (in
    its session table) the result of every entry. ``replicas``, ``versions`` and
    :meth:`expand` give the values of the equivalent ``PutStartResult``."""

    codes: list[int]
    version: int  # the entry's index: every key placed here has this version
    run: ReplicaRun

    @property
    def versions(self) -> list[int]:
        v, where = self.version, self.run.where
        if min(where, default=0) >= 0:  # every key placed (the usual batch): no pass per key
            return [v] * len(where)
        return [v if w >= 0 else 0 for w in where]

    @property
    def replicas(self) -> list[list[ObjectReplica] | None]:
        return self.run.expand()

    def expand(self) -> PutStartResult:
        return PutStartResult(list(self.codes), self.replicas, self.versions)


class PutCommitResult(msgspec.Struct, tag="put_commit", **_S):
    """``codes`` per key; ``tag``: the reservation now (0: none left); ``added``: the
    extent ``reserve`` added (``[sid, offset, length]``, empty if none fitted) and ``seg``
    its segment's ``(name, node_id, endpoint)``."""

    codes: list[int]
    tag: int
    added: list[int]
    seg: tuple[str, str, str] | None = None


class ExpireResult(msgspec.Struct, tag="expire", **_S):
    """``codes`` per node (``NodeNotFound`` if it had no segment; for ``Unmount`` one code
    for the segment); ``lost``: COMPLETE keys
    whose last copy was dropped (they no longer exist). PROCESSING puts that lost a copy's
    node are dropped too, silently: their PutEnd answers ``ObjectNotFound``."""

    codes: list[int]
    lost: list[str]


class RemoveAllResult(msgspec.Struct, tag="remove_all", **_S):
    removed: int


class ReclaimResult(msgspec.Struct, tag="reclaim", **_S):
    """Keys whose stale PROCESSING put was freed; segments whose graceful unmount finished;
    COMPLETE keys that lost their last copy with those segments."""

    keys: list[str]
    unmounted: list[str]
    lost: list[str] = []


class EvictResult(msgspec.Struct, tag="evict", **_S):
    codes: list[int]
    freed: int  # bytes returned to the allocator


class RemovePrefixResult(msgspec.Struct, tag="remove_prefix", **_S):
    """``removed``: keys removed by this round; ``skipped``: leased keys the leader left
    plus listed keys apply found PROCESSING (a put in flight); ``more``: as the command."""

    removed: int
    skipped: int
    more: bool


Result = (
    Codes
    | PutStartResult
    | PutStartRun
    | PutCommitResult
    | ExpireResult
    | RemoveAllResult
    | ReclaimResult
    | EvictResult
    | RemovePrefixResult
)

_enc = msgspec.msgpack.Encoder()
_cmd_dec = msgspec.msgpack.Decoder(Command)
_res_dec = msgspec.msgpack.Decoder(Result)


def encode_command(cmd: Command) -> bytes:
    return _enc.encode(cmd)


def decode_command(data: bytes) -> Command:
    """Decode one entry (``msgspec.ValidationError``/``DecodeError`` on bad bytes)."""
    return _cmd_dec.decode(data)


def encode_result(res: Result) -> bytes:
    return _enc.encode(res)


def decode_result(data: bytes) -> Result:
    return _res_dec.decode(data)
