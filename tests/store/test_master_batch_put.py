"""The batched PutStart (``StoreStateMachine._put_start_batch``) must give exactly the result
of the per-key path: same codes, offsets, segments and allocator state, on fragmented
segments, several segments and hosts, mixed sizes, existing and in-flight keys (and PutEnds
with repeated keys and stale versions), and when space runs out. Each random history runs
twice, once with the batch path switched off."""

from __future__ import annotations

import random

import pytest

from kvmesh.store.master import commands as C
from kvmesh.store.master.allocator import SegmentAllocator
from kvmesh.store.master.state import StoreStateMachine
from kvmesh.store.types import ReplicateConfig


def _history(seed: int) -> list[C.Command]:
    rng = random.Random(seed)
    cmds: list[C.Command] = []
    nseg = rng.randint(1, 4)
    for k in range(nseg):
        size = rng.choice([64 << 10, 256 << 10, 1 << 20])
        cmds.append(C.Mount(f"n{k}", f"s{k}", f"e{k}", f"h{k % 2}", size, 0.0))
    live: list[str] = []
    for step in range(60):
        r = rng.random()
        if r < 0.55:
            n = rng.randint(1, 40)
            keys = [f"k{rng.randint(0, 300)}" for _ in range(n)]
            if rng.random() < 0.7:
                keys = list(dict.fromkeys(keys))
            base = rng.choice([1, 64, 100, 4096, 5000, 16384])
            sizes = [base if rng.random() < 0.8 else rng.randint(1, 20000) for _ in keys]
            cfg = ReplicateConfig(
                strategy=rng.choice(["local", "most_free"]),
                writer_host=rng.choice([None, "h0", "h1", "h9"]),
                soft_pin=rng.random() < 0.2,
            )
            if rng.random() < 0.15:  # a bad key or size: per-key codes, the rest still put
                i = rng.randrange(len(keys))
                if rng.random() < 0.5:
                    keys[i] = rng.choice(["", "bad\0key", "x" * 300])
                else:
                    sizes[i] = rng.choice([0, -5, (1 << 62)])
            cmds.append(C.PutStart(keys, sizes, cfg, float(step)))
            live.extend(keys)
        elif r < 0.75 and live:
            ks = rng.sample(live, min(len(live), rng.randint(1, 30)))
            vs = [-1] * len(ks)  # versions filled in at apply time
            if rng.random() < 0.15:  # a key twice
                ks.append(ks[0])
                vs.append(-1)
            if rng.random() < 0.15:  # a stale version
                vs[rng.randrange(len(vs))] = -2
            cmds.append(C.PutEnd(ks, vs))
        elif r < 0.95 and live:
            ks = rng.sample(live, min(len(live), rng.randint(1, 30)))
            cmds.append(C.Remove(ks))
        else:
            cmds.append(C.Reclaim(float(step), 5.0))
    return cmds


def _run(cmds: list[C.Command], batch: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    sm = StoreStateMachine()
    if not batch:
        monkeypatch.setattr(StoreStateMachine, "_put_start_batch", lambda self, i, c: None)
    out = []
    try:
        for i, cmd in enumerate(cmds, 1):
            if type(cmd) is C.PutEnd:
                cmd = C.PutEnd(
                    cmd.keys,
                    [sm.version_of(k) + (v == -2) for k, v in zip(cmd.keys, cmd.versions)],
                )
            res = sm.apply(i, C.encode_command(cmd))
            # the batch path answers the compact form of the per-key path's answer
            out.append(res.expand() if type(res) is C.PutStartRun else res)
            out.append([sm.placement(k) for k in sorted(sm.objects)])
            out.append((sm.complete, list(sm.processing)))
        out.append(sm.digest())
    finally:
        monkeypatch.undo()
    return out


@pytest.mark.parametrize("seed", range(40))
def test_batch_put_start_matches_per_key(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cmds = _history(seed)
    assert _run(cmds, True, monkeypatch) == _run(cmds, False, monkeypatch)


def test_batch_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard for the test above: the batch path really runs for the common put."""
    calls = []
    orig = StoreStateMachine._put_start_batch

    def spy(self, i, c):  # type: ignore[no-untyped-def]
        r = orig(self, i, c)
        calls.append(r is not None)
        return r

    monkeypatch.setattr(StoreStateMachine, "_put_start_batch", spy)
    sm = StoreStateMachine()
    sm.apply(1, C.encode_command(C.Mount("n", "s", "e", "h", 1 << 20, 0.0)))
    r = sm.apply(2, C.encode_command(C.PutStart(["a", "b"], [100, 100], ReplicateConfig(), 0.0)))
    assert calls == [True] and r.codes == [0, 0]
    assert [rep[0].slices[0].offset for rep in r.replicas] == [0, 128]


@pytest.mark.parametrize("seed", range(20))
def test_alloc_run_equals_repeated_alloc(seed: int) -> None:
    rng = random.Random(seed)
    a = SegmentAllocator(1 << 20, 64)
    held = []
    for _ in range(300):  # fragment it
        ln = rng.randint(1, 9000)
        off = a.alloc(ln)
        if off >= 0:
            held.append((off, ln))
    for off, ln in rng.sample(held, len(held) // 2):
        a.free(off, ln)
    b = SegmentAllocator(1 << 20, 64, free=a.free_extents())
    ln = rng.choice([64, 100, 4096, 16384])
    cap = a.capacity(ln, 10**9)
    count = rng.randint(0, cap)
    one = [a.alloc(ln) for _ in range(count)]
    assert -1 not in one and b.capacity(ln, 10**9) == cap
    assert b.alloc_run(ln, count) == one
    assert a.free_extents() == b.free_extents() and a.free_bytes == b.free_bytes
    c = SegmentAllocator(1 << 20, 64, free=b.free_extents())
    assert a.alloc(ln) == b.alloc(ln)
    assert len(c.alloc_run(ln, cap - count)) == cap - count and c.alloc(ln) == -1


def test_compact_put_answer_is_checked_before_use() -> None:
    """The client expands a ``ReplicaRun`` only if it describes exactly its keys with every
    segment index in range: a broken reply must fail the batch cleanly, not with an
    IndexError halfway through the writes."""
    from kvmesh.store import protocol as P
    from kvmesh.store.types import ReplicaRun

    run = ReplicaRun([("s", "n", "e")], [0, -1, 0], [0, 0, 128], [100, 0, 100])
    ok = P.PutStartResp(1, [0, -704, 0], [], [5, 0, 5], 1000, run)
    assert ok.fits(3) and not ok.fits(2)
    assert [c and c[0].slices[0].offset for c in ok.copies()] == [0, None, 128]
    for bad in (
        ReplicaRun([("s", "n", "e")], [0, 1, 0], [0, 0, 128], [100, 0, 100]),  # no segs[1]
        ReplicaRun([("s", "n", "e")], [0, -2, 0], [0, 0, 128], [100, 0, 100]),
        ReplicaRun([("s", "n", "e")], [0, 0], [0, 128], [100, 100]),  # two keys, not three
        ReplicaRun([("s", "n", "e")], [0, 0, 0], [0, 128], [100, 100, 100]),
    ):
        assert not P.PutStartResp(1, [0, 0, 0], [], [5, 5, 5], 1000, bad).fits(3), bad
    full = P.PutStartResp(1, [0], [None], [5], 1000)
    assert full.fits(1) and not P.PutStartResp(1, [0], [], [5], 1000).fits(1)
