"""A simulated disk with a volatile (page cache) and a durable layer, after LazyFS, that
follows ``DiskStorage``'s ordering rules.

It is a :class:`~kvmesh.replog.storage.memory.ReadyWriter`: the simulator persists Readies
through the same ``write(ready)`` / staging / ``sync`` entry points as the real driver.
Like ``DiskStorage``'s WAL, entries, hard states and installed-snapshot markers go to the
volatile layer and are visible to the node at once (``live``); an fsync makes every write
issued before it durable once it completes. Like ``DiskStorage``'s snapshot files, a
received snapshot is durable once staged (its file is fsynced before the WAL marker that
points at it), a local snapshot once committed, and compaction (segment deletion) only
ever drops entries a durable snapshot covers. A crash keeps the durable layer, plus
optionally a random *prefix* of the volatile writes (a partial flush: a WAL keeps a prefix
of its bytes), and drops the rest; recovery reconciles the log with the newest snapshot as
``DiskStorage.open`` does (a newer or disagreeing snapshot supersedes the log).
"""

from __future__ import annotations

import random
from typing import Any

from ..storage.memory import MemoryStorage, ReadyWriter
from ..types import (
    Entry,
    HardState,
    LogUnavailable,
    Snapshot,
    SnapshotMeta,
    StorageError,
)

__all__ = ["SimDisk"]

# Write records: ("append", [Entry]), ("hs", HardState), ("install", Snapshot),
# ("snap", Snapshot), ("compact", index)
Op = tuple


def _apply(st: MemoryStorage, op: Op) -> None:
    kind, arg = op
    if kind == "append":
        # Entries already covered by a snapshot are skipped by MemoryStorage.append. A gap
        # can only come from a partial flush that lost earlier writes: then drop the rest
        # (this mirrors a WAL whose tail after a lost record is unreadable).
        if arg and arg[0].index > st.last_index() + 1:
            raise StorageError("gap")
        st.append(arg)
    elif kind == "hs":
        st.set_hard_state(arg)
    elif kind == "install":
        st.apply_snapshot(arg)
    elif kind == "snap":
        snap: Snapshot = arg
        m = snap.meta
        if m.index <= st.snapshot().meta.index:
            return
        try:
            ok = st.term(m.index) == m.term
        except StorageError:
            ok = False
        if ok:
            st.create_snapshot(m.index, m.conf_state, snap.data)
        else:
            st.apply_snapshot(snap)
    elif kind == "compact":
        try:
            st.compact(min(arg, st.snapshot().meta.index))
        except LogUnavailable:
            pass
    else:  # pragma: no cover - programming error
        raise ValueError(f"unknown disk op {kind!r}")


class SimDisk(ReadyWriter):
    """One node's disk. ``live`` is the storage the node's core reads. ``volatile_only``
    models ``durability="memory"``: nothing is ever durable (no fsync, no snapshot files)."""

    def __init__(self, initial: MemoryStorage, volatile_only: bool = False) -> None:
        self.durable = initial.copy()
        self.live = initial
        self.volatile: list[Op] = []
        self._base = 0  # writes issued before volatile[0] (made durable or lost)
        self.writes = 0
        self.fsyncs = 0
        self.volatile_only = volatile_only
        self.needs_fsync = not volatile_only

    @property
    def hard_state(self) -> HardState:
        return self.live.hard_state

    # -- writes (the ReadyWriter side) -------------------------------------------------------

    def append(self, entries: list[Entry]) -> None:
        self.live.append(entries)
        self.volatile.append(("append", entries))
        self.writes += 1

    def set_hard_state(self, hs: HardState) -> None:
        self.live.set_hard_state(hs)
        self.volatile.append(("hs", hs))

    def stage_snapshot(self, snap: Snapshot) -> Any:
        # DiskStorage writes and fsyncs the snapshot file before the WAL marker: from here
        # on a restart finds it (and lets it supersede the log if it is newer).
        if not self.volatile_only:
            _apply(self.durable, ("snap", snap))
        return None

    def apply_snapshot(self, snap: Snapshot, staged: Any = None) -> None:
        self.live.apply_snapshot(snap)
        self.volatile.append(("install", snap))  # the WAL marker

    def commit_local_snapshot(self, meta: SnapshotMeta, staged: Any) -> bool:
        if meta.index <= self.live.snapshot().meta.index:
            return False
        snap = self.live.create_snapshot(meta.index, meta.conf_state, staged)
        if not self.volatile_only:
            _apply(self.durable, ("snap", snap))  # the file is durable before it is current
        return True

    def create_snapshot(self, index: int, conf_state, data: bytes) -> Snapshot:
        meta = SnapshotMeta(index, self.live.term(index), conf_state)
        self.commit_local_snapshot(meta, data)
        return self.live.snapshot()

    def compact(self, index: int) -> None:
        self.live.compact(index)
        if not self.volatile_only:
            # Whole WAL segments are deleted, and only below a durable snapshot.
            _apply(self.durable, ("compact", index))

    # -- durability --------------------------------------------------------------------------

    def fsync_mark(self) -> int:
        """Position (in the sequence of all writes) an fsync issued now covers."""
        return self._base + len(self.volatile)

    def fsync_complete(self, mark: int) -> None:
        """The fsync issued at ``mark`` completed: writes before it are durable."""
        n = mark - self._base
        if n <= 0:
            return
        ops, self.volatile = self.volatile[:n], self.volatile[n:]
        self._base += n
        for op in ops:
            _apply(self.durable, op)
        self.fsyncs += 1

    def crash(self, rng: random.Random | None = None, keep_prefix: bool = False) -> MemoryStorage:
        """Lose unsynced writes (all of them, or all but a random prefix); returns the
        storage the node restarts from."""
        st = self.durable
        if keep_prefix and rng is not None and self.volatile:
            n = rng.randrange(len(self.volatile) + 1)
            for op in self.volatile[:n]:
                try:
                    _apply(st, op)
                except StorageError:
                    break
        self._base += len(self.volatile)
        self.volatile = []
        self.durable = st
        self.live = st.copy()
        return self.live
