"""Leader-side bookkeeping for linearizable reads without log entries (thesis §6.4).

Every heartbeat the leader broadcasts opens a numbered *round*; followers echo the number.
A round is confirmed once a quorum of voters (the leader included) has echoed it or a later
round: at that moment the leader provably still led when the round was sent, so every read
attached to it may be served at the commit index recorded when it was attached.

* ReadIndex (``SAFE``): read requests queue in ``unsent`` and ride on the next round (one
  round serves any number of reads). Requests that arrive before the leader has committed an
  entry of its own term wait in ``awaiting_commit`` (its commit index could still be behind
  the previous leader's).
* Leases (``LEASE_BASED``): the send tick of each voter's latest echoed round tells when that
  voter last vouched for this leader. Followers refuse to vote for ``election_tick`` ticks
  after hearing from a leader, so the leader may answer reads without a round while a quorum
  vouched less than ``lease_ticks`` ticks ago (see :meth:`ReadOnly.lease_start`).
"""

from __future__ import annotations

from collections import deque

from .progress import quorum_size

__all__ = ["ReadRequest", "ReadOnly"]

ReadRequest = tuple[bytes, int]  # (context, requesting node id)


class ReadOnly:
    __slots__ = ("next_round", "rounds", "unsent", "awaiting_commit", "acked", "round_tick")

    def __init__(self) -> None:
        self.next_round = 1
        # (round, read index, requests), oldest first
        self.rounds: deque[tuple[int, int, list[ReadRequest]]] = deque()
        self.unsent: list[ReadRequest] = []
        self.awaiting_commit: list[ReadRequest] = []
        self.acked: dict[int, int] = {}  # voter -> highest round echoed
        self.round_tick: dict[int, int] = {}  # round -> tick it was sent (recent rounds)

    def open_round(self, tick: int, commit: int, keep_ticks: int) -> int:
        """Start a round sent at ``tick``; pending ``unsent`` reads attach to it."""
        r = self.next_round
        self.next_round += 1
        self.round_tick[r] = tick
        if len(self.round_tick) > 4 * keep_ticks + 8:
            # Rounds older than the lease window can no longer extend the lease.
            oldest_useful = tick - keep_ticks - 1
            for k in [k for k, t in self.round_tick.items() if t < oldest_useful]:
                del self.round_tick[k]
        if self.unsent:
            self.rounds.append((r, commit, self.unsent))
            self.unsent = []
        return r

    def ack(self, voter: int, r: int) -> bool:
        """Record an echo; returns whether it moved the voter forward."""
        if r > self.acked.get(voter, 0) and r < self.next_round:
            self.acked[voter] = r
            return True
        return False

    def confirmed(
        self, voters: tuple[int, ...], self_id: int
    ) -> list[tuple[int, list[ReadRequest]]]:
        """Pop every round confirmed by a quorum of ``voters``: (read index, requests)."""
        out = []
        q = quorum_size(len(voters))
        acked = self.acked
        while self.rounds:
            r = self.rounds[0][0]
            n = 0
            for v in voters:
                if v == self_id or acked.get(v, 0) >= r:
                    n += 1
            if n < q:
                break
            _, index, reqs = self.rounds.popleft()
            out.append((index, reqs))
        return out

    def lease_start(self, voters: tuple[int, ...], self_id: int, now: int) -> int | None:
        """Send tick of the newest round a quorum has vouched for (None if no quorum)."""
        ticks = []
        for v in voters:
            if v == self_id:
                ticks.append(now)
                continue
            r = self.acked.get(v)
            if r is not None:
                t = self.round_tick.get(r)
                if t is not None:
                    ticks.append(t)
        q = quorum_size(len(voters))
        if len(ticks) < q:
            return None
        ticks.sort(reverse=True)
        return ticks[q - 1]

    def has_pending(self) -> bool:
        return bool(self.rounds or self.unsent or self.awaiting_commit)
