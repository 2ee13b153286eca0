"""The key -> row index of a large object table (:class:`~.table.Table` switches to it
past :data:`SHARD_AT` keys): :data:`SHARDS` dicts, a key's shard picked by its ``hash``, so
no dict resize rehashes more than one shard's keys (a dict of millions of keys resizes in one
step of half a second, a stall of the master's loop). Never in a snapshot: a restore builds
it again from the image's keys (:meth:`Index.build`), and replicas need not agree on it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from operator import itemgetter
from typing import Any

import numpy as np

__all__ = ["SHARD_AT", "SHARDS", "Index"]

SHARDS = 128  # shards of a large key index: a resize rehashes one, ~1/128 of the keys
SHARD_AT = 1 << 16  # keys: below, one dict (a resize of at most ~44k keys, a few ms)
_SEL_BITS = 13  # an 8,192-entry slot table (64 KiB); 65,536 made lookups ~1.6x slower at 2 M keys
_SEL_MASK = (1 << _SEL_BITS) - 1
_MANY = 8  # keys: from here a batch lookup picks its shards in one C-level call (Index.pick)
_GET, _HAS = dict.get, dict.__contains__


def _owners() -> list[int]:
    """Hash slot (the low bits of ``hash(key)``) -> shard, shard ``i`` owning a share
    proportional to ``2 ** (i / SHARDS)``: the shards' sizes spread over one doubling, so
    their dicts reach their resize points at different table sizes, not all in one batch
    (equal shares would grow in step and resize together)."""
    w = 2.0 ** (np.arange(SHARDS) / SHARDS)
    edges = np.cumsum(w) / w.sum() * (1 << _SEL_BITS)
    return np.searchsorted(edges, np.arange(1 << _SEL_BITS) + 0.5).tolist()


_OWNERS = _owners()


class Index:
    """The key -> row index of a large table: :data:`SHARDS` dicts, a key's shard picked
    by the low bits of its ``hash`` (randomised per process, so requests cannot aim at one
    shard; the index is never in a snapshot, so replicas need not agree on it). A dict
    that must grow rehashes all of its keys at once (482 ms at 5.6 M keys in one dict);
    here that is one shard's keys. The ``dict`` methods the table's callers use."""

    __slots__ = ("_n", "_sel", "shards")

    def __init__(self) -> None:
        self.shards: list[dict[str, int]] = [{} for _ in range(SHARDS)]
        self._sel = [self.shards[i] for i in _OWNERS]  # slot -> its shard's dict
        self._n = 0

    @classmethod
    def build(cls, keys: list[str], rows: list[int] | np.ndarray) -> Index:
        """An index of distinct ``keys`` (rows as given, a list or an integer array: a
        restore passes its live rows as the array they are, not as 10 M ``int`` objects
        converted back): the keys grouped by shard with numpy passes, each shard built by
        one ``dict(zip(...))`` (C-level)."""
        ix = cls()
        n = len(keys)
        if not n:
            return ix
        slot = np.fromiter(map(hash, keys), np.int64, n) & _SEL_MASK
        shard = np.asarray(_OWNERS, np.int16)[slot]
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(SHARDS + 1)).tolist()
        # The keys put in shard order by numpy's fancy indexing of an object array: a
        # quarter less than gathering them through ``map(keys.__getitem__, ...)`` in a
        # restore of 8.9 M keys (5.9 s against 7.0-7.9 s for the whole build,
        # docs/store-master.md), for two transient columns of pointers.
        ka = np.empty(n, object)
        ka[:] = keys
        ks = ka[order]
        del ka
        rs = np.asarray(rows, np.int64)[order]
        for i in range(SHARDS):
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                ix.shards[i] = dict(zip(ks[lo:hi].tolist(), rs[lo:hi].tolist()))
        ix._sel = [ix.shards[i] for i in _OWNERS]
        ix._n = n
        return ix

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        return key in self._sel[hash(key) & _SEL_MASK]

    def __getitem__(self, key: str) -> int:
        return self._sel[hash(key) & _SEL_MASK][key]

    def get(self, key: Any, default: Any = None) -> Any:
        return self._sel[hash(key) & _SEL_MASK].get(key, default)

    def __setitem__(self, key: str, row: int) -> None:
        d = self._sel[hash(key) & _SEL_MASK]
        n = len(d)
        d[key] = row
        self._n += len(d) - n

    def pop(self, key: str) -> int:
        r = self._sel[hash(key) & _SEL_MASK].pop(key)
        self._n -= 1
        return r

    def update(self, pairs: Iterable[tuple[str, int]]) -> None:
        """New keys only (the table's inserts)."""
        sel = self._sel
        m = 0
        for k, r in pairs:
            sel[hash(k) & _SEL_MASK][k] = r
            m += 1
        self._n += m

    def pick(self, keys: list[str]) -> Any:
        """Per key its shard's dict, for ``map(dict.get, ix.pick(keys), keys)``: the slots
        by one comprehension of ints, the dicts by one ``itemgetter`` call, so the lookups
        themselves run as one C-level ``map`` (a comprehension doing all of it per key cost
        ~1.5x the one dict's ``map`` at 2 M keys; this, ~1.2x for absent keys, ~1x for
        present ones). ``hash`` caches a ``str``'s hash, so the lookups do not hash again.
        At least 2 keys (``itemgetter`` of one index returns the item, not a tuple)."""
        m = _SEL_MASK
        return itemgetter(*[h & m for h in map(hash, keys)])(self._sel)

    def get_many(self, keys: list[str]) -> list[int | None]:
        if len(keys) >= _MANY:
            return list(map(_GET, self.pick(keys), keys))
        sel = self._sel
        return [sel[hash(k) & _SEL_MASK].get(k) for k in keys]

    def __iter__(self) -> Iterator[str]:
        for d in self.shards:
            yield from d

    def nbytes(self) -> int:
        """Bytes of the dicts and the slot table (``sys.getsizeof``), not of keys or rows."""
        return sum(map(sys.getsizeof, self.shards)) + sys.getsizeof(self._sel)

    def has_none(self, keys: list[str]) -> bool:
        """Whether no key of ``keys`` is indexed."""
        if len(keys) >= _MANY:
            return not any(map(_HAS, self.pick(keys), keys))
        sel = self._sel
        return not any(k in sel[hash(k) & _SEL_MASK] for k in keys)

    def has_many(self, keys: list[str], flags: bool = False) -> list[Any]:
        """Per key whether it is indexed (``flags``: as 1 / 0, the wire's)."""
        if len(keys) >= _MANY:
            # The lookups as one C loop first: the cache misses of consecutive keys then
            # overlap (a comprehension pulling them one by one cost ~1.4x).
            got = list(map(_HAS, self.pick(keys), keys))
            return [1 if f else 0 for f in got] if flags else got
        sel = self._sel
        if flags:
            return [1 if k in sel[hash(k) & _SEL_MASK] else 0 for k in keys]
        return [k in sel[hash(k) & _SEL_MASK] for k in keys]
