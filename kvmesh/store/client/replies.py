"""Results of the client's batch calls and the one fan-out of a master reply over them:
per-key codes, or one whole-batch error for every key of the part; batches split into
request-sized parts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import errors as E
from ..rpc import reply_error as whole_error
from ..types import key_error, keys_valid

__all__ = [
    "BatchResults",
    "MAX_KEYS_PER_RPC",
    "MAX_KEY_BYTES_PER_RPC",
    "Removed",
    "Served",
    "fail_all",
    "fan_out",
    "finish",
    "coded",
    "invalid_key",
    "rpc_parts",
    "valid_indices",
    "whole_error",
]


MAX_KEYS_PER_RPC = 4096


MAX_KEY_BYTES_PER_RPC = 512 << 10
"""Key bytes of one mutating request: it becomes one log entry, and the log takes entries of
at most 1 MiB (keys may be 1 KiB, so 4096 of them would not fit)."""


def rpc_parts(
    keys: Sequence[Any],
    idx: list[int] | None = None,
    *,
    per: int = 1,
    key_bytes: bool = False,
) -> list[Sequence[int]]:
    """The indexes ``idx`` of ``keys`` (None: every key, as ranges) in consecutive parts, one
    request each: at most MAX_KEYS_PER_RPC names (each key stands for ``per`` names: exists
    by parts) and, with ``key_bytes`` (a mutating request, one log entry), at most
    MAX_KEY_BYTES_PER_RPC bytes of keys (a part of one key excepted)."""
    if key_bytes:
        return _key_byte_parts(list(range(len(keys))) if idx is None else idx, keys)
    step = max(1, MAX_KEYS_PER_RPC // per)
    if idx is None:
        n = len(keys)
        return [range(a, min(a + step, n)) for a in range(0, n, step)]
    return [idx[a : a + step] for a in range(0, len(idx), step)]


def _key_byte_parts(idx: list[int], keys: Sequence[Any]) -> list[list[int]]:
    """``idx`` in consecutive parts of at most MAX_KEYS_PER_RPC keys and (a part of one key
    excepted) MAX_KEY_BYTES_PER_RPC bytes of keys."""
    # every key (the usual batch): one C-level pass over the lengths, no index per key
    chars = sum(map(len, keys)) if len(idx) == len(keys) else sum(len(keys[i]) for i in idx)
    if len(idx) <= MAX_KEYS_PER_RPC and 4 * chars <= MAX_KEY_BYTES_PER_RPC:
        return [idx] if idx else []  # fits even at 4 UTF-8 bytes per code point: no encoding
    parts: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in idx:
        n = len(keys[i].encode())
        if cur and (len(cur) >= MAX_KEYS_PER_RPC or size + n > MAX_KEY_BYTES_PER_RPC):
            parts.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        parts.append(cur)
    return parts


def fan_out(
    out: list[Any],
    part: Sequence[int],
    resp: Any,
    kind: type,
    fields: tuple[str, ...],
    each: Callable[..., Any],
    *,
    size: int | None = None,
) -> bool:
    """Spread one master reply over ``out[part]``: when ``resp`` is a ``kind`` whose
    ``fields`` each hold one entry per name (``size`` names, default one per key of
    ``part``), ``each(*entries)`` of key ``j``'s entries goes to ``out[part[j]]`` (a
    ``range`` part: written by slice, no per-key indexing); any other reply -- an error, a
    reply of another kind or length (a broken or forged master) -- is one error, set for
    every key of the part. ``out`` starts as None per key. Returns whether the reply was
    per key."""
    n = len(part) if size is None else size
    if type(resp) is kind:
        cols = [getattr(resp, f) for f in fields]
        if all(len(c) == n for c in cols):
            if type(each) is coded and each.ok is None and len(cols) == 1 and not any(cols[0]):
                return True  # every key OK: ``out`` keeps the None it was made with
            if type(part) is range and part.step == 1:
                out[part.start : part.start + n] = map(each, *cols)
            else:
                for i, r in zip(part, map(each, *cols)):
                    out[i] = r
            return True
    fail_all(out, part, whole_error(resp), n)
    return False


def fail_all(out: list[Any], part: Sequence[int], err: E.StoreError, n: int | None = None) -> None:
    """``err`` for every key of ``part`` (``n`` names from a range part's start)."""
    if type(part) is range and part.step == 1:
        n = len(part) if n is None else n
        out[part.start : part.start + n] = [err] * n
    else:
        for i in part:
            out[i] = err


class coded:  # noqa: N801 - used as a function: fan_out(..., coded("remove", keys, part))
    """``each`` for :func:`fan_out` of a reply of per-key codes (and values): ``ok`` (None)
    or the value for code 0, else the code's error naming the key."""

    __slots__ = ("keys", "names", "ok", "what")

    def __init__(self, what: str, keys: Sequence[Any], part: Sequence[int], ok: Any = None):
        self.what, self.keys, self.ok = what, keys, ok
        self.names = iter(part)

    def __call__(self, code: int, value: Any = None) -> Any:
        i = next(self.names)
        if code == 0:
            return self.ok if value is None else value
        return E.error_for(code, f"{self.what} of {self.keys[i]!r}")


def finish(results: BatchResults, batch: bool) -> Any:
    """A batch call's results, or a single key's value (its error raised)."""
    if batch:
        return results
    r = results[0]
    if isinstance(r, E.StoreError):
        raise r
    return r


def valid_indices(keys: Sequence[Any], out: list[Any]) -> list[int]:
    """Indexes of the well-formed keys; each malformed key's error goes into ``out``. A
    batch of plain valid keys (the usual one) is told by one C-level check, not a Python
    call per key (remove, get_size, replicas: ~0.4 us a key)."""
    if keys_valid(keys):  # type: ignore[arg-type]
        return list(range(len(keys)))
    idx: list[int] = []
    for i, k in enumerate(keys):
        err = invalid_key(k)
        if err is not None:
            out[i] = err
        else:
            idx.append(i)
    return idx


class Removed(int):
    """How many objects :meth:`StoreClient.remove_prefix` removed; ``skipped``: how many
    matching ones it left (leased, or a put of the key in flight)."""

    skipped: int

    def __new__(cls, removed: int, skipped: int = 0) -> Removed:
        self = super().__new__(cls, removed)
        self.skipped = skipped
        return self

    def __repr__(self) -> str:
        return f"Removed({int(self)}, skipped={self.skipped})"


class Served(NamedTuple):
    """Where a get's keys were read from, kept as the read path had it and resolved only
    when :attr:`BatchResults.media` or :attr:`BatchResults.key_transports` is asked for (a
    get pays for a tuple, not per key work). Looked-up key ``j`` (result ``idx[j]``, or
    ``j`` when ``idx`` is None) was read from segment ``segs[seg[j]]`` (the first slice of
    the copy that served it; -1: none) into ``regions[reg[j]]``; ``seg``/``reg`` are an
    int for every key or int64 columns. ``handles``: the client's engine handles by
    (endpoint, segment name), whose kind is the medium and whose route the transport."""

    segs: list[tuple[str, str, str]]
    seg: Any
    regions: list[Any]
    reg: Any
    handles: dict[tuple[str, str], Any]
    idx: Any = None


class BatchResults(list):
    """A list with one result per key plus ``transports`` (the transports that served the
    batch's bytes). ``codes``: 0 or the error code per key; ``ok``: no key failed; for
    gets, per key ``media`` (``"memory"``/``"disk"``) and ``key_transports`` (``"shm"``,
    ``"tcp"``, ``"disk"``, ...) of the copy that served it (``""``: not read)."""

    transports: list[str]

    def __init__(
        self,
        items: Sequence[Any] = (),
        transports: list[str] | None = None,
        served: Served | None = None,
    ) -> None:
        super().__init__(items)
        self.transports = transports or []
        self.served = served

    @property
    def media(self) -> list[str]:
        """Per key the medium of the copy its bytes came from; ``""``: not read."""
        return self._per_key(True)

    @property
    def key_transports(self) -> list[str]:
        """Per key the transport that moved its bytes; ``""``: not read (or unknown: its
        segment's handle was dropped since)."""
        return self._per_key(False)

    def _per_key(self, medium: bool) -> list[str]:
        n = len(self)
        out = [""] * n
        s = self.served
        if s is None:
            return out
        seg = s.seg if type(s.seg) is int else np.asarray(s.seg).tolist()
        reg = s.reg if type(s.reg) is int else np.asarray(s.reg).tolist()
        memo: dict[tuple[int, int], str] = {}
        for j, i in enumerate(range(n) if s.idx is None else s.idx):
            r = self[i]
            if r is None or isinstance(r, E.StoreError):
                continue
            y = seg if type(seg) is int else seg[j]
            x = reg if type(reg) is int else reg[j]
            if y < 0:
                continue
            what = memo.get((y, x))
            if what is None:
                what = memo[(y, x)] = _served_by(s, y, x, medium)
            out[i] = what
        return out

    @property
    def codes(self) -> list[int]:
        return [x.code if isinstance(x, E.StoreError) else 0 for x in self]

    @property
    def ok(self) -> bool:
        return not any(isinstance(x, E.StoreError) for x in self)


def _served_by(s: Served, y: int, x: int, medium: bool) -> str:
    name, _node, ep = s.segs[y]
    h = s.handles.get((ep, name))
    if h is None:
        return ""
    kind = h.kind.value
    if medium:
        return "disk" if kind == "disk" else "memory"
    region = s.regions[x] if 0 <= x < len(s.regions) else None
    if region is None:
        return ""
    k, d = region.kind.value, region.device
    return h.transports().get(k if d < 0 else f"{k}:{d}", "")


def invalid_key(key: Any) -> E.StoreError | None:
    why = key_error(key)
    return None if why is None else E.InvalidKey(f"{why}: {str(key)[:100]!r}")
