"""In-memory :class:`~kvmesh.replog.types.LogStorage` (tests, the simulator, and
``durability="memory"`` development clusters). Mirrors etcd-raft's MemoryStorage: the log is
a list whose first element is a sentinel standing for the last entry covered by the
snapshot."""

from __future__ import annotations

from typing import Any

from ..types import (
    ConfState,
    Entry,
    HardState,
    LogCompacted,
    LogUnavailable,
    Ready,
    Snapshot,
    SnapshotMeta,
    StorageError,
    bootstrap_entries,
    limit_size,
)

__all__ = ["EntryLog", "MemoryStorage", "ReadyWriter"]


class EntryLog:
    """The in-memory log both storages keep: a list whose first element is a sentinel
    standing for the last entry covered by the snapshot (etcd-raft's MemoryStorage layout).

    Gives the read side of :class:`~kvmesh.replog.types.LogStorage` (``first_index``,
    ``last_index``, ``term``, ``entries``) and the in-memory half of ``append``/``compact``;
    :class:`MemoryStorage` and :class:`~kvmesh.replog.storage.disk.DiskStorage` add durability
    (or not) around it.
    """

    def __init__(self) -> None:
        self._ents: list[Entry] = [Entry(term=0, index=0)]

    def _reset_log(self, index: int, term: int) -> None:
        """Drop every entry: the log now starts right after (index, term)."""
        self._ents = [Entry(term=term, index=index)]

    def first_index(self) -> int:
        return self._ents[0].index + 1

    def last_index(self) -> int:
        return self._ents[0].index + len(self._ents) - 1

    def term(self, index: int) -> int:
        off = self._ents[0].index
        if index < off:
            raise LogCompacted(f"index {index} is compacted (first index {off + 1})")
        if index - off >= len(self._ents):
            raise LogUnavailable(f"index {index} is beyond the last index {self.last_index()}")
        return self._ents[index - off].term

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        off = self._ents[0].index
        if lo <= off:
            raise LogCompacted(f"entries from {lo} are compacted (first index {off + 1})")
        if hi > self.last_index() + 1:
            raise LogUnavailable(
                f"entries up to {hi - 1} requested, last index is {self.last_index()}"
            )
        if lo >= hi:
            return []
        return limit_size(self._ents[lo - off : hi - off], max_bytes)

    def all_entries(self) -> list[Entry]:
        """Entries from ``first_index()`` to ``last_index()``."""
        return self._ents[1:]

    def _new_suffix(self, entries: list[Entry]) -> list[Entry]:
        """The part of ``entries`` (contiguous) that an append must store: entries already
        covered by the snapshot/compaction are dropped; a gap after the log is an error."""
        if not entries:
            return entries
        off = self._ents[0].index
        first = entries[0].index
        last = self.last_index()
        if first > last + 1:
            raise StorageError(
                f"append would leave a gap: last index {last}, first new index {first}"
            )
        if entries[-1].index <= off:
            return []
        if first <= off:
            entries = entries[off + 1 - first :]
        return entries

    def _splice(self, entries: list[Entry]) -> None:
        """Put ``entries`` (a :meth:`_new_suffix` result) in place: an entry at index i
        replaces the log from i on."""
        if entries:
            del self._ents[entries[0].index - self._ents[0].index :]
            self._ents.extend(entries)

    def _compact_log(self, index: int) -> bool:
        """Drop entries up to and including ``index`` from memory; False if already done."""
        off = self._ents[0].index
        if index <= off:
            return False
        if index > self.last_index():
            raise LogUnavailable(f"cannot compact to {index}: last index is {self.last_index()}")
        keep = self._ents[index - off :]
        keep[0] = Entry(term=keep[0].term, index=keep[0].index)
        self._ents = keep
        return True


class ReadyWriter:
    """The write side every storage shares. Subclasses provide ``apply_snapshot(snap,
    staged)``, ``append``, ``set_hard_state`` and ``hard_state``; durable ones set
    ``needs_fsync`` and override :meth:`sync` and the staging hooks."""

    needs_fsync = True

    def write(self, rd: Ready, staged: Any = None) -> bool:
        """Write a Ready's snapshot (``staged``: what :meth:`stage_snapshot` returned for it),
        entries and hard state, in that order, without syncing; returns whether an fsync is
        needed before the Ready's ``send_after_persist`` may go out."""
        snap = rd.snapshot_to_install
        if snap is not None:
            self.apply_snapshot(snap, staged)  # type: ignore[attr-defined]
        if rd.entries_to_append:
            self.append(rd.entries_to_append)  # type: ignore[attr-defined]
        hs: HardState | None = rd.hard_state
        if hs is not None and hs != self.hard_state:  # type: ignore[attr-defined]
            self.set_hard_state(hs)  # type: ignore[attr-defined]
        return self.needs_fsync and (rd.must_sync or bool(rd.entries_to_append) or snap is not None)

    def stage_snapshot(self, snap: Snapshot) -> Any:
        """Blocking preparation of a received snapshot before :meth:`write` (thread-safe)."""
        return None

    def stage_local_snapshot(self, meta: SnapshotMeta, parts: list[bytes]) -> Any:
        """Blocking preparation of a local snapshot (thread-safe); default: the joined image."""
        return b"".join(parts)

    def commit_local_snapshot(self, meta: SnapshotMeta, staged: Any) -> bool:
        """Make a staged local snapshot current; False if a newer one is there already."""
        raise NotImplementedError

    def obsolete_snapshot_files(self) -> list[str]:
        return []

    def remove_snapshot_files(self, paths: list[str]) -> None:
        """Blocking: delete what :meth:`obsolete_snapshot_files` listed."""

    def sync(self) -> None:
        """Blocking: one fsync covering every write so far."""

    def close(self) -> None:
        """Release the storage (durable ones sync first)."""


class MemoryStorage(EntryLog, ReadyWriter):
    """A log, hard state and snapshot held in memory.

    Read side: the :class:`LogStorage` protocol. Write side, used by drivers after handling a
    Ready: :meth:`~ReadyWriter.write` (or :meth:`set_hard_state`, :meth:`append`,
    :meth:`apply_snapshot`); and by the application: :meth:`create_snapshot`,
    :meth:`compact`. Nothing is ever synced (``needs_fsync`` is False).
    """

    needs_fsync = False

    def __init__(
        self, hard_state: HardState | None = None, snapshot: Snapshot | None = None
    ) -> None:
        self._hs = hard_state or HardState()
        self._snap = snapshot or Snapshot()
        self._reset_log(self._snap.meta.index, self._snap.meta.term)

    @classmethod
    def bootstrap(
        cls, voters: list[int] | tuple[int, ...], learners: list[int] | tuple[int, ...] = ()
    ) -> MemoryStorage:
        """A storage holding the founding log prefix of a new cluster."""
        ents, hs = bootstrap_entries(voters, learners)
        s = cls()
        s.append(ents)
        s.set_hard_state(hs)
        return s

    # -- read API -------------------------------------------------------------------------

    def initial_state(self) -> tuple[HardState, ConfState]:
        return self._hs, self._snap.meta.conf_state

    @property
    def hard_state(self) -> HardState:
        return self._hs

    def snapshot(self) -> Snapshot:
        return self._snap

    # -- write API ------------------------------------------------------------------------

    def set_hard_state(self, hs: HardState) -> None:
        self._hs = hs

    def append(self, entries: list[Entry]) -> None:
        """Append ``entries`` (contiguous); an entry at index i replaces the log from i on.
        Entries already covered by the snapshot are skipped."""
        self._splice(self._new_suffix(entries))

    def apply_snapshot(self, snap: Snapshot, staged: Any = None) -> None:
        """Replace the whole log by ``snap`` (a snapshot the leader sent)."""
        if snap.meta.index < self._snap.meta.index:
            raise StorageError(
                f"snapshot at {snap.meta.index} "
                f"is older than the stored one at {self._snap.meta.index}"
            )
        self._snap = snap
        self._reset_log(snap.meta.index, snap.meta.term)

    def create_snapshot(self, index: int, conf_state: ConfState, data: bytes) -> Snapshot:
        """Record a snapshot of the state machine taken at ``index`` (already applied)."""
        if index <= self._snap.meta.index:
            raise StorageError(
                f"snapshot at {index} is not newer than the stored one at {self._snap.meta.index}"
            )
        if index > self.last_index():
            raise LogUnavailable(
                f"snapshot index {index} is beyond the last index {self.last_index()}"
            )
        snap = Snapshot(
            SnapshotMeta(index=index, term=self.term(index), conf_state=conf_state), data
        )
        self._snap = snap
        return snap

    def commit_local_snapshot(self, meta: SnapshotMeta, staged: Any) -> bool:
        if meta.index <= self._snap.meta.index:
            return False
        self._snap = Snapshot(meta, staged)
        return True

    def compact(self, index: int) -> None:
        """Discard entries up to and including ``index`` (the caller must have a snapshot at
        or above it, or accept that lagging followers then need one)."""
        self._compact_log(index)

    # -- helpers for simulators ----------------------------------------------------------

    def copy(self) -> MemoryStorage:
        """An independent copy (entries are immutable, so the list copy is enough)."""
        s = MemoryStorage.__new__(MemoryStorage)
        s._hs = self._hs
        s._snap = self._snap
        s._ents = list(self._ents)
        return s
