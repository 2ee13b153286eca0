"""The batch key check (``keys_valid``) accepts exactly what ``key_error`` accepts key by key.

``StoreClient.exists`` checks a whole batch at once and only falls back to the per-key check
when the batch check declines; so the batch check must never accept a batch holding a key
that ``key_error`` refuses. Random batches over the characters that matter (NUL, non-ASCII,
4-byte code points, lone surrogates of both halves) at the lengths that matter (empty, the
ASCII and the 4-bytes-per-character limits and one past them) are compared with the per-key
answer; a planted check without its NUL test is caught.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvmesh.store import errors as E
from kvmesh.store.types import MAX_KEY_BYTES, key_error, keys_valid

ALPHABET = ["a", "z", "\0", "é", "\U0001f600", "\ud800", "\udc00"]
LENGTHS = [0, 1, 2, 255, 256, 257, 300, MAX_KEY_BYTES // 2, MAX_KEY_BYTES, MAX_KEY_BYTES + 1]
FIXED: list[list[Any]] = [
    [], ["a"], ["a", ""], ["x" * MAX_KEY_BYTES], ["x" * (MAX_KEY_BYTES + 1)],
    ["é" * (MAX_KEY_BYTES // 2)], ["é" * (MAX_KEY_BYTES // 2 + 1)], ["\ud800"], ["a", "\udc00"],
    ["\ud800", "\udc00"],  # two halves that would pair up in the joined batch
    ["\U0001f600" * (MAX_KEY_BYTES // 4)], ["\U0001f600" * (MAX_KEY_BYTES // 4 + 1)],
    [b"bytes"], ["a", 1], [type("Sub", (str,), {})("a")], ["ok"] * 600, ["a\0"],
]  # fmt: skip


def batches(n: int, seed: int = 7) -> list[list[Any]]:
    rng = random.Random(seed)
    out = list(FIXED)
    for _ in range(n):
        out.append([
            "".join(rng.choice(ALPHABET) for _ in range(rng.choice(LENGTHS)))
            if rng.random() < 0.3
            else "".join(rng.choice("abcé") for _ in range(rng.choice(LENGTHS)))
            for _ in range(rng.randint(1, 4))
        ])  # fmt: skip
    return out


def wrong_accepts(check: Callable[[list[Any]], bool], cases: list[list[Any]]) -> list[list[Any]]:
    return [c for c in cases if check(c) and any(key_error(k) is not None for k in c)]


def test_batch_check_never_accepts_what_the_per_key_check_refuses():
    cases = batches(4000)
    assert wrong_accepts(keys_valid, cases) == []
    # It does its job: valid batches of plain str keys are accepted at once when ASCII (the
    # hot path) or short enough that no UTF-8 encoding can pass the limit.
    fast = [
        c for c in cases
        if c and all(type(k) is str and key_error(k) is None for k in c)
        and (all(k.isascii() for k in c) or max(map(len, c)) * 4 <= MAX_KEY_BYTES)
    ]  # fmt: skip
    assert len(fast) > 100 and all(keys_valid(c) for c in fast)


def test_a_batch_check_without_its_nul_test_is_caught():
    def planted(keys: list[Any]) -> bool:  # keys_valid blind to NUL
        return keys_valid([k.replace("\0", "a") if type(k) is str else k for k in keys])

    assert wrong_accepts(planted, batches(500))


def test_exists_batch_mixes_per_key_errors_with_answers():
    from kvmesh.store.client import StoreClient

    with StoreClient(segment_size=1 << 20) as c:
        assert c.put("there", b"x") is None
        res = c.exists(["there", "", "missing", "nul\0key", "\udc80", "there"])
        assert res[0] is True and res[2] is False and res[5] is True
        assert all(isinstance(res[i], E.InvalidKey) for i in (1, 3, 4))
        keys = [f"k{i}" for i in range(300)]
        assert c.put(keys[::2], [b"v"] * 150).ok
        assert list(c.exists(keys)) == [i % 2 == 0 for i in range(300)]


def test_exists_refuses_a_reply_of_the_wrong_length(monkeypatch):
    from kvmesh.store import protocol as P
    from kvmesh.store.client import StoreClient

    with StoreClient(segment_size=1 << 20) as c:
        real = c.rpc.call

        def short(make: Any, **kw: Any) -> Any:
            resp = real(make, **kw)
            return P.CodesResp(resp.rid, resp.codes[:-1]) if type(resp) is P.CodesResp else resp

        monkeypatch.setattr(c.rpc, "call", short)
        res = c.exists(["a", "b", "c"])
        assert all(isinstance(r, E.StoreError) for r in res)


# --------------------------------------------------------------------------- by parts


PARTS = ["", "a/", "/tp0of1/k", "\0", "é", "\ud800", "x" * 500, "x" * (MAX_KEY_BYTES - 1)]


def _expanded_ok(prefix: str, keys: list[Any], suffixes: list[str]) -> bool:
    return all(key_error(k) is None for k in keys) and all(
        key_error(prefix + k + s) is None for k in keys for s in suffixes
    )


def parts_cases() -> list[tuple[str, list[Any], list[str]]]:
    rng = random.Random(11)
    cases = [(p, b, [s]) for p in PARTS for s in PARTS for b in batches(3, seed=3)[:40]]
    for _ in range(3000):
        sufs = [rng.choice(PARTS) for _ in range(rng.randint(1, 3))]
        cases.append((rng.choice(PARTS), rng.choice(batches(1, seed=rng.randint(0, 99))), sufs))
    return [c for c in cases if c[1]]  # no keys, no names (bad parts are refused even then)


def parts_mismatches(check: Callable[..., str | None], cases: list) -> list:
    """Cases where ``check`` answers otherwise than the per-name check of every name."""
    out = []
    for prefix, keys, sufs in cases:
        if not all(isinstance(k, str) for k in keys):
            ok = False
        else:
            ok = _expanded_ok(prefix, keys, sufs)
        if (check(prefix, keys, sufs) is None) != ok:
            out.append((prefix, keys, sufs))
    return out


def test_parts_check_accepts_exactly_the_valid_names():
    """``bad_parts`` (the master's check of an ExistsPartsReq, names never built) answers as
    the per-name check of every ``prefix + key + suffix`` does, keys themselves valid."""
    from kvmesh.store.types import bad_parts

    cases = parts_cases()
    assert parts_mismatches(bad_parts, cases) == []
    valid = sum(_expanded_ok(*c) for c in cases if all(isinstance(k, str) for k in c[1]))
    assert valid > 200 and len(cases) - valid > 200  # both answers well represented
    assert bad_parts("p", ["a"], []) is not None  # no suffix: no names


def test_a_parts_check_without_its_length_sum_is_caught():
    from kvmesh.store import types as T

    def planted(prefix: str, keys: list[Any], suffixes: list[str]) -> str | None:
        # every part checked on its own, the joined length never
        if not suffixes:
            return "no suffixes"
        return T.bad_key(keys) or next(
            (
                f"part {x!r}"
                for x in (prefix, *suffixes)
                if "\0" in x or x != x.encode("utf-8", "replace").decode()
            ),
            None,
        )

    assert parts_mismatches(planted, parts_cases())


def test_exists_by_parts_answers_as_exists_by_name():
    from kvmesh.store.client import StoreClient

    with StoreClient(segment_size=1 << 20) as c:
        keys = [f"h{i:03d}" for i in range(300)]
        sufs = ["/r0/k", "/r0/v"]
        names = [f"ns/m/{k}{s}" for k in keys for s in sufs]
        there = names[: 2 * 100] + names[2 * 150 + 1 : 2 * 200]  # page 150 has only its V
        assert c.put(there, [b"v"] * len(there)).ok
        by_name = list(c.exists(names))
        assert list(c.exists(keys, prefix="ns/m/", suffixes=sufs)) == by_name
        assert by_name.index(False) == 200 and sum(by_name) == len(there)
        assert list(c.exists(keys, prefix="ns/m/", suffixes=["/r0/k"])) == by_name[::2]
        assert list(c.exists("h000", prefix="ns/m/", suffixes=sufs)) == [True, True]
        # an invalid part: answered name by name, per-name errors beside the answers
        res = c.exists(["h000", "bad\0"], prefix="ns/m/", suffixes=sufs)
        assert res[0] is True and res[1] is True
        assert isinstance(res[2], E.InvalidKey) and isinstance(res[3], E.InvalidKey)
        # more names than one request takes: split, same answers
        many = [f"m{i}" for i in range(3000)]
        assert c.put([f"p{k}/a" for k in many[::3]], [b"v"] * 1000).ok
        got = list(c.exists(many, prefix="p", suffixes=["/a", "/b"]))
        assert got == [(i % 3 == 0) and j == 0 for i in range(3000) for j in range(2)]


def _leading_of(flags: list[Any], per: int) -> int:
    ok = [f is True for f in flags]
    return ok.index(False) // per if False in ok else len(ok) // per


def test_count_leading_is_the_prefix_of_exists_by_parts():
    """``count_leading`` (the master counts: ``ExistsPartsReq(leading=True)`` answered by one
    int) equals the leading run of keys whose every name ``exists`` by parts reports, for
    random holes at every position, one or two suffixes, across request splits, and when
    a name is invalid (answered name by name: the invalid key ends the count)."""
    from kvmesh.store.client import StoreClient

    rng = random.Random(11)
    with StoreClient(segment_size=1 << 20) as c:
        keys = [f"c{i:04d}" for i in range(1200)]  # 2 suffixes: 2 requests of <= 1024 names
        sufs = ["/r0/k", "/r0/v"]
        names = [f"ns/c/{k}{s}" for k in keys for s in sufs]
        holes = {rng.randrange(len(names)) for _ in range(40)} | {2 * 700 + 1, 2 * 1100}
        there = [n for i, n in enumerate(names) if i not in holes]
        assert c.put(there, [b"v"] * len(there)).ok
        for _ in range(60):
            lo = rng.randrange(len(keys))
            ks = keys[lo : lo + rng.choice([1, 5, 300, 900, 1200])]
            for sf in (sufs, sufs[1:]):
                want = _leading_of(list(c.exists(ks, prefix="ns/c/", suffixes=sf)), len(sf))
                assert c.count_leading(ks, prefix="ns/c/", suffixes=sf) == want
        # a run past one request: the count continues into the second
        full = [k for k in keys if not any(2 * keys.index(k) + j in holes for j in (0, 1))]
        assert c.count_leading(full[:1100], prefix="ns/c/", suffixes=sufs) == 1100
        assert c.count_leading([], prefix="ns/c/", suffixes=sufs) == 0
        assert c.count_leading(["x"], prefix="nothing/") == 0
        assert c.count_leading([f"ns/c/{keys[0]}/r0/k"]) == int(0 not in holes)
        # an invalid key: asked name by name, the count stops there
        ok3 = full[:3]
        assert c.count_leading([*ok3, "bad\0", full[3]], prefix="ns/c/", suffixes=sufs) == 3


def test_count_leading_takes_an_old_master_and_refuses_a_forged_count(monkeypatch):
    """A master that predates ``leading`` ignores the field and answers a code per name: the
    client counts them itself. A count that cannot be (negative, past the keys asked, not an
    int) is an error, never a hit."""
    from kvmesh.store import protocol as P
    from kvmesh.store.client import StoreClient

    with StoreClient(segment_size=1 << 20) as c:
        keys = [f"o{i}" for i in range(10)]
        assert c.put([f"p/{k}/a" for k in keys[:6]], [b"v"] * 6).ok
        assert c.put([f"p/{k}/b" for k in keys[:4]], [b"v"] * 4).ok
        assert c.count_leading(keys, prefix="p/", suffixes=["/a", "/b"]) == 4
        real = c.rpc.call

        def old_master(make: Any, *a: Any, **k: Any) -> Any:
            def strip(rid: int) -> Any:
                req = make(rid)
                if type(req) is P.ExistsPartsReq:  # as an old master decodes it
                    return P.ExistsPartsReq(rid, req.prefix, req.keys, req.suffixes)
                return req

            return real(strip, *a, **k)

        monkeypatch.setattr(c.rpc, "call", old_master)
        assert c.count_leading(keys, prefix="p/", suffixes=["/a", "/b"]) == 4
        assert c.count_leading(keys, prefix="p/", suffixes=["/a"]) == 6
        for forged in (-1, 11, True):
            monkeypatch.setattr(c.rpc, "call", lambda make, *a, f=forged, **k: P.CountResp(1, f))
            with pytest.raises(E.StoreError):
                c.count_leading(keys, prefix="p/", suffixes=["/a"])


def test_a_count_that_checks_one_suffix_only_is_caught(monkeypatch):
    """Planted: the master counts a key when its first name exists (K without V)."""
    from kvmesh.store.client import StoreClient
    from kvmesh.store.master.state import StoreStateMachine

    def planted(self: Any, prefix: str, keys: list[str], suffixes: list[str]) -> int:
        codes = self.exists_codes(prefix, keys, suffixes[:1])
        return codes.index(0) if 0 in codes else len(keys)

    with StoreClient(segment_size=1 << 20) as c:
        assert c.put(["q/a/k", "q/a/v", "q/b/k"], [b"v"] * 3).ok
        assert c.count_leading(["a", "b"], prefix="q/", suffixes=["/k", "/v"]) == 1
        monkeypatch.setattr(StoreStateMachine, "exists_leading", planted)
        assert c.count_leading(["a", "b"], prefix="q/", suffixes=["/k", "/v"]) == 2
