"""The shared leader-finding walk (kvmesh/net/retry.py) used by the store and replog clients."""

from __future__ import annotations

import random
import time

from kvmesh.net.retry import LeaderFinder


def _walk(finder: LeaderFinder, deadline_s: float = 60.0):
    return finder.attempts(time.monotonic() + deadline_s, 1.0)


def test_round_without_answer_pauses_with_capped_backoff() -> None:
    f = LeaderFinder(["a", "b", "c"], rng=random.Random(1), first_backoff=0.02, max_backoff=0.05)
    tries = _walk(f)
    waits = []
    tried = []
    while len(waits) < 4:
        step = tries.next()
        assert step is not None
        if step.addr is None:
            waits.append(step.wait)
            continue
        tried.append(step.addr)
        tries.failed(step.addr, "refused")
    assert waits == [0.02, 0.04, 0.05, 0.05]
    assert sorted(tried[:3]) == ["a", "b", "c"] and len(tried) == 12
    assert f.retries == 12 and "refused" in tries.last


def test_redirect_goes_straight_to_leader_then_sticks() -> None:
    f = LeaderFinder(["a", "b"], rng=random.Random(2), learn_redirects=True)
    tries = _walk(f)
    step = tries.next()
    tries.redirected(step.addr, "z", "not the leader")
    step = tries.next()
    assert step.addr == "z" and "z" in f.addrs and f.redirects == 1  # no pause in between
    tries.succeeded("z")
    assert f.leader == "z" and f.candidates()[0] == "z"
    # A failure of the leader forgets it; a redirect naming itself too.
    tries.failed("z", "reset")
    assert f.leader is None
    f.leader = "a"
    tries.redirected("a", "a", "not the leader")
    assert f.leader is None
    f.leader = "a"
    tries.retry("a", "stopped", forget_leader=True)
    assert f.leader is None


def test_without_learning_the_address_list_is_kept() -> None:
    f = LeaderFinder(["a"], rng=random.Random(3))
    tries = _walk(f)
    tries.redirected(tries.next().addr, "z", "x")
    assert f.addrs == ["a"] and tries.next().addr == "z"


def test_deadline_ends_the_walk() -> None:
    f = LeaderFinder(["a", "b"])
    tries = _walk(f, deadline_s=0.0)
    assert tries.next() is None
    # (0.3 s, not 0.05: a loaded machine may deschedule us past a 50 ms deadline before
    # the first next(), which then rightly returns None at once.)
    empty = LeaderFinder([]).attempts(time.monotonic() + 0.3, 1.0)
    n = 0
    while (step := empty.next()) is not None:
        assert step.addr is None
        time.sleep(step.wait)
        n += 1
    assert n >= 1  # it paused, then gave up at the deadline instead of spinning
