"""The store master's replicated state machine (kvmesh.replog ``StateMachine``).

:class:`StoreStateMachine` holds the object table (:class:`~.table.Table`, one row per
object), the mounted segments with one :class:`~.allocator.SegmentAllocator` each, and the
bytes held for leases by forced removes. ``apply`` executes one :mod:`.commands` entry; it
is deterministic (no clock, no global randomness: ``now`` and the log index come from the
entry), so every replica computes the same offsets. Read-only queries (:meth:`lookup`,
:meth:`exists`, :meth:`get_size`, :meth:`segments`, :meth:`usage`) serve the service
without a log entry; the service must have confirmed leadership (read index or lease) first.

This module is the composition point: the state itself (``__init__``) and ``apply``, which
dispatches each command to its handler. The handlers and queries live by job in:

* :mod:`.segments` -- :class:`~.segments.Segment`, mount / unmount / node expiry, dropping a
  segment, the slice bookkeeping of copies, the segment queries;
* :mod:`.placement` -- the segment of each slice (``_pick``, ``_place``, the batched
  PutStart);
* :mod:`.writes` -- the put protocol's handlers and the pins;
* :mod:`.removes` -- remove, remove all / by prefix, reclaim, evict, release;
* :mod:`.tiers` -- the disk tier: demotions, dropping one medium's copies;
* :mod:`.queries` -- the read-only queries (``lookup_table``: the read hot path);
* :mod:`.snapshot` -- the snapshot codec (header, segment records, row chunks; formats 1-3);
* :mod:`.config` -- :class:`MasterConfig`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import Code
from ..types import MAX_BATCH_KEYS
from .commands import (
    Adopt,
    Codes,
    Command,
    DemoteEnd,
    DemoteRevoke,
    DemoteStart,
    DropReplica,
    Evict,
    ExpireNodes,
    Mount,
    Pin,
    PromoteEnd,
    PromoteStart,
    PutCommit,
    PutEnd,
    PutRevoke,
    PutStart,
    Reclaim,
    Release,
    Remove,
    RemoveAll,
    RemovePrefix,
    Result,
    Unmount,
    Unpin,
    Upsert,
    decode_command,
)
from .config import MasterConfig
from .placement import Placement
from .queries import Queries
from .removes import Removes
from .segments import Segment, Segments
from .snapshot import CHUNK_ITEMS, SNAPSHOT_FORMAT, Snapshots
from .table import Table
from .tiers import Tiers
from .writes import Writes

__all__ = ["CHUNK_ITEMS", "SNAPSHOT_FORMAT", "MasterConfig", "StoreStateMachine"]


_HANDLERS: dict[type, str] = {
    Mount: "_mount",
    Unmount: "_unmount",
    ExpireNodes: "_expire",
    PutStart: "_put_start",
    Upsert: "_upsert",
    PutEnd: "_put_end",
    PutRevoke: "_put_revoke",
    PutCommit: "_put_commit",
    Remove: "_remove",
    RemoveAll: "_remove_all",
    Reclaim: "_reclaim",
    Evict: "_evict",
    Pin: "_pin",
    Unpin: "_unpin",
    Release: "_release",
    RemovePrefix: "_remove_prefix",
    DemoteStart: "_demote_start",
    DemoteEnd: "_demote_end",
    DemoteRevoke: "_demote_revoke",
    DropReplica: "_drop_replica",
    Adopt: "_adopt",
    PromoteStart: "_promote_start",
    PromoteEnd: "_promote_end",
}
"""Command type -> handler method name (looked up per call, so a test can patch a handler
on the class, as the simulator's negative controls do)."""


class StoreStateMachine(Tiers, Writes, Removes, Placement, Segments, Queries, Snapshots):
    """Deterministic store metadata; see the module docstring. ``apply`` never raises for a
    well-formed entry: bad input gets per-key codes."""

    result_type: Any = Result

    def __init__(self, config: MasterConfig | None = None) -> None:
        self.config = config or MasterConfig()
        self.segs: dict[int, Segment] = {}  # by id, in mount order
        self.by_name: dict[str, int] = {}
        # PROCESSING key -> its version, oldest put first. THE state of an object: a key of
        # the table is PROCESSING iff it is here, else COMPLETE (PutEnd only pops it here and
        # never rewrites the record: one lookup in this small dict instead of a lookup and a
        # rewrite in the big table). ``Obj.state`` is the state a record was written with.
        self.processing: dict[str, int] = {}
        self.objects = Table(self.processing)  # key -> record view; see table.py
        self.held: dict[int, list[tuple[int, int, int]]] = {}  # tag -> (seg id, offset, length)
        # a writer's reservation (tag: the entry that made it) -> its unused extents (seg id,
        # offset, length: aligned, sorted, coalesced); writes.py, docs/store-master.md
        self.reserved: dict[int, list[tuple[int, int, int]]] = {}
        self.retired: dict[str, float] = {}  # dropped segment name -> entry time of the drop
        self.next_seg = 1
        self.applied = 0
        self.complete = 0
        # keys named by the entries this replica applied since it started (not replicated
        # state: the driver uses it to snapshot by work done, as one entry may hold thousands)
        self.applied_keys = 0

    # ================================================================== replog protocol

    def apply(self, index: int, data: bytes) -> Result:
        """Apply one encoded command (log entry ``index``) and return its result."""
        self.applied = index
        try:
            cmd = decode_command(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Codes([int(Code.INVALID_PARAMS)])
        return self.apply_command(index, cmd)

    def apply_command(self, index: int, cmd: Command) -> Result:
        """:meth:`apply` of the command its bytes decode to (the proposing leader's own
        object, :meth:`~kvmesh.store.envelope.EchoMachine.expect`)."""
        self.applied = index
        self.applied_keys += len(getattr(cmd, "keys", ()))
        return getattr(self, _HANDLERS[type(cmd)])(index, cmd)

    @staticmethod
    def _batch_ok(keys: list[str], *others: list[Any]) -> bool:
        n = len(keys)
        return n <= MAX_BATCH_KEYS and all(len(x) == n for x in others)
