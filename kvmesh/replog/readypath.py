"""The one Ready/persist/apply path: the ordering every driver of
:class:`~kvmesh.replog.core.raft.RaftCore` must follow, written once and without I/O, and run by
both the asyncio driver (``node.py``) and the simulator (``sim/cluster.py``).

:meth:`ReadyPath.run` is a generator over one :class:`~kvmesh.replog.types.Ready`. It does
the pure steps itself and yields the I/O it needs as *effects*; the driver performs each
effect and resumes the generator (``gen.send(result)``):

1. a received snapshot is staged (:class:`Io`: ``DiskStorage`` writes and fsyncs its file,
   in a worker thread under asyncio);
2. ``storage.write(ready)`` writes snapshot marker, entries and hard state (page cache);
3. ``send_now`` goes out (it promises nothing about local durability);
4. :data:`SYNC_BEGIN`: the fsync for the whole batch starts, if ``write`` said one is needed
   (group commit); the driver resumes at once;
5. committed entries are applied in slices with :data:`YIELD` between them (other work runs
   in between) *while that fsync runs*: the core hands out only entries that are committed
   and were durable locally before this Ready (``min(committed, persisted)``), so none of
   them waits for this Ready's fsync. Waiting for it first cost every commit up to one more
   fsync on a busy leader (the entries proposed meanwhile were in the same Ready);
6. :data:`SYNC`: the driver resumes only once the fsync *completed* (messages keep being
   stepped meanwhile);
7. ``send_after_persist`` goes out (votes, append acks: they promise durability);
8. a snapshot to install is restored into the state machine (such a Ready carries no
   committed entries: the core hands none out while a snapshot is unstable);
9. ``before_advance`` (soft state, read states), ``core.advance``, ``after_advance``.

The path also keeps the *applied point*: the applied index and the configuration at that
index, updated slice by slice as entries are applied (the core learns membership changes
only in ``advance``). A snapshot taken at any yield records exactly these
(:meth:`ReadyPath.snapshot_point`).

Every write-side storage (``MemoryStorage``, ``DiskStorage``, the simulator's ``SimDisk``)
inherits :class:`~kvmesh.replog.storage.memory.ReadyWriter`: the same ``write(ready)``,
``stage_snapshot``, ``stage_local_snapshot``/``commit_local_snapshot`` and ``sync`` entry
points, so no driver branches on the storage type.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

from .core.raft import RaftCore, next_conf_state
from .storage.memory import ReadyWriter
from .types import ConfState, Entry, EntryKind, Ready, Snapshot, decode_conf_change

__all__ = [
    "APPLY_SLICE",
    "APPLY_SLICE_BYTES",
    "SYNC",
    "SYNC_BEGIN",
    "YIELD",
    "Io",
    "ReadyHost",
    "ReadyPath",
]

APPLY_SLICE = 1000
"""Committed entries applied between two :data:`YIELD` effects."""

APPLY_SLICE_BYTES = 1 << 20
"""...and at most about this many bytes of entry data (the node's bound; a slice ends after
the entry that reaches it). A store entry can name thousands of keys (a PutStart of 4,096
HiCache keys is ~450 KB and ~5 ms to apply): 1,000 of them in one slice held the loop for
6.3 s in a 10 M-object replay (issue 21), and a follower catching up stalls the same way."""

_CONF = int(EntryKind.CONF_CHANGE)


class _Effect:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


SYNC_BEGIN = _Effect("SYNC_BEGIN")
"""Start making everything written so far durable (one fsync); resume at once."""

SYNC = _Effect("SYNC")
"""Resume once everything written so far is durable: the fsync started by
:data:`SYNC_BEGIN` has completed (nothing is written to the log in between)."""

YIELD = _Effect("YIELD")
"""Let other work run (messages, requests, timers), then resume."""


class Io:
    """Blocking work (file writes, deletions) the driver may run off its loop; resume with
    its result."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn = fn
        self.args = args

    def __call__(self) -> Any:
        return self.fn(*self.args)


class ReadyHost(Protocol):
    """What a driver plugs into the path (its network and state machine)."""

    def send(self, msgs: list, after_persist: bool) -> None: ...

    def install(self, snap: Snapshot) -> None: ...

    def apply(self, entries: list[Entry]) -> None: ...

    def before_advance(self, rd: Ready) -> None: ...

    def after_advance(self, rd: Ready) -> None: ...


class ReadyPath:
    """One core's Ready processing (see the module docstring)."""

    def __init__(
        self,
        core: RaftCore,
        storage: ReadyWriter,
        host: ReadyHost,
        apply_slice: int = APPLY_SLICE,
        apply_bytes: int = 0,
    ) -> None:
        self.core = core
        self.storage = storage
        self.host = host
        self.apply_slice = apply_slice
        self.apply_bytes = apply_bytes  # 0: slices bounded by entries only
        self.applied = core.log.applied
        self.applied_conf: ConfState = core.conf_state

    def snapshot_point(self) -> tuple[int, ConfState]:
        """(applied index, configuration at it): what a snapshot taken now must record."""
        return self.applied, self.applied_conf

    def run(self, rd: Ready) -> Generator[Any, Any, None]:
        storage = self.storage
        host = self.host
        snap = rd.snapshot_to_install
        staged = None
        if snap is not None:
            # The snapshot's file is durable before the WAL marker that points at it.
            staged = yield Io(storage.stage_snapshot, snap)
        need_sync = storage.write(rd, staged)
        if rd.send_now:
            host.send(rd.send_now, False)
        if need_sync:
            yield SYNC_BEGIN
        ents = rd.committed_entries
        if ents and snap is None:
            # Durable locally and on a quorum already (see the module docstring, step 5).
            yield from self._apply(ents)
            ents = []
        if need_sync:
            yield SYNC
        if rd.send_after_persist:
            host.send(rd.send_after_persist, True)
        if snap is not None:
            host.install(snap)
            self.applied = snap.meta.index
            self.applied_conf = snap.meta.conf_state
        if ents:
            yield from self._apply(ents)
        host.before_advance(rd)
        self.core.advance(rd)
        host.after_advance(rd)
        if snap is not None:
            doomed = storage.obsolete_snapshot_files()
            if doomed:
                yield Io(storage.remove_snapshot_files, doomed)

    def _apply(self, ents: list[Entry]) -> Generator[Any, Any, None]:
        """Apply committed entries in slices (at most ``apply_slice`` entries and, where
        set, ``apply_bytes`` bytes of data), keeping the applied point."""
        host = self.host
        n, cap = self.apply_slice, self.apply_bytes
        lo, end = 0, len(ents)
        while lo < end:
            if lo:
                yield YIELD
            hi = min(end, lo + n)
            if cap:
                size = 0
                for j in range(lo, hi):
                    size += len(ents[j].data)
                    if size >= cap:
                        hi = j + 1
                        break
            part = ents[lo:hi]
            lo = hi
            host.apply(part)
            conf = self.applied_conf
            for e in part:
                if e.kind == _CONF:
                    conf = next_conf_state(conf, decode_conf_change(e.data))
            self.applied_conf = conf
            self.applied = part[-1].index
