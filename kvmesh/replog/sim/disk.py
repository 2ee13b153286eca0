"""A simulated disk with a volatile (page cache) and a durable layer, after LazyFS.

Writes go to the volatile layer at once and are visible to the node (``live``). An fsync
makes every write issued before it durable once it completes. A crash keeps the durable
layer, plus optionally a random *prefix* of the volatile writes (a partial flush), and
drops the rest.
"""

from __future__ import annotations

import random

from ..memstorage import MemoryStorage
from ..types import Entry, HardState, LogUnavailable, Snapshot, StorageError

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


class SimDisk:
    """One node's disk. ``live`` is the storage the node's core reads."""

    def __init__(self, initial: MemoryStorage) -> None:
        self.durable = initial.copy()
        self.live = initial
        self.volatile: list[Op] = []
        self._base = 0  # writes issued before volatile[0] (made durable or lost)
        self.writes = 0
        self.fsyncs = 0

    # -- writes ----------------------------------------------------------------------------

    def append(self, entries: list[Entry]) -> None:
        self.live.append(entries)
        self.volatile.append(("append", entries))
        self.writes += 1

    def set_hard_state(self, hs: HardState) -> None:
        self.live.set_hard_state(hs)
        self.volatile.append(("hs", hs))

    def install_snapshot(self, snap: Snapshot) -> None:
        self.live.apply_snapshot(snap)
        self.volatile.append(("install", snap))

    def create_snapshot(self, index: int, conf_state, data: bytes) -> Snapshot:
        snap = self.live.create_snapshot(index, conf_state, data)
        self.volatile.append(("snap", snap))
        return snap

    def compact(self, index: int) -> None:
        self.live.compact(index)
        self.volatile.append(("compact", index))

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
