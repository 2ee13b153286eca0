"""Registered memory of the client: registration, and where a caller's buffer, raw address
or list of pieces lies (region, offset), checked against the registration."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ...transfer import MemoryRegion, TransferError
from ...transfer.memory import describe_object
from .. import errors as E
from .args import int_array

__all__ = ["Buffers", "Pieces", "Places", "split_pieces"]


class Places(NamedTuple):
    """A batch's places in registered memory, as columns: per key the offset and capacity
    (numpy arrays, or lists for a single key) in ``region``, or -- ``reg`` given -- in
    ``regions[reg[i]]`` (raw addresses over several registrations)."""

    region: MemoryRegion
    offs: Any
    caps: Any
    regions: list[MemoryRegion] | None = None
    reg: Any = None

    def at(self, i: int) -> tuple[MemoryRegion, int]:
        """Key ``i``'s ``(region, offset)``."""
        region = self.region if self.reg is None else self.regions[int(self.reg[i])]
        return region, int(self.offs[i])

    def take(self, idx: list[int]) -> Places:
        """The places of keys ``idx``, in that order."""
        ix = np.asarray(idx, np.int64)
        reg = None if self.reg is None else np.asarray(self.reg)[ix]
        offs, caps = np.asarray(self.offs)[ix], np.asarray(self.caps)[ix]
        return Places(self.region, offs, caps, self.regions, reg)


class Pieces(NamedTuple):
    """A batch's multi-range places as columns: key ``i``'s bytes fill, in order, ``ln[i, q]``
    bytes at ``off[i, q]`` of ``regions[reg[i, q]]`` (every array ``(keys, ranges)``
    int64); ``totals``: bytes per key (int64, the capacity)."""

    regions: list[MemoryRegion]
    reg: np.ndarray
    off: np.ndarray
    ln: np.ndarray
    totals: np.ndarray

    def at(self, i: int) -> list[tuple]:
        """Key ``i``'s ``[(region, offset, length)]``."""
        regs = self.regions
        return [
            (regs[x], o, z)
            for x, o, z in zip(self.reg[i].tolist(), self.off[i].tolist(), self.ln[i].tolist())
        ]

    def take(self, idx: list[int]) -> Pieces:
        """The places of keys ``idx``, in that order."""
        ix = np.asarray(idx, np.int64)
        return Pieces(self.regions, self.reg[ix], self.off[ix], self.ln[ix], self.totals[ix])

    def lists(self) -> list[list[tuple]]:
        """Per key ``[(region, offset, length)]`` (the general read and put paths)."""
        regs = self.regions
        return [
            [(regs[x], o, z) for x, o, z in zip(r, f, g)]
            for r, f, g in zip(self.reg.tolist(), self.off.tolist(), self.ln.tolist())
        ]


class Buffers:
    """Buffer registration and address resolution of :class:`~kvmesh.store.client.StoreClient`."""

    def register_buffer(self, buffer: Any, size: int | None = None) -> MemoryRegion:
        """Register memory for zero-copy :meth:`put_from`/:meth:`get_into`: a numpy array,
        torch tensor, bytearray, or a raw address with ``size``. Register once, reuse."""
        if isinstance(buffer, int):
            if size is None:
                raise E.InvalidParams("a raw address needs a size")
            region = self.engine.register_raw(buffer, size)
        else:
            region = self.engine.register(buffer)
        with self._buf_lock:
            self._buffers[region.ptr] = region
        return region

    def unregister_buffer(self, buffer: Any) -> None:
        region = self._region_of(buffer, 1)[0]
        with self._buf_lock:
            self._buffers.pop(region.ptr, None)
        self.engine.unregister(region)

    def _region_of(self, buffer: Any, length: int) -> tuple[MemoryRegion, int]:
        """(registered region, offset of the buffer inside it)."""
        if isinstance(buffer, MemoryRegion):
            if buffer.closed:
                raise E.NotRegistered("the buffer was unregistered")
            return buffer, 0
        if isinstance(buffer, int):
            ptr = buffer
        else:
            try:
                ptr = describe_object(buffer, None)[0]
            except (TransferError, TypeError, ValueError) as e:
                raise E.NotRegistered(f"not a registrable buffer: {e}") from None
        try:
            return self.engine.find_region(ptr, max(1, length))
        except (TransferError, LookupError) as e:
            raise E.NotRegistered(
                f"buffer at {ptr:#x} (+{length}) is not registered: {e}"
            ) from None

    def _resolver(self) -> Any:
        """``_region_of`` memoised per buffer object for one call (a batch names the same
        buffer for every key; raw addresses are looked up one by one)."""
        cache: dict[int, Any] = {}

        def where(buffer: Any, length: int) -> tuple[MemoryRegion, int]:
            if isinstance(buffer, int):
                return self._region_of(buffer, length)
            hit = cache.get(id(buffer))
            if hit is None:
                try:
                    hit = cache[id(buffer)] = self._region_of(buffer, 1)
                except E.StoreError as e:
                    hit = cache[id(buffer)] = e
            if isinstance(hit, E.StoreError):
                raise hit
            return hit

        return where

    def _raw_places(self, ptrs: Any, offsets: Any, sizes: Any, n: int) -> Places | None:
        """The places of a batch named by raw addresses (``ptrs[i] + offsets[i]``, capacity
        ``sizes[i]``, default: to the end of its registration) resolved in one vectorised
        lookup -- numpy columns as they are, a list of ints converted once. None: some value
        is not an int, a range is outside registered memory, or ``n`` keys do not match;
        the per-key path then says which."""
        p = int_array(ptrs)
        o = int_array(offsets)
        z = None if sizes is None else int_array(sizes)
        if p is None or o is None or (sizes is not None and z is None) or p.shape != (n,) or not n:
            return None
        if o.ndim == 0:
            o = np.full(n, int(o), np.int64)
        if z is not None and z.ndim == 0:
            z = np.full(n, int(z), np.int64)
        if o.shape != (n,) or (z is not None and z.shape != (n,)):
            return None
        if int(p.min()) <= 0 or int(o.min()) < 0 or (z is not None and int(z.min()) <= 0):
            return None
        at = p + o
        try:
            probe = z if z is not None else np.ones(n, np.int64)
            regs, ri, off = self.engine.find_regions(at.view(np.uint64), probe.view(np.uint64))
        except (TransferError, LookupError, OverflowError):
            return None
        off = off.view(np.int64)
        first = int(ri[0])
        one = int(ri.min()) == int(ri.max())
        if z is None:
            size = regs[first].size if one else np.array([r.size for r in regs], np.int64)[ri]
            z = size - off
        if one:
            return Places(regs[first], off, z)
        return Places(regs[first], off, z, regs, ri)

    @staticmethod
    def _region_columns(
        regions: Any, reg: Any, offsets: Any, sizes: Any, n: int
    ) -> Places | Pieces:
        """The places of ``n`` objects named by region and offset columns: object ``i``'s
        bytes go to ``regions[reg[i]]`` at ``offsets[i]`` (capacity ``sizes[i]``), or --
        ``offsets`` of shape ``(n, ranges)`` -- fill its ranges in order; ``reg`` and
        ``sizes`` broadcast to ``offsets``' shape. Checked for the batch at once (the caller
        resolved its memory once, so no address lookup is left); a bad column refuses the
        call, it cannot be a single key's fault."""
        regs = list(regions)
        if not regs or not all(isinstance(r, MemoryRegion) and not r.closed for r in regs):
            raise E.NotRegistered("regions must be registered, open MemoryRegions")
        o, x, z = _ints(offsets), _ints(reg), _ints(sizes)
        if o is None or x is None or z is None or o.ndim not in (1, 2) or len(o) != n:
            raise E.InvalidParams(f"{n} keys need int columns of offsets (n or n x ranges)")
        if not o.size:
            raise E.InvalidParams("no ranges to read into")
        bad = E.InvalidParams("a region index, offset or size is out of range")
        o_lo, o_hi = int(o.min()), int(o.max())
        if x.ndim == 0:  # one region for every range (the usual batch): checks on ints
            r = int(x)
            if not 0 <= r < len(regs):
                raise bad
            regs, x = [regs[r]], None
        elif int(x.min()) < 0 or int(x.max()) >= len(regs):
            raise bad
        limit = max(r.size for r in regs)
        z_lo, z_hi = (int(z), int(z)) if z.ndim == 0 else (int(z.min()), int(z.max()))
        if o_lo < 0 or z_lo <= 0 or o_hi > limit or z_hi > limit:  # bounded: no int64 wrap
            raise bad
        try:
            if x is not None:
                x = np.broadcast_to(x, o.shape)
            z = np.full(o.shape, int(z), np.int64) if z.ndim == 0 else np.broadcast_to(z, o.shape)
        except ValueError:
            raise E.InvalidParams(
                f"region indexes and sizes do not fit offsets {o.shape}"
            ) from None
        if x is None or len(regs) == 1:
            over = o_hi + z_hi > limit and int((o + z).max()) > limit
        else:
            over = bool((o + z > np.array([r.size for r in regs], np.int64)[x]).any())
        if over:
            raise E.InvalidParams("a range runs past the end of its registered region")
        if o.ndim == 1:
            return Places(regs[0], o, z) if x is None else Places(regs[0], o, z, regs, x)
        ln = np.ascontiguousarray(z)
        xr = np.zeros(o.shape, np.int64) if x is None else np.ascontiguousarray(x)
        return Pieces(regs, xr, o, ln, ln.sum(axis=1))

    def _column_pieces(self, ptrs: Any, sizes: Any, n: int) -> Pieces | None:
        """The places of ``n`` multi-range objects named by raw addresses as columns:
        ``ptrs`` a ``(n, ranges)`` integer array, ``sizes`` the same shape (or one row for
        every key), resolved in one vectorised lookup. None: not columns of that shape, some
        value not a positive int, or some range outside registered memory (the per-key
        path then says which)."""
        if not isinstance(ptrs, np.ndarray) or ptrs.ndim != 2 or ptrs.shape[0] != n or not n:
            return None
        p = int_array(ptrs)
        z = int_array(sizes)
        if p is None or z is None or not p.shape[1]:
            return None
        if z.shape == (p.shape[1],):
            z = np.broadcast_to(z, p.shape)
        if z.shape != p.shape or int(p.min()) <= 0 or int(z.min()) <= 0:
            return None
        try:
            regs, ri, off = self.engine.find_regions(
                p.reshape(-1).view(np.uint64), np.ascontiguousarray(z).reshape(-1).view(np.uint64)
            )
        except (TransferError, LookupError, OverflowError):
            return None
        shape = p.shape
        ln = np.ascontiguousarray(z)
        return Pieces(
            regs,
            np.asarray(ri, np.int64).reshape(shape),
            off.view(np.int64).reshape(shape),
            ln,
            ln.sum(axis=1),
        )

    def _one_region(
        self, buffer: Any, offsets: Any, sizes: Any, n: int, batch: bool
    ) -> Places | None:
        """The batch's places when every key's range (``offsets``; capacity ``sizes``, default:
        to the end of the registration) lies in one registered buffer, worked out with numpy
        (a get's destinations, a put's sources); None sends the call down the per-key path
        (which reports each bad key, or raises for a malformed call)."""
        if not batch and type(offsets) is int and (sizes is None or type(sizes) is int):
            # One key (a single get): the same checks on Python ints.
            try:
                region, base = self._region_of(buffer, 1)
            except E.StoreError:
                return None
            at = base + offsets
            cap = region.size - at if sizes is None else sizes
            if offsets < 0 or cap <= 0 or at + cap > region.size:
                return None
            return Places(region, [at], [cap])
        offs = int_array(offsets if batch else [offsets])
        caps = None if sizes is None else int_array(sizes if batch else [sizes])
        if offs is None or (caps is None and sizes is not None):
            return None  # not all ints: the per-key path says which
        if offs.ndim == 0:
            offs = np.full(n, int(offs), np.int64)
        if caps is not None and caps.ndim == 0:
            caps = np.full(n, int(caps), np.int64)
        if offs.shape != (n,) or (caps is not None and caps.shape != (n,)):
            return None
        try:
            region, base = self._region_of(buffer, 1)
        except E.StoreError:
            return None
        at = offs + base
        if caps is None:
            caps = region.size - at
        if n and (
            int(offs.min()) < 0 or int(caps.min()) <= 0 or int((at + caps).max()) > region.size
        ):
            return None
        return Places(region, at, caps)

    def _pieces(self, buffers: list[Any], sizes: list[int], where: Any) -> list[tuple]:
        """``[(region, offset, length)]`` of one object's buffers (registered objects at
        their start, or raw addresses inside registered memory)."""
        if len(buffers) != len(sizes) or not buffers:
            raise E.InvalidParams("one size per buffer, at least one buffer")
        out = []
        for b, sz in zip(buffers, sizes):
            if not isinstance(sz, int) or sz <= 0:
                raise E.InvalidParams(f"buffer sizes must be positive ints, got {sz!r}")
            region, base = where(b, sz)
            if base + sz > region.size:
                raise E.InvalidParams(f"{sz} bytes at offset {base} exceed the registered buffer")
            out.append((region, base, sz))
        return out

    def _multi_pieces(
        self, keys: list[str], buffers: list[list[Any]], sizes: list[list[int]]
    ) -> tuple[list[Any], list[int]]:
        """Per object, its registered pieces (or the error that refused them) and byte total."""
        n = len(keys)
        if isinstance(buffers, np.ndarray) or isinstance(sizes, np.ndarray):
            cols = self._column_pieces(buffers, sizes, n)
            if cols is not None:
                return cols.lists(), cols.totals.tolist()
            # Refused columns: the per-range path on Python ints names the bad range.
            buffers = np.asarray(buffers).tolist()
            sizes = np.asarray(sizes).tolist()
            if len(sizes) != n and len(buffers) == n and sizes and type(sizes[0]) is int:
                sizes = [sizes] * n  # one row of sizes for every key
        if len(buffers) != n or len(sizes) != n:
            raise E.InvalidParams(
                f"{n} keys but {len(buffers)} buffer lists, {len(sizes)} size lists"
            )
        flat = self._flat_pieces(buffers, sizes)
        if flat is not None:
            return flat
        where = self._resolver()
        bufs: list[Any] = []
        totals: list[int] = []
        for i in range(n):
            try:
                bufs.append(self._pieces(list(buffers[i]), list(sizes[i]), where))
                totals.append(sum(sizes[i]))
            except E.StoreError as e:
                bufs.append(e)
                totals.append(0)
        return bufs, totals

    def _flat_pieces(
        self, buffers: list[list[Any]], sizes: list[list[int]]
    ) -> tuple[list[Any], list[int]] | None:
        """:meth:`_multi_pieces` when every buffer is a raw address inside registered memory
        and every size a positive int (HiCache's layer_first pages: 32-64 ranges per object,
        thousands per batch): one vectorised region lookup for the whole batch instead of one
        per range. ``None``: some range is not of that kind (or not registered); the caller
        then resolves range by range, which names the bad one per object."""
        counts = list(map(len, buffers))
        if 0 in counts or counts != list(map(len, sizes)):
            return None
        ptrs = [p for b in buffers for p in b]
        lens = [z for x in sizes for z in x]
        if set(map(type, ptrs)) != {int} or set(map(type, lens)) != {int}:
            return None  # bools, buffer objects, regions: the general path
        try:
            p = np.array(ptrs, np.int64)
            ln = np.array(lens, np.int64)
        except OverflowError:
            return None
        if int(ln.min()) <= 0 or int(p.min()) < 0:
            return None
        try:
            regs, ri, off = self.engine.find_regions(p.view(np.uint64), ln.view(np.uint64))
        except (TransferError, LookupError):
            return None
        pieces = list(zip(map(regs.__getitem__, ri.tolist()), off.tolist(), lens))
        ends = np.cumsum(counts).tolist()
        starts = [0, *ends[:-1]]
        totals = np.add.reduceat(ln, starts).tolist()
        return [pieces[a:z] for a, z in zip(starts, ends)], totals


def _ints(v: Any) -> np.ndarray | None:
    """:func:`int_array`, without its conversions for what already is int64 (each numpy call
    costs microseconds once a copy has cooled the caches)."""
    if type(v) is np.ndarray and v.dtype == np.int64:
        return v
    if type(v) is int:
        return np.int64(v) if -(2**63) <= v < 2**63 else None
    return int_array(v)


def split_pieces(pieces: list[tuple], slices: Any) -> list[tuple]:
    """``(region, local_off, segment, remote_off, length)`` moving ``slices`` (``(segment,
    remote_off, length)`` in byte order) to/from ``pieces`` (``(region, offset, length)``
    that the object's bytes fill in order); ``segment`` is passed through as given."""
    out = []
    pi, used = 0, 0
    for where, roff, left in slices:
        while left > 0:
            region, off, ln = pieces[pi]
            take = min(left, ln - used)
            out.append((region, off + used, where, roff, take))
            used += take
            roff += take
            left -= take
            if used == ln:
                pi, used = pi + 1, 0
    return out
