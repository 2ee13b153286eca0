"""End to end on loopback: a master process, a storage-node process, this process as a client.

Bytes cross processes (this process <-> the peer's shared-memory segment); every check is
byte-exact. Bad inputs get per-key errors in batches and specific exceptions for single keys.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import MAX_KEY_BYTES

from .e2e_util import TOKEN, Peer
from .store_peer import value_of

LEASE_S = 1.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-e2e")
    cl = StoreCluster(str(d), 1, token=TOKEN, extra_args=["--lease-ttl-s", str(LEASE_S)])
    cl.start_all()
    peer = Peer(cl.address, 64 << 20)
    client = StoreClient(cl.address, token=TOKEN, timeout=10)
    try:
        yield cl, peer, client
    finally:
        client.close()
        peer.close()
        cl.close()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_single_put_get_across_processes(env):
    cl, peer, c = env
    data = value_of("single-a", 12345)
    assert c.put("single-a", data) is None
    r = peer.call(op="get", keys=["single-a"])
    assert r["codes"] == [0] and r["sha"] == [_sha(data)]
    r = peer.call(op="put", keys=["single-b"], sizes=[70000])
    assert r["codes"] == [0]
    assert c.get("single-b") == value_of("single-b", 70000)
    assert c.get_size("single-b") == 70000
    assert c.exists("single-b") is True and c.exists("single-none") is False
    with pytest.raises(E.ObjectNotFound):
        c.get("single-none")
    with pytest.raises(E.ObjectExists):
        c.put("single-a", b"other")
    assert c.get("single-a") == data  # never silently overwritten
    with pytest.raises(E.ObjectHasLease):
        c.upsert("single-a", b"replaced")  # the get above holds a read lease
    time.sleep(LEASE_S + 0.2)
    c.upsert("single-a", b"replaced")
    assert c.get("single-a") == b"replaced"


def test_batch_zero_copy_put_get_exists_remove(env):
    cl, peer, c = env
    rng = np.random.default_rng(7)
    n = 64
    sizes = [int(s) for s in rng.integers(1, 300_000, n)]
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
    src = np.frombuffer(rng.bytes(sum(sizes)), np.uint8).copy()
    dst = np.zeros(sum(sizes) + 4096, np.uint8)
    c.register_buffer(src)
    c.register_buffer(dst)
    keys = [f"batch-{i}" for i in range(n)]
    res = c.put_from(keys, src, offs, sizes)
    assert res.ok, res
    assert res.transports  # the transport that moved the batch is reported
    moved = c.stats[f"write:{','.join(res.transports)}"]
    assert moved[0] >= 1 and moved[1] >= sum(sizes)  # bytes per transport
    assert c.exists(keys + ["batch-missing"]) == [True] * n + [False]
    got = c.get_into(keys, dst, offs, sizes)
    assert list(got) == sizes
    assert np.array_equal(dst[: sum(sizes)], src)
    # The other process reads the same bytes.
    r = peer.call(op="get", keys=keys[:8])
    assert r["sha"] == [_sha(src[o : o + s].tobytes()) for o, s in zip(offs[:8], sizes[:8])]
    time.sleep(LEASE_S + 0.2)  # let the read leases run out
    rm = c.remove(keys[:32] + ["batch-missing"])
    assert rm.codes[:32] == [0] * 32
    assert isinstance(rm[32], E.ObjectNotFound)
    ex = c.exists(keys)
    assert ex == [False] * 32 + [True] * 32
    g = c.get(keys[30:34])
    assert isinstance(g[0], E.ObjectNotFound) and isinstance(g[1], E.ObjectNotFound)
    assert g[2] == src[offs[32] : offs[32] + sizes[32]].tobytes()
    c.unregister_buffer(src)
    c.unregister_buffer(dst)


def test_lease_blocks_remove_until_it_ends(env):
    cl, peer, c = env
    c.put("lease-a", b"x" * 1000)
    assert c.get("lease-a") == b"x" * 1000  # takes a lease
    with pytest.raises(E.ObjectHasLease):
        c.remove("lease-a")
    time.sleep(LEASE_S + 0.2)
    c.remove("lease-a")
    assert c.exists("lease-a") is False
    c.put("lease-b", b"y" * 10)
    c.get("lease-b")
    c.remove("lease-b", force=True)
    assert c.exists("lease-b") is False


def test_lease_expired_before_copy_finished(env, monkeypatch):
    cl, peer, c = env
    c.put(["slow-a", "slow-b"], [b"a" * 5000, b"b" * 5000])
    real = c._transfer  # one segment here: every read's copy goes through it

    def slow_move(*args):
        time.sleep(LEASE_S + 0.3)  # the copy outlives the lease
        return real(*args)

    monkeypatch.setattr(c, "_transfer", slow_move)
    res = c.get(["slow-a", "slow-b", "slow-missing"])
    assert isinstance(res[0], E.LeaseExpired) and isinstance(res[1], E.LeaseExpired)
    assert isinstance(res[2], E.ObjectNotFound)
    with pytest.raises(E.LeaseExpired):
        c.get("slow-a")
    monkeypatch.setattr(c, "_transfer", real)
    assert c.get("slow-a") == b"a" * 5000


def _leased_read_planted_without_lease_check(real):
    """A copy of ``real`` (StoreClient._read_leased, the read of the single-key and usual
    batch paths) that never checks the lease (a planted bug)."""
    import inspect
    import textwrap

    from kvmesh.store.client import reads as client_mod

    src = textwrap.dedent(inspect.getsource(real))
    assert src.count("time.monotonic() > looked.lease_deadline") == 1
    src = src.replace("time.monotonic() > looked.lease_deadline", "False")
    ns: dict = {}
    exec(src, vars(client_mod), ns)  # noqa: S102 - the test's own planted copy
    return ns["_read_leased"]


def test_simple_batch_read_keeps_the_loops_answers_and_the_lease(env, monkeypatch):
    """The fast path of the usual batch (every key found, one copy of one slice, one
    segment, one region) answers what the general loop answers: bytes, a lease that ended
    during the copy (per key), a failed copy, a buffer too small (left to the loop)."""
    cl, peer, c = env
    keys = [f"simple-{i}" for i in range(8)]
    vals = [value_of(k, 3000 + 100 * i) for i, k in enumerate(keys)]
    assert c.put(keys, vals).ok
    size = 4096
    dst = np.zeros(len(keys) * size, np.uint8)
    c.register_buffer(dst)
    offs = [i * size for i in range(len(keys))]
    ran = []
    real = StoreClient._read_simple

    def spy(self, *a):
        res = real(self, *a)
        ran.append(res is not None)
        return res

    monkeypatch.setattr(StoreClient, "_read_simple", spy)
    try:
        got = c.get_into(keys, dst, offs, [size] * len(keys))
        assert ran == [True] and list(got) == [len(v) for v in vals] and got.transports
        for i, v in enumerate(vals):
            assert dst[offs[i] : offs[i] + len(v)].tobytes() == v
        # The general loop gives the same answers.
        monkeypatch.setattr(StoreClient, "_read_simple", lambda self, *a: None)
        dst[:] = 0
        loop = c.get_into(keys, dst, offs, [size] * len(keys))
        assert list(loop) == list(got) and loop.transports == got.transports
        assert all(dst[offs[i] : offs[i] + len(v)].tobytes() == v for i, v in enumerate(vals))
        monkeypatch.setattr(StoreClient, "_read_simple", spy)
        # A buffer too small for one key: the loop refuses that key alone.
        ran.clear()
        small = c.get_into(keys, dst, offs, [size] * 7 + [100])
        assert ran == [False] and isinstance(small[7], E.BufferOverflow)
        assert list(small[:7]) == [len(v) for v in vals[:7]]
        # The copy outlives the lease: every key of the batch is LeaseExpired.
        real_move = c._transfer

        def slow_move(*args):
            time.sleep(LEASE_S + 0.3)
            return real_move(*args)

        monkeypatch.setattr(c, "_transfer", slow_move)
        ran.clear()
        late = c.get_into(keys, dst, offs, [size] * len(keys))
        assert ran == [True] and all(isinstance(r, E.LeaseExpired) for r in late)
        # Negative control: the same path without its lease check reports bytes instead.
        planted_read = _leased_read_planted_without_lease_check(StoreClient._read_leased)
        monkeypatch.setattr(StoreClient, "_read_leased", planted_read)
        ran.clear()
        planted = c.get_into(keys, dst, offs, [size] * len(keys))
        assert ran == [True] and not any(isinstance(r, E.LeaseExpired) for r in planted)
        monkeypatch.undo()  # the real _read_leased and _transfer again
        monkeypatch.setattr(StoreClient, "_read_simple", spy)
        # A copy that fails: every key is TransferFailed, none reports bytes.
        monkeypatch.setattr(c, "_transfer", lambda *a: None)
        ran.clear()
        failed = c.get_into(keys, dst, offs, [size] * len(keys))
        assert ran == [True] and all(isinstance(r, E.TransferFailed) for r in failed)
    finally:
        monkeypatch.undo()
        c.unregister_buffer(dst)


def test_bad_keys_are_per_key_errors(env):
    cl, peer, c = env
    bad = ["", "\udc80bad", "k" * (MAX_KEY_BYTES + 1), "nul\0key"]
    res = c.put(bad + ["good-key"], [b"1", b"2", b"3", b"4", b"5"])
    assert all(isinstance(r, E.InvalidKey) for r in res[:4])
    assert res[4] is None
    assert c.get("good-key") == b"5"
    for k in bad:
        with pytest.raises(E.InvalidKey):
            c.put(k, b"z")
        with pytest.raises(E.InvalidKey):
            c.get(k)
        with pytest.raises(E.InvalidKey):
            c.exists(k)
        with pytest.raises(E.InvalidKey):
            c.remove(k)
    with pytest.raises(E.InvalidKey):
        c.put(b"bytes-key", b"z")  # keys are str


def test_size_mismatches_and_unregistered_buffers(env):
    cl, peer, c = env
    c.put("size-a", b"q" * 10_000)
    buf = np.full(20_000, 0xEE, np.uint8)
    c.register_buffer(buf)
    with pytest.raises(E.BufferOverflow):
        c.get_into("size-a", buf, 0, 5000)  # object is bigger than the room given
    assert (buf == 0xEE).all()  # nothing was written
    with pytest.raises(E.InvalidParams):
        c.put_from("size-b", buf, 15_000, 10_000)  # reaches past the registered buffer
    with pytest.raises(E.InvalidParams):
        c.put_from(["size-c", "size-d"], buf, [0, 10], [5])  # sizes list of the wrong length
    assert c.get_into("size-a", buf, 100, 10_000) == 10_000
    assert bytes(buf[100:10_100]) == b"q" * 10_000
    other = np.zeros(4096, np.uint8)
    with pytest.raises(E.NotRegistered):
        c.put_from("size-e", other, 0, 100)
    with pytest.raises(E.NotRegistered):
        c.get_into("size-a", other, 0, 4096)
    res = c.get_into(["size-a", "size-a"], [buf, other], [0, 0], [10_000, 4096])
    assert res[0] == 10_000 and isinstance(res[1], E.NotRegistered)
    c.unregister_buffer(buf)
    with pytest.raises(E.NotRegistered):
        c.get_into("size-a", buf, 0, 10_000)
    assert c.exists(["size-b", "size-e"]) == [False, False]


def test_wrong_token_is_refused(env):
    cl, peer, c = env
    t0 = time.monotonic()
    bad = StoreClient(cl.address, token="not-the-token", timeout=15)
    try:
        with pytest.raises(E.StoreUnavailable):
            bad.exists("single-a")
    finally:
        bad.close()
    # Refused, not retried until the 15 s deadline (slack for a loaded machine).
    assert time.monotonic() - t0 < 8


def test_tensor_helpers(env):
    torch = pytest.importorskip("torch")
    cl, peer, c = env
    t = torch.arange(1000, dtype=torch.float32)
    c.put_tensor("tensor-a", t)
    out = torch.zeros(1000, dtype=torch.float32)
    c.get_tensor("tensor-a", out)
    assert torch.equal(out, t)
    reg = torch.zeros(1000, dtype=torch.float32)
    c.register_buffer(reg)
    c.get_tensor("tensor-a", reg)  # zero-copy path
    assert torch.equal(reg, t)
    c.unregister_buffer(reg)


def test_forced_remove_holds_leased_bytes_until_the_lease_ends(env):
    cl, peer, c = env
    time.sleep(LEASE_S + 0.2)
    c.put("hold-a", b"h" * 100_000)
    assert c.get("hold-a") == b"h" * 100_000  # lease taken
    c.remove("hold-a", force=True)
    assert c.exists("hold-a") is False
    held = c.status()["usage"]["held_bytes"]
    assert held >= 100_000  # invisible, but not reusable while the reader may copy
    deadline = time.monotonic() + LEASE_S + 5
    while c.status()["usage"]["held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.status()["usage"]["held_bytes"] == 0  # released by the leader after the lease


def test_retried_requests_apply_once(env):
    """The same (client, seq) sent twice returns the first result (replog sessions)."""
    cl, peer, c = env
    rpc = c.rpc
    cid = rpc._session()
    seq = 10_000_000  # far from the client's own counter
    keys = ["retry-a", "retry-b"]
    mk = lambda rid: P.PutStartReq(rid, P.Session(cid, seq, 0), keys, [1000, 2000], c.config)  # noqa: E731
    r1 = rpc.call(mk)
    r2 = rpc.call(mk)
    assert type(r1) is P.PutStartResp and r1.codes == [0, 0]
    assert r2.codes == r1.codes and r2.versions == r1.versions and r2.copies() == r1.copies()
    assert r1.run is not None and r2.run == r1.run  # a batch of small objects: compact copies
    assert [len(c) for c in r1.copies()] == [1, 1]  # type: ignore[arg-type]
    end = lambda rid: P.PutEndReq(rid, P.Session(cid, seq + 1, 0), keys, r1.versions)  # noqa: E731
    assert rpc.call(end).codes == [0, 0]
    assert rpc.call(end).codes == [0, 0]  # not InvalidWrite: the cached answer
    time.sleep(LEASE_S + 0.2)
    rm = lambda rid: P.RemoveReq(rid, P.Session(cid, seq + 2, 0), keys + ["retry-none"])  # noqa: E731
    first = rpc.call(rm).codes
    assert first[:2] == [0, 0] and first[2] == E.ObjectNotFound.code
    assert rpc.call(rm).codes == first  # not ObjectNotFound for the removed keys


def test_one_client_shared_by_threads(env):
    """SGLang calls one client from several threads: batches interleave, every byte right."""
    import threading

    cl, peer, c = env
    errors: list[str] = []

    def work(t: int) -> None:
        for r in range(5):
            keys = [f"thr-{t}-{r}-{i}" for i in range(16)]
            vals = [value_of(k, 3000 + 100 * i) for i, k in enumerate(keys)]
            res = c.put(keys, vals)
            if not res.ok:
                errors.append(f"put {res.codes}")
            got = c.get(keys)
            if got != vals:
                errors.append(f"thread {t} round {r}: wrong bytes")
            if c.exists(keys) != [True] * 16:
                errors.append("exists")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]


def test_a_forgotten_session_is_told_by_its_code_and_the_client_starts_a_new_one(env):
    """A live master answers a session it does not know with SESSION_EXPIRED (not a message
    to match), and the client resends the command once in a new session."""
    cl, peer, c = env
    rpc = c.rpc
    r = rpc.call(lambda rid: P.RemoveReq(rid, P.Session(987_654_321, 1, 0), ["nobody"]))
    assert type(r) is P.ErrorResp and r.code == E.Code.SESSION_EXPIRED and not r.retry
    c.put("forgotten-session", b"x" * 100)
    before = rpc._session()
    rpc._client_id = 987_654_321  # as if the master had expired our session
    c.remove("forgotten-session")  # raises on an error
    assert rpc._session() not in (before, 987_654_321)
    assert c.exists("forgotten-session") is False
