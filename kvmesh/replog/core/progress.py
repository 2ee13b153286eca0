"""The leader's per-peer replication state (etcd-raft's tracker.Progress) and quorum maths.

A peer is in one of three states:

* PROBE: the leader does not know where the logs match; at most one Append is in flight,
  further sends wait for its answer (or a heartbeat answer).
* REPLICATE: the logs match up to ``match``; Appends are pipelined optimistically, bounded
  by the inflight window (messages and bytes).
* SNAPSHOT: the peer needs entries the leader compacted; nothing is sent until the snapshot
  is acknowledged, reported, or times out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ..types import ProgressState, ProgressStatus

__all__ = [
    "Inflights",
    "Progress",
    "quorum_size",
    "committed_index",
    "vote_result",
    "VOTE_PENDING",
    "VOTE_WON",
    "VOTE_LOST",
]

PROBE = ProgressState.PROBE
REPLICATE = ProgressState.REPLICATE
SNAPSHOT = ProgressState.SNAPSHOT


class Inflights:
    """Sliding window of Appends sent but not acknowledged: (last index, bytes) each."""

    __slots__ = ("_q", "_bytes", "max_count", "max_bytes")

    def __init__(self, max_count: int, max_bytes: int = 0) -> None:
        self._q: deque[tuple[int, int]] = deque()
        self._bytes = 0
        self.max_count = max_count
        self.max_bytes = max_bytes

    def add(self, index: int, nbytes: int) -> None:
        self._q.append((index, nbytes))
        self._bytes += nbytes

    def free_le(self, index: int) -> None:
        q = self._q
        while q and q[0][0] <= index:
            self._bytes -= q.popleft()[1]

    def free_first_one(self) -> None:
        if self._q:
            self._bytes -= self._q.popleft()[1]

    def full(self) -> bool:
        return len(self._q) >= self.max_count or (
            self.max_bytes > 0 and self._bytes >= self.max_bytes
        )

    def reset(self) -> None:
        self._q.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._q)


class Progress:
    """Replication state of one peer, as seen by the leader."""

    __slots__ = (
        "match",
        "next",
        "state",
        "probe_sent",
        "pending_snapshot",
        "recent_active",
        "inflights",
        "is_learner",
        "state_ticks",
        "hb_match",
    )

    def __init__(
        self,
        next_index: int,
        max_inflight: int,
        max_inflight_bytes: int = 0,
        is_learner: bool = False,
    ) -> None:
        self.match = 0
        self.next = next_index
        self.state = PROBE
        self.probe_sent = False
        self.pending_snapshot = 0
        self.recent_active = True
        self.inflights = Inflights(max_inflight, max_inflight_bytes)
        self.is_learner = is_learner
        self.state_ticks = 0  # ticks spent in SNAPSHOT state (timeout)
        self.hb_match = -1  # match when the previous heartbeat answer arrived

    def _reset_state(self, state: ProgressState) -> None:
        self.probe_sent = False
        self.pending_snapshot = 0
        self.state = state
        self.inflights.reset()
        self.state_ticks = 0

    def become_probe(self) -> None:
        if self.state == SNAPSHOT:
            pending = self.pending_snapshot
            self._reset_state(PROBE)
            self.next = max(self.match + 1, pending + 1)
        else:
            self._reset_state(PROBE)
            self.next = self.match + 1

    def become_replicate(self) -> None:
        self._reset_state(REPLICATE)
        self.next = self.match + 1

    def become_snapshot(self, snapshot_index: int) -> None:
        self._reset_state(SNAPSHOT)
        self.pending_snapshot = snapshot_index

    def maybe_update(self, n: int) -> bool:
        """The peer acknowledged entries up to ``n``; returns whether ``match`` advanced."""
        updated = False
        if self.match < n:
            self.match = n
            updated = True
            self.probe_sent = False
        if self.next < n + 1:
            self.next = n + 1
        return updated

    def maybe_decr_to(self, rejected: int, match_hint: int) -> bool:
        """An Append with prev index ``rejected`` was refused; move ``next`` back. Returns
        False when the rejection is stale (answers an older message)."""
        if self.state == REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        if rejected <= self.match:
            # The peer refuses an entry it acknowledged: it lost durable state (a wiped node,
            # or durability="memory"). Forget its match instead of probing the same index
            # forever; commitment is unaffected (the commit index never decreases).
            self.match = max(0, min(match_hint, rejected - 1))
        self.next = max(min(rejected, match_hint + 1), self.match + 1)
        self.probe_sent = False
        return True

    def is_paused(self) -> bool:
        st = self.state
        if st == REPLICATE:
            return self.inflights.full()
        if st == PROBE:
            return self.probe_sent
        return True

    def sent_entries(self, last_index: int, n_entries: int, nbytes: int) -> None:
        """Bookkeeping after an Append carrying ``n_entries`` ending at ``last_index``."""
        if self.state == REPLICATE:
            if n_entries:
                self.next = last_index + 1
                self.inflights.add(last_index, nbytes)
        elif self.state == PROBE:
            self.probe_sent = True

    def status(self) -> ProgressStatus:
        return ProgressStatus(
            match=self.match,
            next=self.next,
            state=int(self.state),
            is_learner=self.is_learner,
            recent_active=self.recent_active,
            inflight=len(self.inflights),
            pending_snapshot=self.pending_snapshot,
        )

    def __repr__(self) -> str:
        return (
            f"Progress(match={self.match}, next={self.next}, "
            f"state={ProgressState(self.state).name}, "
            f"paused={self.is_paused()}, inflight={len(self.inflights)}, "
            f"pending_snapshot={self.pending_snapshot})"
        )


def quorum_size(n_voters: int) -> int:
    return n_voters // 2 + 1


def committed_index(matches: list[int]) -> int:
    """Highest index stored on a majority, given each voter's match index."""
    if not matches:
        return 0
    s = sorted(matches, reverse=True)
    return s[len(s) // 2]


VOTE_PENDING = 0
VOTE_WON = 1
VOTE_LOST = 2


def vote_result(voters: Iterable[int], votes: dict[int, bool]) -> int:
    """Outcome of an election among ``voters`` given the answers received so far."""
    voters = tuple(voters)
    q = quorum_size(len(voters))
    granted = rejected = 0
    for v in voters:
        r = votes.get(v)
        if r is True:
            granted += 1
        elif r is False:
            rejected += 1
    if granted >= q:
        return VOTE_WON
    if rejected > len(voters) - q:
        return VOTE_LOST
    return VOTE_PENDING
