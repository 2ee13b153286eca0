"""The column-wise object table (kvmesh/store/master/table.py): snapshots that stay
consistent while rows change under them, and memory per object at a million objects."""

from __future__ import annotations

import time

import pytest

from kvmesh.store.master import invariants
from kvmesh.store.master import table as tbl
from kvmesh.store.master.commands import (
    Mount,
    Pin,
    PutEnd,
    PutStart,
    Remove,
    Unmount,
    encode_command,
)
from kvmesh.store.master.state import MasterConfig, StoreStateMachine
from kvmesh.store.types import ReplicateConfig


class _Log:
    def __init__(self, sm: StoreStateMachine) -> None:
        self.sm = sm
        self.index = 0

    def __call__(self, cmd):
        self.index += 1
        return self.sm.apply(self.index, encode_command(cmd))


def test_snapshot_rows_changed_while_it_is_encoded_are_as_they_were(monkeypatch) -> None:
    """A snapshot is encoded chunk by chunk from the live columns; every change after it
    was taken -- rows removed, freed rows reused by new puts, pins, a segment dropped, in
    rows already encoded and rows still to come -- must leave the image as it was when
    taken (a missed copy-on-write shows up as a different digest or a broken restore)."""
    monkeypatch.setattr(tbl, "CHUNK_ROWS", 16)
    sm = StoreStateMachine(MasterConfig(slice_limit=1024))
    ap = _Log(sm)
    ap(Mount("n1", "s1", "e1", "h1", 1 << 24, 0.0))
    ap(Mount("n2", "s2", "e2", "h2", 1 << 24, 0.0))
    keys = [f"k{i:03d}" for i in range(120)]
    r = ap(PutStart(keys, [100] * 120, ReplicateConfig(), 0.0))
    ap(PutEnd(keys, r.versions))
    big = [f"b{i}" for i in range(6)]  # several slices and copies: the extra layouts
    r = ap(PutStart(big, [3000] * 6, ReplicateConfig(replica_num=2), 0.0))
    ap(Remove(keys[10:100:3]))  # free rows below the image's bound, both sides of its cursor
    want = sm.snapshot()
    want_keys = sm.key_list()
    chunks = sm.snapshot_chunks()
    head = [next(chunks) for _ in range(4)]  # the header and rows 0..47
    ap(Remove(keys[0:120:7]))  # rows encoded and rows to come
    r = ap(PutStart([f"n{i}" for i in range(60)], [200] * 60, ReplicateConfig(), 1.0))
    assert not any(r.codes)  # reusing every freed row, some below the cursor, some above
    assert sm.objects.nfree == 0
    ap(Pin(keys[50:90], False, 5.0))
    ap(PutEnd(big, [r_ for r_ in [sm.version_of(b) for b in big]]))
    ap(Unmount("n2", "s2", 2.0))  # rewrites the layouts of the two-copy objects
    got = b"".join(head + list(chunks))
    assert got == want
    clone = StoreStateMachine()
    clone.restore(got)
    assert clone.key_list() == want_keys
    assert not invariants.check(clone)
    assert not sm.objects._images  # a finished image stops watching the table


def test_abandoned_snapshot_stops_watching_the_table() -> None:
    sm = StoreStateMachine()
    ap = _Log(sm)
    ap(Mount("n", "s", "e", "h", 1 << 20, 0.0))
    ap(PutStart(["a", "b"], [10, 10], ReplicateConfig(), 0.0))
    it = sm.snapshot_chunks()
    assert len(sm.objects._images) == 1
    del it
    assert not sm.objects._images
    ap(Remove(["a"]))


def test_restored_table_reuses_rows_like_the_original() -> None:
    """The image keeps free rows and their order: a replica restored from it places the
    next objects in the same rows (same table order and digest as one that replayed)."""
    sm = StoreStateMachine()
    ap = _Log(sm)
    ap(Mount("n", "s", "e", "h", 1 << 20, 0.0))
    keys = [f"k{i}" for i in range(50)]
    r = ap(PutStart(keys, [64] * 50, ReplicateConfig(), 0.0))
    ap(PutEnd(keys, r.versions))
    ap(Remove(keys[5:45:4]))
    clone = StoreStateMachine()
    clone.restore(sm.snapshot())
    more = PutStart([f"m{i}" for i in range(15)], [64] * 15, ReplicateConfig(), 0.0)
    for m in (sm, clone):
        m.apply(ap.index + 1, encode_command(more))
    assert clone.key_list() == sm.key_list() and clone.digest() == sm.digest()


N_SCALE = 1_000_000
KEY = "sglang-hicache-{:064x}-tp0-k"  # HiCache-shaped: a hash per page, ~100 bytes


def test_memory_per_object_at_a_million_objects() -> None:
    """The pure core with a million HiCache-shaped keys: the table's own accounting
    (``Table.nbytes``, from ``sys.getsizeof``: the same on every machine) stays within 200
    bytes per object beside the key strings (the dict of records was ~600), and a snapshot
    restores to the same digest. The loop prints the figures; nothing timed is asserted."""
    sm = StoreStateMachine()
    ap = _Log(sm)
    for k in range(4):
        ap(Mount(f"n{k}", f"s{k}", f"e{k}", f"h{k % 2}", 1 << 40, 0.0))
    cfg = ReplicateConfig(writer_host="h0")
    t0 = time.process_time()
    batch = 2048
    for lo in range(0, N_SCALE, batch):
        keys = [KEY.format(i) for i in range(lo, min(N_SCALE, lo + batch))]
        r = ap(PutStart(keys, [16384] * len(keys), cfg, 1.0))
        ap(PutEnd(keys, r.versions))
    load = time.process_time() - t0
    assert sm.object_count() == N_SCALE and sm.usage().complete == N_SCALE
    parts = sm.objects.nbytes()
    keys_b = parts.pop("keys")
    per = sum(parts.values()) / N_SCALE
    print(
        f"load {load:.1f}s; bytes/object beside keys {per:.0f} {parts}; keys {keys_b / N_SCALE:.0f}"
    )
    assert per <= 200, parts
    assert keys_b / N_SCALE <= 49 + len(KEY.format(0)) + 8  # the str itself, nothing else
    img = sm.snapshot()
    clone = StoreStateMachine()
    clone.restore(img)
    assert clone.object_count() == N_SCALE
    assert clone.exists([KEY.format(7), KEY.format(N_SCALE - 1), KEY.format(N_SCALE)]) == [
        True,
        True,
        False,
    ]
    assert clone.digest() == sm.digest()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "-s"])
