"""A fake master lies to a real :class:`~kvmesh.store.StoreClient`: GetReplicas tables that
name real bytes of a live storage node (another process) at offsets past its segment,
segments the client never saw, unreachable endpoints, malformed rows and ints beyond int64;
and replies trickled a byte at a time. The client must answer each read with a per-key
:class:`~kvmesh.store.errors.StoreError` (never another exception), leave every byte of the
caller's buffer it was not told to fill untouched, and spend bounded CPU and time waiting."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvmesh.net import framing
from kvmesh.net.handshake import server_handshake
from kvmesh.net.security import SecurityConfig
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import ROW, ObjectReplica, ReplicaDesc, ReplicaRun
from kvmesh.transfer import Op

from .e2e_util import TOKEN, Peer
from .store_peer import value_of

SEGMENT = 8 << 20
SIZE = 4096
CANARY = 0xAB


class FakeMaster:
    """Authenticates like a master (same token), then answers every request with
    ``answer(req)``: a response Struct, or raw bytes sent ``trickle`` seconds apart."""

    def __init__(self, answer: Callable[[Any], Any], trickle: float = 0.0) -> None:
        self.answer = answer
        self.trickle = trickle
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                s, _ = self.srv.accept()
            except OSError:
                return
            self._socks.append(s)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        try:
            server_handshake(s, SecurityConfig(token=TOKEN), P.SERVICE, "fake-master", 5.0)
            while not self._stop:
                req = P.decode_request(framing.read_frame(s, 1 << 24))
                out = self.answer(req)
                data = out if isinstance(out, bytes) else framing.encode_frame(P.encode(out))
                if not self.trickle:
                    s.sendall(data)
                    continue
                for i in range(len(data)):
                    if self._stop:
                        return
                    s.sendall(data[i : i + 1])
                    time.sleep(self.trickle)
        except (OSError, ValueError, framing.PeerClosed):
            pass
        except Exception:  # noqa: BLE001 - a fake server thread: end the connection quietly
            pass
        finally:
            s.close()

    def close(self) -> None:
        self._stop = True
        self.srv.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A real master, a storage node process holding two real objects, and the real table
    of those objects (what an honest master answers)."""
    cl = StoreCluster(str(tmp_path_factory.mktemp("forged")), 1, token=TOKEN, durability="memory")
    cl.start_all()
    node = None
    honest = None
    try:
        node = Peer(cl.address, SEGMENT)
        assert node.call(op="put", keys=["real0", "real1"], sizes=[SIZE, SIZE])["codes"] == [0, 0]
        honest = StoreClient(cl.address, token=TOKEN, segment_size=0, timeout=10)
        table = honest.rpc.call(
            lambda rid: P.GetReplicasReq(rid, ["real0", "real1"], honest.engine.host_id, True)
        )
        assert type(table) is P.ReplicaTableResp and table.codes == [0, 0]
        yield table
    finally:
        if honest is not None:
            honest.close()
        if node is not None:
            node.close()
        cl.close()


def _rows(table: P.ReplicaTableResp) -> list[list[int]]:
    return np.frombuffer(table.rows, "<i8").reshape(-1, ROW).tolist()


def _forge(table: P.ReplicaTableResp, n: int, **kw: Any) -> Callable[[Any], Any]:
    """An answer: ``table`` cut to its first ``n`` keys, with the fields in ``kw`` replaced
    (``rows`` as a list of row lists); the rid is the request's."""

    def answer(req: Any) -> Any:
        rows = kw.get("rows", [r for r in _rows(table) if r[0] < n])
        return P.ReplicaTableResp(
            req.rid,
            kw.get("codes", table.codes[:n]),
            kw.get("sizes", table.sizes[:n]),
            kw.get("segments", table.segments),
            np.asarray(rows, "<i8").reshape(-1, ROW).tobytes(),
            kw.get("lease_ms", table.lease_ms),
        )

    return answer


def _read(answer: Callable[[Any], Any], keys: list[str]) -> tuple[Any, np.ndarray, Any]:
    """``get_into`` and ``get`` of ``keys`` through a fake master answering ``answer``:
    (get_into results, the destination buffer, get results). Key i goes to
    ``[(2i + 1) * SIZE, (2i + 2) * SIZE)``; the rest of the buffer is a canary."""
    fake = FakeMaster(answer)
    client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=3, transfer_timeout=3)
    try:
        buf = np.full((2 * len(keys) + 1) * SIZE, CANARY, np.uint8)
        client.register_buffer(buf)
        offs = [(2 * i + 1) * SIZE for i in range(len(keys))]
        res = client.get_into(keys, buf, offs, [SIZE] * len(keys))
        got = client.get(keys)
        client.unregister_buffer(buf)
        return res, buf, got
    finally:
        client.close()
        fake.close()


def _untouched(buf: np.ndarray, filled: set[int]) -> bool:
    """Every byte is the canary, except the destinations of the keys in ``filled``."""
    view = buf.copy()
    for i in filled:
        view[(2 * i + 1) * SIZE : (2 * i + 2) * SIZE] = CANARY
    return bool((view == CANARY).all())


def test_the_fake_master_serves_an_honest_table(live):
    """The control: the real table through the fake master reads the real bytes, so every
    refusal below is the client's doing, not a broken harness."""
    res, buf, got = _read(_forge(live, 2), ["real0", "real1"])
    assert list(res) == [SIZE, SIZE]
    for i, k in enumerate(["real0", "real1"]):
        assert buf[(2 * i + 1) * SIZE : (2 * i + 2) * SIZE].tobytes() == value_of(k, SIZE)
        assert got[i] == value_of(k, SIZE)
    assert _untouched(buf, {0, 1})


def _forgeries(table: P.ReplicaTableResp) -> list[tuple[str, int, dict[str, Any]]]:
    """(what, keys, replaced fields): forged forms of the honest table; with two keys only
    key 1's row is forged, key 0 must still be read."""
    r0, r1 = (r for r in _rows(table))
    (name, node, ep) = table.segments[r1[2]]
    big = 1 << 62
    return [
        (
            "offset one byte past the segment",
            1,
            {"rows": [[0, 0, r0[2], SEGMENT - SIZE + 1, SIZE]]},
        ),
        ("offset at the segment's end", 1, {"rows": [[0, 0, r0[2], SEGMENT, SIZE]]}),
        ("offset near 2**63", 1, {"rows": [[0, 0, r0[2], (1 << 63) - SIZE, SIZE]]}),
        ("negative offset", 1, {"rows": [[0, 0, r0[2], -SIZE, SIZE]]}),
        ("segment index past the list", 1, {"rows": [[0, 0, len(table.segments), 0, SIZE]]}),
        ("a segment the node never had", 1, {"segments": [("kvmesh-forged-seg", node, ep)]}),
        ("an endpoint nobody serves", 1, {"segments": [(name, node, "127.0.0.1:1")]}),
        ("too few rows", 2, {"rows": [r0]}),
        ("slice shorter than the object", 1, {"rows": [[0, 0, r0[2], r0[3], SIZE - 1]]}),
        (
            "slices whose int64 sum wraps to the size",
            1,
            {"rows": [[0, 0, r0[2], 0, big]] * 3 + [[0, 0, r0[2], 0, big + SIZE]]},
        ),
        (
            "a size beyond int64",
            1,
            {"codes": [E.ObjectNotFound.code], "sizes": [(1 << 64) - 1], "rows": []},
        ),
        ("a code beyond int64", 1, {"codes": [(1 << 64) - 1], "sizes": [0], "rows": []}),
        ("rows for a key not found", 1, {"codes": [E.ObjectNotFound.code], "sizes": [0]}),
        ("lease already over", 1, {"lease_ms": -1000}),
        (
            "key 1 past the segment (key 0 honest)",
            2,
            {"rows": [r0, [1, 0, r1[2], SEGMENT - SIZE + 1, SIZE]]},
        ),
        (
            "key 1 in a segment never seen (key 0 honest)",
            2,
            {
                "segments": [*table.segments, ("kvmesh-forged-seg", node, ep)],
                "rows": [r0, [1, 0, len(table.segments), 0, SIZE]],
            },
        ),
    ]


def test_forged_tables_are_refused_without_touching_memory(live):
    failures = []
    for what, n, kw in _forgeries(live):
        keys = ["real0", "real1"][:n]
        try:
            res, buf, got = _read(_forge(live, n, **kw), keys)
        except Exception as e:  # noqa: BLE001 - collected: every forgery is checked
            failures.append(f"{what}: raised {type(e).__name__}: {e}")
            continue
        # A batch whose key 0 is honest still reads key 0 (with a forged key 1) unless the
        # whole table is malformed; the forged key is always an error.
        ok = {i for i, r in enumerate(res) if not isinstance(r, E.StoreError)}
        if n - 1 in ok or not all(isinstance(g, E.StoreError) for g in got[n - 1 : n]):
            failures.append(f"{what}: the forged key was read: {list(res)} / {got}")
        for i in ok:
            if res[i] != SIZE or buf[(2 * i + 1) * SIZE : (2 * i + 2) * SIZE].tobytes() != (
                value_of(keys[i], SIZE)
            ):
                failures.append(f"{what}: key {i} reported read with wrong bytes")
        # A refused key's own destination may hold a partial copy (a read cut at an
        # expired lease), never a byte outside the destinations the caller gave.
        if not _untouched(buf, set(range(n))):
            failures.append(f"{what}: bytes outside the keys' destinations were written")
    assert not failures, failures


def _cpu_wall(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    t0, c0 = time.monotonic(), time.thread_time()
    try:
        out: Any = fn()
    except E.StoreError as e:
        out = e
    return out, time.thread_time() - c0, time.monotonic() - t0


def test_a_trickled_reply_costs_bounded_cpu_and_time():
    """A master that sends its replies a byte every 20 ms: the reply is still read (the
    spin budget is spent once per reply, not per byte: CPU far below the wait); one that
    announces a large reply and trickles forever is cut at the client's deadline."""
    fake = FakeMaster(lambda req: P.CodesResp(req.rid, [1, 0, 1]), trickle=0.02)
    client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=10, spin_us=10_000)
    try:
        out, cpu, wall = _cpu_wall(lambda: client.exists(["a", "b", "c"]))
        assert list(out) == [True, False, True]
        assert wall > 0.2 and cpu < 0.3 * wall, (cpu, wall)
    finally:
        client.close()
        fake.close()
    endless = framing.HEADER.pack(1 << 20) + b"\x00" * (1 << 20)
    fake = FakeMaster(lambda req: endless, trickle=0.02)
    client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=1.5, spin_us=10_000)
    try:
        out, cpu, wall = _cpu_wall(lambda: client.exists(["a"]))
        assert isinstance(out, E.StoreUnavailable), out
        assert wall < 5.0 and cpu < 0.3 * wall, (cpu, wall)
    finally:
        client.close()
        fake.close()


SECRET = 0x5E  # the caller's bytes next to the key's: never to leave this process


def _put_answer(copies: Any = None, run: Any = None) -> Callable[[Any], Any]:
    """A fake master that registers sessions, answers PutStart with ``copies`` (or
    ``run``) for the one key, and acknowledges PutEnd/PutRevoke."""

    def answer(req: Any) -> Any:
        if type(req) is P.RegisterReq:
            return P.RegisterResp(req.rid, 77)
        if type(req) is P.PutStartReq:
            return P.PutStartResp(req.rid, [0], [] if run else [copies], [1], 60_000, run)
        return P.CodesResp(req.rid, [0] * len(req.keys))

    return answer


def _segment_bytes(client: StoreClient, where: tuple[str, str, str], off: int, n: int) -> bytes:
    """``n`` bytes of the live node's segment at ``off`` (read with the transfer engine)."""
    name, _node, ep = where
    eng = client.engine
    dst = np.zeros(n, np.uint8)
    region = eng.register(dst)
    try:
        eng.transfer(Op.READ, region, [0], eng.open_segment(ep, name), [off], [n], timeout=5)
        return dst.tobytes()
    finally:
        eng.unregister(region)


def test_forged_put_answers_never_send_bytes_past_the_key(live):
    """A put answer whose copy is longer than the object (one slice or the compact run),
    or that gives a key answered 0 no copy at all: the key fails, nothing past its bytes
    leaves the caller's memory, and no put is reported done that wrote nothing. Each copy
    names free space of the live node's real segment, then read back."""
    seg = live.segments[0]
    cases = []
    for n, off in enumerate(range(SEGMENT // 2, SEGMENT // 2 + 5 * 4 * SIZE, 4 * SIZE)):
        longer = [ObjectReplica([ReplicaDesc(*seg, off, 2 * SIZE)])]
        split = [ObjectReplica([ReplicaDesc(*seg, off, SIZE), ReplicaDesc(*seg, off + SIZE, SIZE)])]
        run = ReplicaRun([seg], [0], [off], [2 * SIZE])
        cases.append(
            [
                ("one slice twice the size", _put_answer(longer), off, "flat"),
                ("two slices adding to twice the size", _put_answer(split), off, "flat"),
                ("a compact run twice the size", _put_answer(run=run), off, "flat"),
                ("no copy for a key answered 0", _put_answer([]), off, "flat"),
                ("one slice twice the size, multi-buffer put", _put_answer(longer), off, "multi"),
            ][n]
        )
    failures = []
    for what, answer, off, form in cases:
        fake = FakeMaster(answer)
        client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=3, transfer_timeout=3)
        buf = np.full(3 * SIZE, SECRET, np.uint8)
        buf[:SIZE] = np.frombuffer(value_of("w", SIZE), np.uint8)
        try:
            client.register_buffer(buf)
            if form == "flat":
                res = client.put_from(["w"], buf, [0], [SIZE])
            else:
                half = buf.ctypes.data
                res = client.put_from_multi(["w"], [[half, half + SIZE // 2]], [[SIZE // 2] * 2])
            if not isinstance(res[0], E.StoreError):
                failures.append(f"{what}: reported stored ({res[0]!r})")
            landed = _segment_bytes(client, seg, off, 2 * SIZE)
            if bytes([SECRET]) * 64 in landed:
                failures.append(f"{what}: the caller's bytes past the key reached the segment")
        except Exception as e:  # noqa: BLE001 - collected: every forgery is checked
            failures.append(f"{what}: raised {type(e).__name__}: {e}")
        finally:
            client.unregister_buffer(buf)
            client.close()
            fake.close()
    assert not failures, "\n".join(failures)


def test_short_answers_fail_the_batch_instead_of_reporting_success(live):
    """One code for a batch of two (GetSize, Remove, PutEnd): every key of the batch gets an
    error; none is reported sized, removed or stored on the strength of a missing code."""
    seg = live.segments[0]
    off = SEGMENT // 2 + 64 * SIZE

    def answer(req: Any) -> Any:
        t = type(req)
        if t is P.RegisterReq:
            return P.RegisterResp(req.rid, 78)
        if t is P.GetSizeReq:
            return P.SizesResp(req.rid, [0], [5])
        if t is P.PutStartReq:
            run = ReplicaRun([seg], [0, 0], [off, off + SIZE], [SIZE, SIZE])
            return P.PutStartResp(req.rid, [0, 0], [], [1, 2], 60_000, run)
        return P.CodesResp(req.rid, [0])  # Remove, PutEnd, PutRevoke

    fake = FakeMaster(answer)
    client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=3, transfer_timeout=3)
    buf = np.zeros(2 * SIZE, np.uint8)
    try:
        client.register_buffer(buf)
        results = {
            "get_size": client.get_size(["a", "b"]),
            "remove": client.remove(["a", "b"]),
            "put_from": client.put_from(["a", "b"], buf, [0, SIZE], [SIZE, SIZE]),
        }
        client.unregister_buffer(buf)
    finally:
        client.close()
        fake.close()
    wrong = {
        k: list(v) for k, v in results.items() if not all(isinstance(r, E.StoreError) for r in v)
    }
    assert not wrong, wrong


def test_a_master_answering_more_forever_ends_at_the_call_deadline():
    """A forged master answers every remove-by-prefix round with ``removed=1, more=True``:
    ``remove_prefix`` gives up at its own deadline with StoreTimeout instead of looping."""

    def answer(req: Any) -> Any:
        if type(req) is P.RegisterReq:
            return P.RegisterResp(req.rid, 78)
        return P.RemovePrefixResp(req.rid, 1, 0, True)

    fake = FakeMaster(answer)
    client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(E.StoreTimeout, match="removed so far"):
            client.remove_prefix("p/", timeout=0.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        client.close()
        fake.close()


def test_the_lease_counts_from_the_attempt_that_was_answered(live):
    """A master outage in the middle of a read: the first GetReplicas attempt is held for
    ``OUTAGE_S`` and its connection then dropped (a master that stalled and died); the retry
    is answered with the honest table under a lease shorter than the outage. The lease
    starts when the answered attempt left, so the fresh copy is read; counted from the
    first attempt (the old client), the lease had ended before the answer came, and every
    such read answered LeaseExpired."""
    outage_s, lease_ms = 3.0, 2500
    honest = _forge(live, 2, lease_ms=lease_ms)
    gets = []

    def answer(req: Any) -> Any:
        if type(req) is P.GetReplicasReq:
            gets.append(time.monotonic())
            if len(gets) == 1:
                time.sleep(outage_s)
                raise ConnectionResetError("the master went away")  # the connection drops
        return honest(req)

    fake = FakeMaster(answer)
    client = StoreClient(fake.addr, token=TOKEN, segment_size=0, timeout=20, transfer_timeout=5)
    try:
        buf = np.full(3 * SIZE, CANARY, np.uint8)
        client.register_buffer(buf)
        res = client.get_into(["real0", "real1"], buf, [0, 2 * SIZE], [SIZE, SIZE])
        assert len(gets) == 2 and gets[1] - gets[0] >= outage_s  # the outage happened
        assert list(res) == [SIZE, SIZE], list(res)
        assert buf[:SIZE].tobytes() == value_of("real0", SIZE)
        assert buf[2 * SIZE :].tobytes() == value_of("real1", SIZE)
        client.unregister_buffer(buf)
    finally:
        client.close()
        fake.close()
