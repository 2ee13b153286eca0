"""Offset/free-list allocator of one segment: best fit, O(log n) alloc and free, coalescing.

Free space is a set of disjoint extents ``[start, end)``, kept three ways:

* ``starts``: start -> end and ``ends``: end -> start (dicts), so ``free`` finds the free
  neighbours to merge with in O(1);
* ``by_size``: a sorted set of ints ``(length << SHIFT) | start`` (:class:`SortedInts`, a
  blocked sorted list), so ``alloc`` takes the *smallest* free extent that fits, lowest offset
  among equals, with one bisection.

The choice is a function of the free set alone (not of history or insertion order), so a
replica restored from a snapshot allocates exactly like one that replayed the log: the
property that lets ``apply`` allocate on every replica independently.

Lengths are rounded up to ``align`` bytes (64 by default: cache lines and DMA alignment);
callers pass exact lengths and get the rounding back from :meth:`SegmentAllocator.rounded`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

__all__ = ["SHIFT", "AllocatorError", "SegmentAllocator", "SortedInts"]

SHIFT = 41
"""Bits reserved for the start offset in a ``by_size`` key (segments are at most 1 TiB)."""
_MASK = (1 << SHIFT) - 1
_LOAD = 512


class AllocatorError(Exception):
    """A free that does not match the allocator's state (double free, overlap, out of range)."""


class SortedInts:
    """A sorted multiset-free set of ints as a list of sorted blocks of ~``_LOAD`` items (the
    shape of the ``sortedcontainers`` package): bisection over block maxima, then inside a
    block; inserting or deleting moves at most ``2 * _LOAD`` pointers."""

    __slots__ = ("_len", "_lists", "_maxes")

    def __init__(self, sorted_values: list[int] | None = None) -> None:
        vals = sorted_values or []
        self._lists = [vals[i : i + _LOAD] for i in range(0, len(vals), _LOAD)]
        self._maxes = [b[-1] for b in self._lists]
        self._len = len(vals)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for b in self._lists:
            yield from b

    def add(self, x: int) -> None:
        maxes = self._maxes
        if not maxes:
            self._lists.append([x])
            maxes.append(x)
            self._len = 1
            return
        i = bisect_left(maxes, x)
        if i == len(maxes):
            i -= 1
            b = self._lists[i]
            b.append(x)
            maxes[i] = x
        else:
            b = self._lists[i]
            insort(b, x)
        self._len += 1
        if len(b) > 2 * _LOAD:
            half = b[_LOAD:]
            del b[_LOAD:]
            self._lists.insert(i + 1, half)
            maxes[i] = b[-1]
            maxes.insert(i + 1, half[-1])

    def remove(self, x: int) -> None:
        maxes = self._maxes
        i = bisect_left(maxes, x)
        if i == len(maxes):
            raise KeyError(x)
        b = self._lists[i]
        j = bisect_left(b, x)
        if j == len(b) or b[j] != x:
            raise KeyError(x)
        del b[j]
        self._len -= 1
        if not b:
            del self._lists[i]
            del maxes[i]
            return
        maxes[i] = b[-1]
        if len(b) < _LOAD // 4 and i + 1 < len(self._lists):
            nxt = self._lists[i + 1]
            if len(b) + len(nxt) <= 2 * _LOAD:
                b.extend(nxt)
                del self._lists[i + 1]
                del maxes[i + 1]
                maxes[i] = b[-1]

    def ceil(self, x: int) -> int | None:
        """Smallest member >= ``x``, or None."""
        maxes = self._maxes
        i = bisect_left(maxes, x)
        if i == len(maxes):
            return None
        b = self._lists[i]
        return b[bisect_left(b, x)]

    def iter_from(self, x: int) -> Iterator[int]:
        """Members >= ``x`` in ascending order."""
        lists = self._lists
        i = bisect_left(self._maxes, x)
        if i < len(lists):
            b = lists[i]
            yield from b[bisect_left(b, x) :]
            for b in lists[i + 1 :]:
                yield from b

    def last(self) -> int | None:
        return self._maxes[-1] if self._maxes else None

    def __contains__(self, x: int) -> bool:
        maxes = self._maxes
        i = bisect_left(maxes, x)
        if i == len(maxes):
            return False
        b = self._lists[i]
        j = bisect_left(b, x)
        return j < len(b) and b[j] == x


class SegmentAllocator:
    """Free space of one segment of ``size`` bytes (usable: ``size`` rounded down to
    ``align``). All offsets and lengths it hands out are multiples of ``align``."""

    __slots__ = ("align", "by_size", "ends", "free_bytes", "size", "starts")

    def __init__(
        self, size: int, align: int = 64, *, free: list[tuple[int, int]] | None = None
    ) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError("align must be a power of two")
        self.size = size - size % align
        self.align = align
        if free is None:
            free = [(0, self.size)] if self.size > 0 else []
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        keys = []
        total = 0
        for s, e in free:
            self.starts[s] = e
            self.ends[e] = s
            keys.append(((e - s) << SHIFT) | s)
            total += e - s
        keys.sort()
        self.by_size = SortedInts(keys)
        self.free_bytes = total

    # -- queries ------------------------------------------------------------------------

    def rounded(self, length: int) -> int:
        a = self.align
        return (length + a - 1) & -a

    @property
    def used(self) -> int:
        return self.size - self.free_bytes

    def largest(self) -> int:
        """Length of the largest free extent (0 if full)."""
        k = self.by_size.last()
        return 0 if k is None else k >> SHIFT

    def fits(self, length: int) -> bool:
        return self.largest() >= self.rounded(length)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(start, end)`` extents by start."""
        return sorted(self.starts.items())

    # -- mutation -----------------------------------------------------------------------

    def alloc(self, length: int) -> int:
        """Offset of ``length`` (rounded up) fresh bytes, or -1 if no free extent fits.
        Best fit: the smallest fitting extent, lowest offset among equal lengths."""
        n = self.rounded(length)
        if n <= 0:
            raise ValueError("length must be positive")
        k = self.by_size.ceil(n << SHIFT)
        if k is None:
            return -1
        self.by_size.remove(k)
        start = k & _MASK
        end = start + (k >> SHIFT)
        del self.starts[start]
        del self.ends[end]
        if end > start + n:
            self._insert(start + n, end)
        self.free_bytes -= n
        return start

    def capacity(self, length: int, limit: int) -> int:
        """How many of ``count <= limit`` successive ``alloc(length)`` calls would succeed
        (stops counting at ``limit``): every free extent that fits yields
        ``extent // rounded(length)`` pieces (see :meth:`alloc_run`)."""
        n = self.rounded(length)
        got = 0
        for k in self.by_size.iter_from(n << SHIFT):
            got += (k >> SHIFT) // n
            if got >= limit:
                return limit
        return got

    def alloc_run(self, length: int, count: int) -> list[int]:
        """Exactly the offsets of ``count`` successive :meth:`alloc` calls of ``length``
        bytes (all must succeed: check :meth:`capacity` first), in O(extents used) instead
        of O(count) sorted-set operations. Repeated best fit carves the chosen extent from
        its start until less than one piece is left, because the remainder stays the
        smallest fitting extent (any extent between it and the original would have been
        the best fit instead); then it moves to the next best fit."""
        n = self.rounded(length)
        out: list[int] = []
        while len(out) < count:
            k = self.by_size.ceil(n << SHIFT)
            if k is None:
                raise AllocatorError(f"alloc_run: no extent of {n} bytes left")
            self.by_size.remove(k)
            start = k & _MASK
            end = start + (k >> SHIFT)
            del self.starts[start]
            del self.ends[end]
            take = min((end - start) // n, count - len(out))
            out.extend(range(start, start + take * n, n))
            cut = start + take * n
            if end > cut:
                self._insert(cut, end)
            self.free_bytes -= take * n
        return out

    def free(self, offset: int, length: int) -> None:
        """Return ``[offset, offset + rounded(length))``, merging with free neighbours.
        Raises :class:`AllocatorError` for a range that is out of bounds or touches free
        space at either end (a double free)."""
        n = self.rounded(length)
        end = offset + n
        if offset < 0 or n <= 0 or end > self.size or offset % self.align:
            raise AllocatorError(f"free [{offset}, {end}) outside segment of {self.size} bytes")
        if offset in self.starts or end in self.ends:
            raise AllocatorError(f"double free of [{offset}, {end})")
        s, e = offset, end
        left = self.ends.get(offset)
        if left is not None:
            self._delete(left, offset)
            s = left
        right = self.starts.get(end)
        if right is not None:
            self._delete(end, right)
            e = right
        self._insert(s, e)
        self.free_bytes += n

    def _insert(self, s: int, e: int) -> None:
        self.starts[s] = e
        self.ends[e] = s
        self.by_size.add(((e - s) << SHIFT) | s)

    def _delete(self, s: int, e: int) -> None:
        del self.starts[s]
        del self.ends[e]
        self.by_size.remove(((e - s) << SHIFT) | s)
