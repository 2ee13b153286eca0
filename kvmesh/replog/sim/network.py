"""Simulated network between replicas: per directed link loss, duplication, delay with
jitter (which reorders), and cuts (partitions, asymmetric and non-transitive ones)."""

from __future__ import annotations

import random
from collections.abc import Iterable

__all__ = ["NetParams", "SimNetwork"]


class NetParams:
    """Link behaviour; one default for all links plus per-link overrides."""

    __slots__ = ("loss", "dup", "delay", "jitter")

    def __init__(
        self, loss: float = 0.0, dup: float = 0.0, delay: float = 0.001, jitter: float = 0.001
    ) -> None:
        self.loss = loss
        self.dup = dup
        self.delay = delay
        self.jitter = jitter

    def copy(self) -> NetParams:
        return NetParams(self.loss, self.dup, self.delay, self.jitter)

    def __repr__(self) -> str:
        return (
            f"NetParams(loss={self.loss}, dup={self.dup}, delay={self.delay}, jitter={self.jitter})"
        )


class SimNetwork:
    """Decides, for each message, whether and when (possibly several times) it arrives."""

    def __init__(self, rng: random.Random, default: NetParams | None = None) -> None:
        self.rng = rng
        self.default = default or NetParams()
        self.base_default = self.default.copy()
        self.links: dict[tuple[int, int], NetParams] = {}
        self.cut: set[tuple[int, int]] = set()
        self.sent = 0
        self.dropped = 0
        self.duplicated = 0

    # -- faults ----------------------------------------------------------------------------

    def cut_both(self, a: int, b: int) -> None:
        self.cut.add((a, b))
        self.cut.add((b, a))

    def partition(self, groups: Iterable[Iterable[int]], all_nodes: Iterable[int]) -> None:
        """Only nodes inside the same group can talk; nodes in no group are isolated."""
        where: dict[int, int] = {}
        for gi, g in enumerate(groups):
            for n in g:
                where[n] = gi
        nodes = sorted(all_nodes)
        for a in nodes:
            for b in nodes:
                if a != b and (a not in where or b not in where or where[a] != where[b]):
                    self.cut.add((a, b))

    def isolate(self, n: int, all_nodes: Iterable[int]) -> None:
        for m in all_nodes:
            if m != n:
                self.cut_both(n, m)

    def set_link(self, frm: int, to: int, params: NetParams) -> None:
        self.links[(frm, to)] = params

    def heal(self) -> None:
        self.cut.clear()
        self.links.clear()
        self.default = self.base_default.copy()

    def is_cut(self, frm: int, to: int) -> bool:
        return (frm, to) in self.cut

    # -- delivery ----------------------------------------------------------------------------

    def delays(self, frm: int, to: int) -> list[float]:
        """Delays after which copies of a message sent now arrive ([] if lost)."""
        self.sent += 1
        if (frm, to) in self.cut:
            self.dropped += 1
            return []
        p = self.links.get((frm, to), self.default)
        rng = self.rng
        if p.loss and rng.random() < p.loss:
            self.dropped += 1
            return []
        n = 1
        if p.dup and rng.random() < p.dup:
            n += 1 + (rng.random() < 0.3)
            self.duplicated += n - 1
        return [p.delay + rng.random() * p.jitter for _ in range(n)]
