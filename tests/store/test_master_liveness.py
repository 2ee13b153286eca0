"""The leader's node-liveness judge (kvmesh.store.master.liveness), driven by explicit time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmesh.store.master.liveness import LivenessJudge, node_capacity

TTL, STAGE, GAP, TICK = 10.0, 5.0, 1.0, 0.25


def _run(j: LivenessJudge, cap: dict, t0: float, t1: float, beating=(), every=2.0):
    """Tick every TICK from t0 to t1 with ``beating`` nodes heartbeating every ``every``;
    returns [(time, expired)] of every round that expired something."""
    out = []
    t, next_beat = t0, t0
    while t < t1 - 1e-9:
        t += TICK
        if t >= next_beat:
            for n in beating:
                j.beat(n, t)
            next_beat = t + every
        v = j.tick(t, cap)
        if v.expire:
            out.append((round(t, 2), v.expire))
            j.expired(v.expire)
            for n in v.expire:
                cap.pop(n)
    return out


def test_a_stopped_leader_expires_nobody() -> None:
    cap = {"a": 100, "b": 100}
    j = LivenessJudge(TTL, STAGE, GAP, now=0.0)
    j.reset(cap, 0.0)
    assert _run(j, cap, 0.0, 30.0, beating=("a", "b")) == []
    # stopped for 2x TTL (then a further 10x): silence it could not hear is not counted
    for pause in (2 * TTL, 10 * TTL):
        t = 30.0 + pause
        v = j.tick(t, cap)
        assert v.stalled and v.expire == [] and v.suspect == []
        assert _run(j, cap, t, t + 60.0, beating=("a", "b")) == []
        assert j.stalls >= 1


def test_a_dead_node_is_expired_within_ttl_plus_a_stage() -> None:
    cap = {"a": 100, "b": 100}
    j = LivenessJudge(TTL, STAGE, GAP, now=0.0)
    j.reset(cap, 0.0)
    _run(j, cap, 0.0, 10.0, beating=("a", "b"))
    last = 10.0 - j.age("b")  # b's last heartbeat (then it dies)
    got = _run(j, cap, 10.0, 40.0, beating=("a",))
    assert len(got) == 1 and got[0][1] == ["b"]
    assert TTL + STAGE <= got[0][0] - last <= TTL + STAGE + TICK


def test_a_stall_restarts_the_stage() -> None:
    cap = {"a": 100}
    j = LivenessJudge(TTL, STAGE, GAP, now=0.0)
    j.reset(cap, 0.0)
    _run(j, cap, 0.0, 12.0)  # suspect since heard 10
    assert j.tick(12.0, cap).suspect == ["a"]
    j.tick(20.0, cap)  # an 8 s stall: counts as GAP only, and the stage starts over
    got = _run(j, cap, 20.0, 40.0)
    # heard at 20.0 is 13; the stage ends at heard 18: five more seconds of running
    assert got == [(25.0, ["a"])]


def test_rounds_are_bounded_and_spaced_by_a_stage() -> None:
    cap = {n: 100 for n in "abcdef"}
    j = LivenessJudge(TTL, STAGE, GAP, max_drop=0.5, now=0.0)
    j.reset(cap, 0.0)
    got = _run(j, cap, 0.0, 60.0)  # all six silent from 0
    assert [len(e) for _, e in got] == [3, 1, 1, 1]  # half of 6, of 3, of 2 (one at least)
    times = [t for t, _ in got]
    assert times[0] == TTL + STAGE
    assert all(b - a >= STAGE for a, b in zip(times, times[1:]))


def test_the_byte_cap_defers_but_always_allows_one() -> None:
    cap = {"big": 1000, "s1": 10, "s2": 10, "live": 10}
    j = LivenessJudge(TTL, STAGE, GAP, max_drop=0.5, now=0.0)
    j.reset(cap, 0.0)
    got = _run(j, cap, 0.0, 60.0, beating=("live",))
    # big (97 % of the bytes) goes alone: the first of a round always may; s1 would fit
    # the node cap (2 of 4) but not the byte cap after it; then one node per round
    assert got == [(15.0, ["big"]), (20.0, ["s1"]), (25.0, ["s2"])]


def test_nodes_follow_the_state_machine() -> None:
    j = LivenessJudge(TTL, STAGE, GAP, now=0.0)
    j.reset([], 0.0)
    j.tick(0.25, {"new": 1})
    assert j.age("new") == 0.0  # a node mounted by another leader gets a full TTL
    j.tick(0.5, {})
    assert j.age("new") is None and len(j) == 0


def test_capacity_and_bad_parameters() -> None:
    segs = [
        SimpleNamespace(node_id="a", size=5),
        SimpleNamespace(node_id="a", size=7),
        SimpleNamespace(node_id="b", size=1),
    ]
    assert node_capacity(segs) == {"a": 12, "b": 1}
    for bad in ((0, 1, 1, 0.5), (1, 0, 1, 0.5), (1, 1, 0, 0.5), (1, 1, 1, 0), (1, 1, 1, 2)):
        with pytest.raises(ValueError):
            LivenessJudge(*bad)
