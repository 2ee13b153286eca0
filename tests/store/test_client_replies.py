"""The client's one reply fan-out (``client.replies.fan_out``), its request-sized parts, and
the session-loss rule of ``rpc.MasterClient.mutate`` (by error code, retried once in a new
session; never after ``result_evicted``)."""

from __future__ import annotations

import pytest

from kvmesh.store import errors as E
from kvmesh.store import protocol as P
from kvmesh.store import rpc
from kvmesh.store.client import replies as R


def test_fan_out_spreads_codes_or_one_error_over_the_part():
    keys = ["a", "b", "c", "d"]
    out: list = [None] * 4
    part = [0, 2, 3]
    ok = R.fan_out(out, part, P.CodesResp(1, [0, -704, 0]), P.CodesResp, ("codes",),
                   R.coded("remove", keys, part))  # fmt: skip
    assert ok and out[0] is None and out[1] is None and out[3] is None
    assert isinstance(out[2], E.ObjectNotFound) and "'c'" in str(out[2])
    # A reply of the right kind but the wrong length (a forged master): one error for all.
    out = [None] * 4
    assert not R.fan_out(out, part, P.CodesResp(1, [0, 0]), P.CodesResp, ("codes",), bool)
    assert all(isinstance(out[i], E.StoreError) for i in part) and out[1] is None
    # An error reply: its code's class for every key of the part (a range: by slice).
    out = [None] * 4
    err = P.ErrorResp(1, E.Code.OBJECT_HAS_LEASE, "leased")
    assert not R.fan_out(out, range(1, 3), err, P.CodesResp, ("codes",), bool)
    assert out[0] is None and out[3] is None
    assert all(type(out[i]) is E.ObjectHasLease for i in (1, 2))
    # Values with the codes, a range part written by slice.
    out = [None] * 3
    sizes = P.SizesResp(1, [0, -704, 0], [10, 0, 30])
    each = R.coded("get_size", keys, range(3))
    assert R.fan_out(out, range(3), sizes, P.SizesResp, ("codes", "sizes"), each)
    assert out[0] == 10 and isinstance(out[1], E.ObjectNotFound) and out[2] == 30


def test_rpc_parts_bound_names_per_request():
    keys = [f"k{i}" for i in range(R.MAX_KEYS_PER_RPC * 2 + 5)]
    parts = R.rpc_parts(keys)
    assert [len(p) for p in parts] == [R.MAX_KEYS_PER_RPC, R.MAX_KEYS_PER_RPC, 5]
    assert all(type(p) is range for p in parts)
    # By parts: each key stands for ``per`` names, so fewer keys go in one request.
    parts = R.rpc_parts(keys[:1000], per=8)
    assert [len(p) for p in parts] == [R.MAX_KEYS_PER_RPC // 8, 1000 - R.MAX_KEYS_PER_RPC // 8]
    idx = list(range(1, len(keys), 2))
    got = R.rpc_parts(keys, idx)
    assert [i for p in got for i in p] == idx and max(map(len, got)) <= R.MAX_KEYS_PER_RPC
    assert R.rpc_parts([]) == [] and R.rpc_parts(keys, [], key_bytes=True) == []


class _Scripted(rpc.MasterClient):
    """A MasterClient whose master is a script of replies (no sockets)."""

    def __init__(self, replies: list) -> None:
        super().__init__(["127.0.0.1:1"], timeout=1.0)
        self.replies = replies
        self.sent: list = []
        self.registered = 0

    def call(self, make, *, timeout=None):
        req = make(len(self.sent) + 1)
        self.sent.append(req)
        if type(req) is P.RegisterReq:
            self.registered += 1
            return P.RegisterResp(req.rid, 100 + self.registered)
        return self.replies.pop(0)


def _remove(rpc_client: _Scripted):
    return rpc_client.mutate(lambda rid, s: P.RemoveReq(rid, s, ["k"], False))


def test_a_lost_session_is_told_by_its_code_and_resent_once_in_a_new_one():
    lost = P.ErrorResp(1, E.Code.SESSION_EXPIRED, "the master forgot it")
    c = _Scripted([lost, P.CodesResp(2, [0])])
    assert _remove(c) == P.CodesResp(2, [0])
    removes = [r for r in c.sent if type(r) is P.RemoveReq]
    assert c.registered == 2 and [r.session.client_id for r in removes] == [101, 102]
    # Lost again in the new session: answered, not resent forever.
    c = _Scripted([lost, lost])
    assert _remove(c) is lost and c.registered == 2
    # Any other error (the same code class, another meaning) is the answer: not resent.
    other = P.ErrorResp(1, E.Code.RPC_FAIL, "stopped: shutting down")
    c = _Scripted([other])
    assert _remove(c) is other and c.registered == 1


@pytest.mark.parametrize(
    ("resp", "lost"),
    [
        (P.ErrorResp(1, E.Code.SESSION_EXPIRED, ""), True),
        # A message is never read for the meaning: only the code says a session was lost.
        (P.ErrorResp(1, E.Code.RPC_FAIL, "session: session 7 seq 3: unknown"), False),
        (P.ErrorResp(1, E.Code.RPC_FAIL, "session: session 7 seq 3: result_evicted"), False),
        (P.ErrorResp(1, E.Code.INTERNAL_ERROR, "session: not that"), False),
        (P.ErrorResp(1, E.Code.RPC_FAIL, "stopped: session: x"), False),
    ],
)
def test_session_lost_reads_the_code(resp, lost):
    assert rpc.session_lost(resp) is lost
    assert isinstance(E.error_for(E.Code.SESSION_EXPIRED), E.StoreUnavailable)
