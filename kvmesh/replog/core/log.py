"""The core's view of the log: durable entries in the application's storage, followed by
"unstable" entries (and possibly a snapshot) that the core produced or received but the
driver has not yet reported persisted. Same split as etcd-raft's raftLog/unstable.

Indices tracked here:

* ``committed``: highest index known committed (may exceed ``persisted`` on a follower).
* ``persisted``: highest index durably stored locally *and still part of this log*; a
  truncation below it lowers it. A leader counts itself towards a quorum with it, and
  committed entries are only handed out up to it (so that what the application applies is
  always durable locally as well as on a quorum).
* ``applying`` / ``applied``: last index handed to the application in an outstanding
  Ready / acknowledged by ``advance``.
"""

from __future__ import annotations

from ..types import (
    ENTRY_OVERHEAD,
    Entry,
    LogCompacted,
    LogStorage,
    LogUnavailable,
    Snapshot,
    limit_size,
)

__all__ = ["RaftLog"]


class RaftLog:
    __slots__ = (
        "storage",
        "u_offset",
        "u_entries",
        "u_snapshot",
        "committed",
        "persisted",
        "applying",
        "applied",
    )

    def __init__(self, storage: LogStorage, applied: int | None = None) -> None:
        self.storage = storage
        first = storage.first_index()
        last = storage.last_index()
        self.u_offset = last + 1
        self.u_entries: list[Entry] = []
        self.u_snapshot: Snapshot | None = None
        self.committed = first - 1
        self.persisted = last
        self.applied = first - 1 if applied is None else applied
        self.applying = self.applied

    # -- index queries ----------------------------------------------------------------------

    def first_index(self) -> int:
        if self.u_snapshot is not None:
            return self.u_snapshot.meta.index + 1
        return self.storage.first_index()

    def last_index(self) -> int:
        # The durable log always ends right before the unstable part (the driver persists
        # exactly what a Ready hands out), so no storage call is needed.
        return self.u_offset + len(self.u_entries) - 1

    def last_term(self) -> int:
        return self.term(self.last_index())

    def term(self, i: int) -> int:
        """Term of entry ``i``; raises LogCompacted / LogUnavailable outside the log."""
        u_off = self.u_offset
        if i >= u_off:
            j = i - u_off
            if j < len(self.u_entries):
                return self.u_entries[j].term
            raise LogUnavailable(f"index {i} is beyond the last index {self.last_index()}")
        snap = self.u_snapshot
        if snap is not None:
            si = snap.meta.index
            if i == si:
                return snap.meta.term
            raise LogCompacted(f"index {i} is covered by the pending snapshot at {si}")
        if i == 0:
            return 0
        return self.storage.term(i)

    def zero_term(self, i: int) -> int:
        """Term of ``i``, or 0 when it is outside the log."""
        try:
            return self.term(i)
        except (LogCompacted, LogUnavailable):
            return 0

    def match_term(self, i: int, t: int) -> bool:
        try:
            return self.term(i) == t
        except (LogCompacted, LogUnavailable):
            return False

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Raft §5.4.1: is a candidate's log at least as up-to-date as ours?"""
        my_term = self.last_term()
        return last_term > my_term or (last_term == my_term and last_index >= self.last_index())

    # -- reading entries --------------------------------------------------------------------

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries ``[lo, hi)`` (at least one when ``lo < hi``) within ``max_bytes``."""
        if lo >= hi:
            return []
        if lo < self.first_index():
            raise LogCompacted(
                f"entries from {lo} are compacted (first index {self.first_index()})"
            )
        last = self.last_index()
        if hi > last + 1:
            raise LogUnavailable(f"entries up to {hi - 1} requested, last index is {last}")
        u_off = self.u_offset
        if lo >= u_off:
            return limit_size(self.u_entries[lo - u_off : hi - u_off], max_bytes)
        stored = self.storage.entries(lo, min(hi, u_off), max_bytes)
        if hi <= u_off or len(stored) < min(hi, u_off) - lo:
            return stored
        if max_bytes is None:
            return stored + self.u_entries[: hi - u_off]
        used = sum(len(e.data) for e in stored) + ENTRY_OVERHEAD * len(stored)
        budget = max_bytes - used
        out = list(stored)
        for e in self.u_entries[: hi - u_off]:
            budget -= len(e.data) + ENTRY_OVERHEAD
            if budget < 0:
                break
            out.append(e)
        return out

    def next_committed_entries(self, max_bytes: int) -> list[Entry]:
        """Committed entries not yet handed out, durable locally, within ``max_bytes``."""
        if self.u_snapshot is not None:
            return []
        hi = min(self.committed, self.persisted)
        lo = self.applying + 1
        if lo > hi:
            return []
        return self.entries(lo, hi + 1, max_bytes)

    def has_next_committed_entries(self) -> bool:
        return self.u_snapshot is None and self.applying < min(self.committed, self.persisted)

    # -- mutation ---------------------------------------------------------------------------

    def append(self, ents: list[Entry]) -> None:
        """Append (leader) or truncate-and-append (follower) contiguous entries."""
        after = ents[0].index
        if after <= self.committed:
            raise AssertionError(
                f"refusing to overwrite committed index {after} (committed {self.committed})"
            )
        u_off = self.u_offset
        n = len(self.u_entries)
        if after == u_off + n:
            self.u_entries.extend(ents)
        elif after <= u_off:
            # Replaces part of the durable log: the driver's append of these entries will
            # truncate storage from ``after``.
            self.u_offset = after
            self.u_entries = list(ents)
        else:
            del self.u_entries[after - u_off :]
            self.u_entries.extend(ents)
        if self.persisted >= after:
            self.persisted = after - 1

    def maybe_append(
        self, prev_index: int, prev_term: int, commit: int, ents: list[Entry]
    ) -> int | None:
        """Follower side of AppendEntries; returns the last index known to match the
        leader's, or None if ``(prev_index, prev_term)`` does not match."""
        if not self.match_term(prev_index, prev_term):
            return None
        lastnewi = prev_index + len(ents)
        if ents:
            ci = self._find_conflict(ents)
            if ci:
                if ci <= self.committed:
                    raise AssertionError(
                        f"entry {ci} conflicts with a committed entry (committed {self.committed})"
                    )
                self.append(ents[ci - ents[0].index :])
        self.commit_to(min(commit, lastnewi))
        return lastnewi

    def _find_conflict(self, ents: list[Entry]) -> int:
        """Index of the first entry not already in the log (new or conflicting), else 0."""
        first = ents[0]
        last_index = self.last_index()
        if first.index > last_index:
            return first.index
        tail = ents[-1]
        # Log matching: if the last entry matches, every earlier one does.
        if self.match_term(tail.index, tail.term):
            return 0
        for e in ents:
            if not self.match_term(e.index, e.term):
                return e.index
        return 0  # unreachable (the tail did not match)

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """Largest ``(i, term(i))`` with ``i <= index`` and ``term(i) <= term`` (fast
        backtracking); stops at the compaction boundary."""
        while index > 0:
            try:
                t = self.term(index)
            except LogCompacted:
                return index, 0
            except LogUnavailable:
                index = self.last_index()
                continue
            if t <= term:
                return index, t
            index -= 1
        return 0, 0

    def commit_to(self, c: int) -> None:
        if c > self.committed:
            last = self.last_index()
            if c > last:
                raise AssertionError(f"commit index {c} beyond last index {last}")
            self.committed = c

    def maybe_commit(self, index: int, term: int) -> bool:
        """Commit ``index`` if it is in ``term`` (Raft §5.4.2: only current-term entries are
        committed by counting replicas)."""
        if index > self.committed and self.zero_term(index) == term:
            self.committed = index
            return True
        return False

    def restore(self, snap: Snapshot) -> None:
        """Adopt a snapshot sent by the leader (the log it covers is discarded)."""
        idx = snap.meta.index
        self.u_snapshot = snap
        self.u_entries = []
        self.u_offset = idx + 1
        self.committed = idx
        if self.persisted > idx:
            self.persisted = idx

    # -- persistence feedback ----------------------------------------------------------------

    def stable_to(self, index: int, term: int) -> None:
        """Entries up to ``(index, term)`` are durable, unless they were replaced meanwhile."""
        j = index - self.u_offset
        if 0 <= j < len(self.u_entries) and self.u_entries[j].term == term:
            del self.u_entries[: j + 1]
            self.u_offset = index + 1
            if index > self.persisted:
                self.persisted = index

    def stable_snap_to(self, index: int) -> bool:
        snap = self.u_snapshot
        if snap is not None and snap.meta.index == index:
            self.u_snapshot = None
            self.persisted = index
            return True
        return False
