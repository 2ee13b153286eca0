"""Bad input is refused where it is made (issue 16, part 4), against a live master process.

* A wrong-typed :class:`ReplicateConfig` is refused when it is built, and a put given
  something else as its config raises InvalidParams at once; one forced past those checks is
  answered InvalidParams by the master (an error reply, not a dropped connection that the
  client would retry until its deadline and report as StoreUnavailable).
* ``get_into`` refuses offsets and sizes that are not ints (1.5 used to land at 1, "64" was
  parsed), on both its one-buffer (numpy) and per-key paths, and leaves the buffer as it was.
* Addresses with a port outside 0..65535 and wrong-typed security configs are refused when
  the client is built (99999 used to reach port 34463; a str security raised AttributeError).
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from kvmesh.net.security import SecurityConfig
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store.cluster import StoreCluster
from kvmesh.store.types import ReplicateConfig

from .e2e_util import TOKEN


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    cl = StoreCluster(str(tmp_path_factory.mktemp("inputs")), 1, token=TOKEN, durability="memory")
    cl.start_all()
    client = StoreClient(cl.address, token=TOKEN, timeout=10, segment_size=8 << 20)
    try:
        yield cl, client
    finally:
        client.close()
        cl.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"preferred_segment": 123},
        {"strategy": "bogus"},
        {"replica_num": "2"},
        {"replica_num": 2.0},
        {"replica_num": True},
        {"writer_host": b"h"},
        {"soft_pin": 1},
        {"hard_pin": "yes"},
    ],
)
def test_a_wrong_typed_replicate_config_is_refused_when_built(kw):
    with pytest.raises(E.InvalidParams, match=next(iter(kw))):
        ReplicateConfig(**kw)


def test_a_put_with_a_config_that_is_not_one_raises_at_once(live):
    _, client = live
    for bad in ("x", {"replica_num": 1}, 3):
        t0 = time.monotonic()
        with pytest.raises(E.InvalidParams, match="ReplicateConfig"):
            client.put("cfg-single", b"v", config=bad)
        with pytest.raises(E.InvalidParams, match="ReplicateConfig"):
            client.put(["cfg-a", "cfg-b"], [b"a", b"b"], config=bad)
        # Refused without a master round trip (the bug: 10 s of retries, StoreUnavailable).
        assert time.monotonic() - t0 < client.rpc.timeout / 2
    assert not any(client.exists(["cfg-single", "cfg-a", "cfg-b"]))
    assert client.put("cfg-ok", b"v", config=ReplicateConfig(strategy="most_free")) is None
    assert client.get("cfg-ok") == b"v"


def test_a_config_forced_past_the_checks_gets_the_masters_error_reply(live):
    """The master's answer to an undecodable request is InvalidParams, which the client
    reports at once (the old master dropped the connection: StoreUnavailable after 10 s)."""
    _, client = live
    bad = ReplicateConfig()
    msgspec.structs.force_setattr(bad, "strategy", "bogus")
    t0 = time.monotonic()
    with pytest.raises(E.InvalidParams, match="undecodable"):
        client.put("forced", b"v", config=bad)
    res = client.put(["forced-a", "forced-b"], [b"a", b"b"], config=bad)
    assert [type(r) for r in res] == [E.InvalidParams, E.InvalidParams]
    assert time.monotonic() - t0 < client.rpc.timeout / 2
    assert not any(client.exists(["forced", "forced-a", "forced-b"]))
    assert client.put("forced", b"ok") is None  # the client and its connections still work
    assert client.get("forced") == b"ok"


def test_get_into_refuses_offsets_and_sizes_that_are_not_ints(live):
    _, client = live
    assert client.put(["gi-0", "gi-1"], [b"\x11" * 64, b"\x22" * 64]).ok
    buf = np.zeros(4096, np.uint8)
    client.register_buffer(buf)
    try:
        bad_calls = [
            ("gi-0", 1.5, 64),  # one key: used to read into buf[1:]
            ("gi-0", 0, "64"),  # used to be parsed as 64
            ("gi-0", np.float64(2.0), None),
            ("gi-0", True, None),
            (["gi-0", "gi-1"], [0, 1.5], [64, 64]),  # one buffer: the numpy path
            (["gi-0", "gi-1"], [0, 128], ["64", "64"]),
            (["gi-0", "gi-1"], 2.5, None),
            (["gi-0", "gi-1"], np.array([0.0, 128.0]), None),
        ]
        for keys, offs, sizes in bad_calls:
            with pytest.raises(E.InvalidParams, match="must be ints"):
                client.get_into(keys, buf, offs, sizes)
        # The per-key path (one raw address per key) checks the same.
        addr = buf.ctypes.data
        with pytest.raises(E.InvalidParams, match="must be ints"):
            client.get_into(["gi-0", "gi-1"], [addr, addr], [0, 0.5], [64, 64])
        assert not buf.any()  # nothing was read anywhere
        # ints of every kind still work
        assert client.get_into("gi-0", buf, np.int32(0), np.int64(64)) == 64
        res = client.get_into(["gi-0", "gi-1"], buf, np.array([64, 128], np.uint32), [64, 64])
        assert list(res) == [64, 64]
        assert bytes(buf[:192]) == b"\x11" * 128 + b"\x22" * 64
    finally:
        client.unregister_buffer(buf)


def test_addresses_and_security_are_checked_when_the_client_is_built():
    for addr in ("127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:", "127.0.0.1:x1"):
        with pytest.raises(ValueError, match="bad address"):
            StoreClient(addr, token=TOKEN, segment_size=0)
    with pytest.raises(TypeError, match="SecurityConfig"):
        StoreClient("127.0.0.1:7700", security="not a config", segment_size=0)
    with pytest.raises(TypeError, match="token"):
        StoreClient("127.0.0.1:7700", token=5, segment_size=0)
    with pytest.raises(TypeError, match="allow_insecure"):
        SecurityConfig(token="t", allow_insecure="no")
