"""The admission core (kvmesh.net.admission.Gate) on socket pairs, with a fake clock."""

from __future__ import annotations

import socket

from kvmesh.net.admission import Gate
from kvmesh.net.limits import ConnectionLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Conn:
    def __init__(self, source: str) -> None:
        self.sock, self.peer = socket.socketpair()
        self.source = source
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def make(clock: Clock, per_source: int = 2, max_waiting: int = 8, wait_s: float = 2.0):
    lim = ConnectionLimiter(100, 10, per_source, min_handshake_age_s=0.25, clock=clock)
    admitted: list[Conn] = []
    gate = Gate(lim, lambda c, s: admitted.append(c), max_waiting=max_waiting, wait_s=wait_s,
                clock=clock)  # fmt: skip
    return lim, gate, admitted


def test_a_source_at_its_cap_waits_first_come_first_served():
    clock = Clock()
    lim, gate, admitted = make(clock)
    a = [Conn("1.1.1.1") for _ in range(5)]
    for c in a:
        gate.offer(c)
    assert admitted == a[:2] and len(gate) == 3
    other = Conn("2.2.2.2")
    gate.offer(other)  # another source's line does not hold it up
    assert admitted[-1] is other
    gate.poll()
    assert len(admitted) == 3  # the young slots cannot be evicted yet
    clock.t += 0.3
    gate.poll()  # old enough: the waiting ones evict them, in order
    assert admitted[3:] == a[2:4] and a[0].evicted and a[1].evicted
    late = Conn("1.1.1.1")
    gate.offer(late)  # its source has a line: it queues behind a[4], not ahead
    clock.t += 0.3
    gate.poll()
    assert admitted[5:] == [a[4], late]


def test_a_newcomer_never_jumps_its_sources_line():
    clock = Clock()
    lim, gate, admitted = make(clock)
    slots = []
    gate._admit = lambda c, s: (admitted.append(c), slots.append(s))
    first = [Conn("1.1.1.1") for _ in range(3)]
    for c in first:
        gate.offer(c)
    lim.release(slots[0])  # a handshake ended; the gate has not polled yet
    late = Conn("1.1.1.1")
    gate.offer(late)  # the slot is free, but first[2] was there before it
    assert late not in admitted and gate.waiting(first[2])
    gate.poll()
    assert admitted[-1] is first[2] and gate.waiting(late)


def test_one_that_spoke_goes_ahead_of_its_sources_silent_ones():
    clock = Clock()
    lim, gate, admitted = make(clock)
    silent = [Conn("1.1.1.1") for _ in range(6)]
    for c in silent:
        gate.offer(c)
    honest = Conn("1.1.1.1")
    gate.offer(honest)
    gate.spoke(honest)
    clock.t += 0.3
    gate.poll()
    assert admitted[2] is honest, admitted  # the first slot that frees is its


def test_waiting_ones_expire_and_gone_peers_are_dropped():
    clock = Clock()
    lim, gate, admitted = make(clock, wait_s=1.0)
    cs = [Conn("1.1.1.1") for _ in range(4)]
    for c in cs:
        gate.offer(c)
    cs[2].peer.close()  # the peer of the first waiting one went away
    clock.t += 0.3
    gate.poll()
    assert cs[2] not in admitted and admitted[-1] is cs[3] and gate.dropped == 1
    more = [Conn("1.1.1.1") for _ in range(2)]
    for c in more:
        gate.offer(c)
    assert admitted[-1] is more[0] and gate.waiting(more[1])  # it evicted cs[1]; cs[3] is young
    clock.t += 1.5  # more[1] waited past wait_s
    gate.poll()
    assert gate.dropped == 2 and len(gate) == 0 and more[1] not in admitted


def test_a_full_line_drops_the_heaviest_sources_oldest_silent_one():
    clock = Clock()
    lim, gate, admitted = make(clock, per_source=1, max_waiting=4)
    flood = [Conn("6.6.6.6") for _ in range(5)]  # 1 admitted, 4 waiting: the line is full
    for c in flood:
        gate.offer(c)
    assert len(gate) == 4
    honest = Conn("1.1.1.1")
    gate.offer(honest)  # a slot of its own source is free: admitted at once
    assert admitted[-1] is honest
    peer = Conn("6.6.6.6")
    gate.offer(peer)  # full: the flood's oldest silent one goes, the newcomer waits
    assert gate.waiting(peer) and not gate.waiting(flood[1]) and gate.dropped == 1
    gate.spoke(peer)
    for _ in range(4):
        gate.offer(Conn("6.6.6.6"))  # the flood goes on: it drops its own silent ones
    assert gate.waiting(peer)
    clock.t += 0.3
    gate.poll()
    assert admitted[-1] is peer
