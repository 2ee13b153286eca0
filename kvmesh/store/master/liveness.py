"""The leader's judge of storage-node liveness, judged only over time it could hear.

Sans-I/O: every call takes the caller's monotonic ``now``; the judge keeps no clock, thread
or socket, so the service's ticker and the simulator drive the same object.

The rule (docs/store-master.md, "Node liveness"):

* **Heard time.** The judge keeps its own clock that advances only while the leader runs.
  Every observation (a ticker turn, a heartbeat) advances it by the gap since the previous
  observation -- unless that gap is longer than ``max_gap``: then the leader itself was not
  running (SIGSTOP, a VM pause, a blocked event loop, a stalled disk), so the gap counts as
  ``max_gap`` only and is recorded as a *stall*. Heartbeats sent during a stall were not
  lost for lack of a sender but for lack of a listener; they must not count against nodes.
* **Suspect, then expire.** A node whose last heartbeat is more than ``ttl`` of heard time
  old is *suspect*. It is expired only after it has stayed suspect for ``stage`` more
  heard time *with no stall in between*: a stall restarts every suspect's stage, so the
  evidence for an expiry is always ``stage`` seconds of the leader running and able to
  receive (the heartbeats queued in its sockets during a stall are read in that time).
* **Bounded rounds.** One round expires at most ``max_drop`` of the mounted nodes and of
  their bytes (always at least one node), oldest silence first; after a round the next
  waits another ``stage`` of heard time. A judge that is wrong in some way not foreseen
  here loses a fraction of the pool per stage, never all of it at once.

A really dead node is expired within ``ttl + stage`` of heard time after its last
heartbeat (plus one ticker turn), later only when the leader stalls or other nodes went
first in a bounded round.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

__all__ = ["LivenessJudge", "Verdict", "default_max_gap", "node_capacity"]


def default_max_gap(ttl: float, period: float) -> float:
    """The stall threshold for a leader that observes every ``period`` seconds: four
    periods (at least 1 s: a loaded event loop runs timers late), at most a quarter TTL."""
    return min(ttl / 4, max(1.0, 4 * period))


def node_capacity(segments: Iterable[object]) -> dict[str, int]:
    """node id -> bytes of its segments (``SegmentInfo``-like: ``node_id``, ``size``)."""
    out: dict[str, int] = {}
    for s in segments:
        n = s.node_id  # type: ignore[attr-defined]
        out[n] = out.get(n, 0) + s.size  # type: ignore[attr-defined]
    return out


class Verdict(msgspec.Struct, frozen=True):
    """One judgement: ``expire`` now (sorted), ``suspect`` (stale, stage running or
    deferred by the round cap; sorted), ``stalled`` (this observation ended a stall)."""

    expire: list[str] = []
    suspect: list[str] = []
    stalled: bool = False


class LivenessJudge:
    """``ttl``: heard seconds of silence before a node is suspect; ``stage``: heard seconds
    it then stays suspect, with no stall, before it is expired; ``max_gap``: the longest
    gap between two observations still counted as heard (keep it well above the ticker's
    period); ``max_drop``: the fraction of nodes and of bytes one round may expire."""

    def __init__(
        self, ttl: float, stage: float, max_gap: float, max_drop: float = 0.5, now: float = 0.0
    ) -> None:
        if not (ttl > 0 and stage > 0 and max_gap > 0 and 0 < max_drop <= 1):
            raise ValueError("ttl, stage and max_gap must be positive, max_drop in (0, 1]")
        self.ttl = ttl
        self.stage = stage
        self.max_gap = max_gap
        self.max_drop = max_drop
        self.heard = 0.0  # the heard clock
        self.stalls = 0
        self._seen = now  # the caller's clock at the last observation
        self._run_start = 0.0  # heard time at the end of the last stall
        self._next_round = 0.0  # heard time before which no further round runs
        self._last: dict[str, float] = {}  # node -> heard time of its last heartbeat

    # ----------------------------------------------------------------- the heard clock

    def _advance(self, now: float) -> bool:
        """Advance the heard clock to the caller's ``now``; True if a stall just ended."""
        gap = now - self._seen
        if gap <= 0:
            return False
        self._seen = now
        if gap > self.max_gap:
            self.heard += self.max_gap
            self._run_start = self.heard
            self.stalls += 1
            return True
        self.heard += gap
        return False

    # -------------------------------------------------------------------- evidence

    def observe(self, now: float) -> bool:
        """The leader ran at ``now`` (its own periodic check); True if a stall just ended."""
        return self._advance(now)

    def reset(self, nodes: Iterable[str], now: float) -> None:
        """A new leader: every known node gets a full TTL (and a stage) from ``now``."""
        self._advance(now)
        self._run_start = self.heard
        self._last = dict.fromkeys(nodes, self.heard)

    def beat(self, node: str, now: float) -> None:
        self._advance(now)
        self._last[node] = self.heard

    def forget(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            self._last.pop(n, None)

    def expired(self, nodes: Iterable[str]) -> None:
        """The caller expired these nodes (its ExpireNodes applied): the next round waits."""
        self.forget(nodes)
        self._next_round = self.heard + self.stage

    def age(self, node: str) -> float | None:
        """Heard seconds since the node's last heartbeat (None: not tracked)."""
        t = self._last.get(node)
        return None if t is None else self.heard - t

    def __len__(self) -> int:
        return len(self._last)

    # -------------------------------------------------------------------- judgement

    def tick(self, now: float, capacity: Mapping[str, int]) -> Verdict:
        """Judge at ``now``. ``capacity``: every node the state machine holds segments of,
        with their bytes; nodes not tracked yet start with a full TTL, nodes gone from it
        are forgotten. Returns what to expire (the caller proposes it, then calls
        :meth:`expired` once it applied)."""
        stalled = self._advance(now)
        last = self._last
        for n in [n for n in last if n not in capacity]:
            del last[n]
        for n in capacity:
            if n not in last:
                last[n] = self.heard
        heard, ttl = self.heard, self.ttl
        suspects = sorted((t, n) for n, t in last.items() if heard - t > ttl)
        if not suspects:
            return Verdict(stalled=stalled)
        due = [
            n for t, n in suspects if heard - max(t + ttl, self._run_start) >= self.stage
        ]  # oldest silence first
        expire: list[str] = []
        if due and heard >= self._next_round:
            total_bytes = sum(capacity.values())
            max_nodes = max(1, int(self.max_drop * len(capacity)))
            dropped = 0
            for n in due:
                b = capacity.get(n, 0)
                if expire and (
                    len(expire) >= max_nodes or dropped + b > self.max_drop * total_bytes
                ):
                    continue  # deferred to a later round (smaller nodes may still fit)
                expire.append(n)
                dropped += b
        chosen = set(expire)
        return Verdict(sorted(expire), sorted(n for _, n in suspects if n not in chosen), stalled)
