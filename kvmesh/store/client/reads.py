"""The client's get protocol: GetReplicas (a read lease) -> engine READs into the caller's
memory, never past the lease; the single-key, usual-batch and general read paths."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...transfer import MemoryRegion, Op
from ...transfer.disk import checksum as _crc32c
from .. import errors as E
from .. import protocol as P
from ..types import (
    bad_parts,
    keys_valid,
)
from .args import listify, per_key
from .buffers import Pieces, Places, split_pieces
from .replies import (
    MAX_KEYS_PER_RPC,
    BatchResults,
    Served,
    finish,
    invalid_key,
    rpc_parts,
    valid_indices,
    whole_error,
)
from .table import NO_ROWS, check_table, run_heads

__all__ = ["Reads"]


class Reads:
    """The get forms of :class:`~kvmesh.store.client.StoreClient`."""

    def _lookup(self, keys: list[str]) -> _Looked:
        """GetReplicas (table form) in RPC-sized parts: per key code and size, the slice rows
        of the found keys (key index relative to ``keys``), and the lease deadline."""
        n = len(keys)
        if type(keys) is _PartNames and n > MAX_KEYS_PER_RPC:
            keys = list(keys)  # several RPCs: cut by names
        if n <= MAX_KEYS_PER_RPC:  # one RPC (the usual case): its arrays as they are
            host = self.engine.host_id
            if type(keys) is _PartNames:
                pre, mid, sufs = keys.prefix, keys.keys, keys.suffixes
                resp, t0 = self.rpc.call_timed(
                    lambda rid: P.GetPartsReq(rid, pre, mid, sufs, host, True)
                )
            else:
                resp, t0 = self.rpc.call_timed(lambda rid: P.GetReplicasReq(rid, keys, host, True))
            try:
                if type(resp) is not P.ReplicaTableResp:
                    raise whole_error(resp)
                c, z, rows = check_table(resp, n)
            except E.StoreError as err:
                return _Looked([err.code] * n, [0] * n, NO_ROWS, [], float("inf"))
            return _Looked(c, z, rows, resp.segments, t0 + resp.lease_ms / 1000.0, resp.crcs)
        codes = np.zeros(n, np.int64)
        sizes = np.zeros(n, np.int64)
        parts: list[np.ndarray] = []
        segs: list[tuple[str, str, str]] = []
        crcs: list[int] = []  # per key once some part has a disk copy (the disk tier)
        deadline = float("inf")
        host = self.engine.host_id
        for rng in rpc_parts(keys):
            start, end = rng.start, rng.stop
            part = keys[start:end]
            resp, t0 = self.rpc.call_timed(
                lambda rid, part=part: P.GetReplicasReq(rid, part, host, True)
            )
            try:
                if type(resp) is not P.ReplicaTableResp:
                    raise whole_error(resp)
                c, z, rows = check_table(resp, len(part))
            except E.StoreError as err:
                codes[start:end] = err.code
                continue
            deadline = min(deadline, t0 + resp.lease_ms / 1000.0)
            if resp.crcs or crcs:
                crcs += [-1] * (start - len(crcs))
                crcs += list(resp.crcs) if len(resp.crcs) == len(part) else [-1] * len(part)
            codes[start:end] = c
            sizes[start:end] = z
            if len(rows):
                rows[:, 0] += start
                rows[:, 2] += len(segs)
                parts.append(rows)
            segs += resp.segments
        rows = np.concatenate(parts) if parts else NO_ROWS
        if crcs:
            crcs += [-1] * (n - len(crcs))
        return _Looked(codes, sizes, rows, segs, deadline, crcs)

    def _ranks(self, rows: np.ndarray, segs: list[tuple[str, str, str]]) -> np.ndarray:
        """Per row the attempt in which its copy is read: the master's order (copies on this
        host first), except that copies wholly in this process come before all others."""
        rank = rows[:, 1]
        if not len(rank) or not rank.any():  # one copy per key (the common case)
            return rank
        me = self.engine.address
        local = np.fromiter((ep == me for _, _, ep in segs), bool, len(segs))[rows[:, 2]]
        kc = rows[:, 0] * (int(rank.max()) + 1) + rank
        starts = run_heads(kc)
        mine = np.logical_and.reduceat(local, starts)
        gkey, gcopy = rows[starts, 0], rank[starts]
        order = np.lexsort((gcopy, ~mine, gkey))  # per key: ours first, then master's order
        first = run_heads(gkey[order])
        pos = np.arange(len(order)) - np.repeat(first, np.diff(np.append(first, len(order))))
        new = np.empty(len(starts), np.int64)
        new[order] = pos
        return np.repeat(new, np.diff(np.append(starts, len(rows))))

    def _get_regions(self, keys: list[Any], bufs: Any, caps: Any) -> BatchResults:
        n = len(keys)
        out: list[Any] = [None] * n
        one = isinstance(bufs, (Places, Pieces))
        if one and (type(keys) is _PartNames or keys_valid(keys)):  # parts: checked by parts
            idx: list[int] = list(range(n))
        else:
            idx = []
            for i, k in enumerate(keys):
                b = None if one else bufs[i]
                err = invalid_key(k) or (b if isinstance(b, E.StoreError) else None)
                if err is not None:
                    out[i] = err
                else:
                    idx.append(i)
            if not idx:
                return BatchResults(out, [])
        looked = self._lookup(keys if len(idx) == n else [keys[i] for i in idx])
        return self._read(keys, idx, bufs, caps, looked, out)

    def _read(
        self,
        keys: list[Any],
        idx: list[int],
        bufs: Any,
        caps: Any,
        looked: _Looked,
        out: list[Any],
    ) -> BatchResults:
        """:meth:`_read_copies`, then the disk tier's check: a key whose object has a disk
        copy (``looked.crcs``) is answered only if the bytes that landed have its crc32c --
        whichever copy served them, as every copy holds the same bytes. A mismatch is a
        per-key ``InvalidRead`` (never wrong bytes reported as read), and the master is told
        (:meth:`_report_corrupt`) so that the bad disk copy is dropped."""
        res = self._read_copies(keys, idx, bufs, caps, looked, out)
        if looked.crcs:
            out[:] = res
            if self._check_crcs(keys, idx, bufs, looked, out):
                return BatchResults(out, res.transports, res.served)
        return res

    def _check_crcs(
        self, keys: list[Any], idx: list[int], bufs: Any, looked: _Looked, out: list[Any]
    ) -> bool:
        """Per key with a recorded crc that was read: check it (mismatches replace the
        key's result in ``out``); True if any failed."""
        bad: list[tuple[str, int]] = []
        for j, want in enumerate(looked.crcs):
            if want < 0 or j >= len(idx):
                continue
            i = idx[j]
            got = out[i]
            if type(got) is not int:
                continue  # not read: nothing to check
            if isinstance(bufs, Places):
                region, at = bufs.at(i)
                parts = [(region, at, got)]
            elif isinstance(bufs, Pieces):
                parts = bufs.at(i)
            else:
                b = bufs[i]
                parts = [(b[0], b[1], got)] if type(b) is tuple else list(b)
            crc, left = 0, got
            for region, at, ln in parts:
                if left <= 0:
                    break
                ln = min(ln, left)
                if not region.is_host:
                    crc = None  # device memory: no host view to check here (docs/store.md)
                    break
                crc = _crc32c(region.array()[at : at + ln], crc)
                left -= ln
            if crc is not None and crc != want:
                out[i] = E.InvalidRead(
                    f"{keys[i]!r}: the bytes read fail the checksum of its disk copy "
                    f"(crc32c {crc:#010x}, recorded {want:#010x}); the copy is dropped"
                )
                bad.append((keys[i], want))
        if bad:
            self.checksum_mismatches = getattr(self, "checksum_mismatches", 0) + len(bad)
            self._report_corrupt(bad)
        return bool(bad)

    def _report_corrupt(self, bad: list[tuple[str, int]]) -> None:
        """Tell the master which disk copies (key, recorded crc) failed their checksum."""
        try:
            self.rpc.mutate(
                lambda rid, s: P.ReportCorruptReq(rid, s, [k for k, _ in bad], [c for _, c in bad])
            )
        except E.StoreError:
            pass  # the next reader reports it again

    def _read_copies(
        self,
        keys: list[Any],
        idx: list[int],
        bufs: Any,
        caps: Any,
        looked: _Looked,
        out: list[Any],
    ) -> BatchResults:
        """READ the looked-up objects ``keys[idx[j]]`` into their buffers: ``bufs`` is a
        :class:`Places` (offsets per key of ``keys``) or per key ``(region, offset)``
        or a list of ``(region, offset, length)`` pieces; ``caps``: capacities per key."""
        rows, segs, lease_deadline = looked.rows, looked.segs, looked.lease_deadline
        m = len(idx)
        if isinstance(bufs, Pieces):
            if m == len(keys):
                done = self._read_pieces(keys, bufs, looked, out)
                if done is not None:
                    return done
            bufs = bufs.lists()  # the general loop splits slices over per-key pieces
        if m == 1 and len(rows) == 1 and (isinstance(bufs, Places) or type(bufs[idx[0]]) is tuple):
            return self._read_one(keys, idx[0], bufs, caps, looked, out)
        if m == len(keys) and len(segs) == 1 and isinstance(bufs, Places):
            done = self._read_simple(keys, bufs, caps, looked, out)
            if done is not None:
                return done
        codes = np.asarray(looked.codes, np.int64)
        sizes = np.asarray(looked.sizes, np.int64)
        whole = m == len(keys)  # every key was looked up (idx is 0..n-1)
        ix = None if whole else np.asarray(idx, np.int64)
        cap = np.asarray(caps, np.int64) if whole else np.asarray(caps, np.int64)[ix]
        kj = rows[:, 0]
        found = codes == 0
        # One copy of one slice per found key (checked whole by check_table): no ranking, and
        # each key's bytes land at its buffer offset.
        simple = len(rows) == int(np.count_nonzero(found)) and not rows[:, 1].any()
        if simple:
            rank = None
            copies = found.astype(np.int64)
        else:
            rank = self._ranks(rows, segs)
            copies = np.zeros(m, np.int64)
            np.maximum.at(copies, kj, rank + 1)
        pend = found & (sizes <= cap) & (copies > 0)
        if not pend.all():
            for j in np.flatnonzero(~pend).tolist():
                i = idx[j]
                out[i] = _refusal(keys[i], int(codes[j]), int(sizes[j]), int(cap[j]))
        # Where each key's bytes go: one region at an offset (numpy), or pieces (Python).
        pieces: dict[int, list[tuple]] = {}
        if isinstance(bufs, Places):
            if bufs.reg is None:
                regions = [bufs.region]
                kreg = np.zeros(m, np.int64)
            else:
                regions = list(bufs.regions)
                kreg = np.asarray(bufs.reg, np.int64)
                kreg = kreg if whole else kreg[ix]
            koff = np.asarray(bufs.offs, np.int64)
            koff = koff if whole else koff[ix]
        else:
            regions, seen = [], {}
            kreg = np.full(m, -1, np.int64)
            koff = np.zeros(m, np.int64)
            for j in np.flatnonzero(pend).tolist():
                b = bufs[idx[j]]
                if type(b) is tuple:
                    x = seen.get(id(b[0]))
                    if x is None:
                        x = seen[id(b[0])] = len(regions)
                        regions.append(b[0])
                    kreg[j], koff[j] = x, b[1]
                else:
                    pieces[j] = b
        transports: set[str] = set()
        attempt = 0
        sz = sizes.tolist()
        served = np.full(m, -1, np.int64)  # per key: the segment of the copy that served it
        while pend.any():
            if rank is None:
                r = rows if pend.all() else rows[pend[kj]]
            else:
                r = rows[(rank == attempt) & pend[kj]]
            k, seg, ro, ln = r[:, 0], r[:, 2], r[:, 3], r[:, 4]
            first = np.full(m, -1, np.int64)
            first[k[::-1]] = seg[::-1]  # each key's first slice this round
            reg, lo = kreg[k], koff[k]
            if rank is not None and len(k):
                # Each key's slices fill its buffer in order: + bytes of earlier slices.
                before = np.cumsum(ln) - ln
                head = run_heads(k)
                lo = lo + before - np.repeat(before[head], np.diff(np.append(head, len(k))))
            if pieces:  # the multi-buffer forms: split each slice over the key's pieces
                flat = reg >= 0
                lut = {id(q): x for x, q in enumerate(regions)}
                ext = []
                for j, b in pieces.items():
                    if not pend[j]:
                        continue
                    mine = k == j
                    sl = zip(seg[mine].tolist(), ro[mine].tolist(), ln[mine].tolist())
                    for rg, lo_, y, ro_, ln_ in split_pieces(b, sl):
                        x = lut.get(id(rg))
                        if x is None:
                            x = lut[id(rg)] = len(regions)
                            regions.append(rg)
                        ext.append((j, x, lo_, y, ro_, ln_))
                e = np.asarray(ext, np.int64).reshape(-1, 6)
                k = np.concatenate([k[flat], e[:, 0]])
                reg = np.concatenate([reg[flat], e[:, 1]])
                lo = np.concatenate([lo[flat], e[:, 2]])
                seg = np.concatenate([seg[flat], e[:, 3]])
                ro = np.concatenate([ro[flat], e[:, 4]])
                ln = np.concatenate([ln[flat], e[:, 5]])
            # Never copy past the lease: after it the memory may belong to another object.
            bad, t = self._move_arrays(
                Op.READ, k, regions, reg, lo, segs, seg, ro, ln,
                max(0.001, lease_deadline - time.monotonic()),
            )  # fmt: skip
            transports.update(t)
            expired = time.monotonic() > lease_deadline
            failed = np.ones(m, bool)
            failed[k] = False  # a pending key without a request this round did not read
            failed[bad] = True
            tried = pend
            if expired:
                for j in np.flatnonzero(tried).tolist():
                    out[idx[j]] = _lease_expired(keys[idx[j]])
                break
            won = tried & ~failed
            served[won] = first[won]
            for j in np.flatnonzero(won).tolist():
                out[idx[j]] = sz[j]
            attempt += 1
            pend = tried & failed & (copies > attempt)  # next copy, under the same lease
            for j in np.flatnonzero(tried & failed & (copies <= attempt)).tolist():
                out[idx[j]] = _read_failed(keys[idx[j]])
        self.last_transports = sorted(transports)
        for j, b in pieces.items():  # a key read into pieces: its first piece's region
            kreg[j] = len(regions)
            regions.append(b[0][0])
        where = Served(segs, served, regions, kreg, self._segments, idx)
        return BatchResults(out, self.last_transports, where)

    def _read_simple(
        self, keys: list[Any], bufs: Places, caps: Any, looked: _Looked, out: list[Any]
    ) -> BatchResults | None:
        """:meth:`_read` of the usual batch -- every key looked up and found as one copy of
        one slice, all in the one segment named, each fitting its place in one registered
        region -- as one engine call on the table's own columns, without the masks, ranks
        and grouping of the general loop (70-100 us of a 256-key get, docs/store.md);
        None: not that batch, the general loop answers it. Same refusals (none apply),
        lease rule and outcomes."""
        rows = looked.rows
        m = len(keys)
        if len(rows) != m:
            return None
        codes, sizes = looked.codes, looked.sizes
        if type(codes) is not np.ndarray or codes.any() or rows[:, 1].any():
            return None  # a key not found, or copies to rank: the general loop
        if (sizes > np.asarray(caps, np.int64)).any():
            return None  # a buffer too small: refused per key by the general loop
        # check_table checked that row j is key j, one slice of the object's full size, in the
        # one segment (index 0); its offsets and lengths go to the engine as they are.
        lo = np.asarray(bufs.offs, np.int64)
        if bufs.reg is not None:  # raw addresses over several registrations
            return self._read_places(keys, bufs, lo, looked, out)
        used, expired = self._read_leased(looked, 0, bufs.region, lo, rows[:, 3], rows[:, 4])
        if expired:
            out[:] = [_lease_expired(k) for k in keys]
        elif used is None:
            out[:] = [_read_failed(k) for k in keys]
        else:
            out[:] = sizes.tolist()
        t = [] if used is None else sorted(used)
        self.last_transports = t
        return BatchResults(out, t, Served(looked.segs, 0, [bufs.region], 0, self._segments))

    def _read_places(
        self, keys: list[Any], bufs: Places, lo: np.ndarray, looked: _Looked, out: list[Any]
    ) -> BatchResults:
        """:meth:`_read_simple` into several registered regions: one engine batch grouped
        by region, the same lease rule and outcomes, per key (a group may fail alone)."""
        rows = looked.rows
        m = len(keys)
        owner = np.arange(m, dtype=np.int64)
        left = max(0.001, looked.lease_deadline - time.monotonic())
        bad, used = self._move_arrays(
            Op.READ, owner, bufs.regions, np.asarray(bufs.reg, np.int64), lo, looked.segs,
            rows[:, 2], rows[:, 3], rows[:, 4], left,
        )  # fmt: skip
        if time.monotonic() > looked.lease_deadline:
            out[:] = [_lease_expired(k) for k in keys]
        else:
            out[:] = looked.sizes.tolist()
            for j in bad.tolist():
                out[j] = _read_failed(keys[j])
        self.last_transports = list(used)
        where = Served(looked.segs, rows[:, 2], bufs.regions, bufs.reg, self._segments)
        return BatchResults(out, self.last_transports, where)

    def _read_pieces(
        self, keys: list[Any], bufs: Pieces, looked: _Looked, out: list[Any]
    ) -> BatchResults | None:
        """:meth:`_read` of multi-range places (HiCache's layer_first pages: 32-64 ranges
        per object) when every key was found as one copy of one slice of exactly its places'
        total: each range one request, at the slice's offset plus the bytes of the key's
        earlier ranges, as one engine batch built from columns. None: not that batch (a
        key missing, several copies or slices, a size other than the total), the general
        loop answers it. Same lease rule and outcomes."""
        rows = looked.rows
        m = len(keys)
        codes, sizes = looked.codes, looked.sizes
        if len(rows) != m or type(codes) is not np.ndarray or codes.any() or rows[:, 1].any():
            return None
        if not np.array_equal(sizes, bufs.totals):
            return None
        r = bufs.ln.shape[1]
        ln = bufs.ln
        before = np.cumsum(ln, axis=1) - ln
        owner = np.repeat(np.arange(m, dtype=np.int64), r)
        ro = (rows[:, 3:4] + before).reshape(-1)
        left = max(0.001, looked.lease_deadline - time.monotonic())
        bad, used = self._move_arrays(
            Op.READ, owner, bufs.regions, bufs.reg.reshape(-1), bufs.off.reshape(-1),
            looked.segs, np.repeat(rows[:, 2], r), ro, ln.reshape(-1), left,
        )  # fmt: skip
        if time.monotonic() > looked.lease_deadline:
            out[:] = [_lease_expired(k) for k in keys]
        else:
            out[:] = sizes.tolist()
            for j in bad.tolist():
                out[j] = _read_failed(keys[j])
        self.last_transports = list(used)
        where = Served(looked.segs, rows[:, 2], bufs.regions, bufs.reg[:, 0], self._segments)
        return BatchResults(out, self.last_transports, where)

    def _read_leased(
        self, looked: _Looked, y: int, region: MemoryRegion, lo: Any, ro: Any, ln: Any
    ) -> tuple[tuple[str, ...] | None, bool]:
        """One engine read from segment ``looked.segs[y]`` that never runs past the read
        lease (after it the memory may belong to another object): the transports used (None:
        the segment could not be opened or the read failed) and whether the lease had
        expired by the time it ended (then nothing read may be reported as read)."""
        seg = looked.segs[y]
        h = self._open(seg)
        used = None
        if h is not None:
            left = max(0.001, looked.lease_deadline - time.monotonic())
            used = self._transfer(Op.READ, region, lo, h, seg, ro, ln, left)
        return used, time.monotonic() > looked.lease_deadline

    def _read_one(
        self, keys: list[Any], i: int, bufs: Any, caps: Any, looked: _Looked, out: list[Any]
    ) -> BatchResults:
        """:meth:`_read` of one key found as one copy of one slice (a single get): the same
        refusals, lease rule and outcomes with Python scalars instead of array set-up."""
        code, size, cap = int(looked.codes[0]), int(looked.sizes[0]), int(caps[i])
        if code != 0 or size > cap:
            out[i] = _refusal(keys[i], code, size, cap)
            self.last_transports = []
            return BatchResults(out, [])
        if isinstance(bufs, Places):
            region, at = bufs.at(i)
        else:
            region, at = bufs[i]
        _, _, y, ro, ln = looked.rows[0].tolist()
        used, expired = self._read_leased(looked, y, region, at, ro, ln)
        t = [] if used is None else list(used)
        if expired:
            out[i] = _lease_expired(keys[i])
        elif used is None:
            out[i] = _read_failed(keys[i])
        else:
            out[i] = size
        self.last_transports = t
        return BatchResults(out, t, Served(looked.segs, y, [region], 0, self._segments, [i]))

    def get_into(self, keys: Any, buffer: Any, offsets: Any = 0, sizes: Any = None) -> Any:
        """Read objects into registered memory at ``buffer + offsets[i]`` (capacity
        ``sizes[i]`` bytes, default: to the end of the registered region). Returns the number
        of bytes read per key."""
        ks, batch = listify(keys)
        n = len(ks)
        if not (batch and isinstance(buffer, list)):
            one = self._one_region(buffer, offsets, sizes, n, batch)
        else:  # raw addresses, one per key: resolved at once
            one = self._raw_places(buffer, offsets, sizes, n)
        if one is not None:
            return finish(self._get_regions(ks, one, one.caps), batch)
        offs = per_key(offsets, n, "offsets", batch)
        caps_in = per_key(sizes, n, "sizes", batch)
        bufl = buffer if (batch and isinstance(buffer, list)) else [buffer] * n
        if len(bufl) != n:
            raise E.InvalidParams(f"{n} keys but {len(bufl)} buffers")
        bufs: list[Any] = []
        caps: list[int] = []
        where = self._resolver()
        for i in range(n):
            try:
                region, base = where(bufl[i], caps_in[i] or 1)
                off = base + int(offs[i])
                cap = caps_in[i] if caps_in[i] is not None else region.size - off
                if offs[i] < 0 or cap <= 0 or off + cap > region.size:
                    raise E.InvalidParams(
                        f"range [{off}, {off + max(cap, 0)}) is outside the registered buffer "
                        f"of {region.size} bytes"
                    )
                bufs.append((region, off))
                caps.append(cap)
            except E.StoreError as e:
                bufs.append(e)
                caps.append(0)
        return finish(self._get_regions(ks, bufs, caps), batch)

    def get_into_raw(self, keys: Sequence[Any], ptrs: Any, sizes: Any = None) -> BatchResults:
        """Batch :meth:`get_into` where key ``i``'s bytes go to the raw address ``ptrs[i]``
        inside registered memory, capacity ``sizes[i]`` (default: to the end of its
        registration): integer columns (numpy arrays as they are, or sequences), resolved
        in one vectorised lookup. Per key the number of bytes read."""
        ks = list(keys)
        places = self._raw_places(ptrs, 0, sizes, len(ks))
        if places is not None:
            return self._get_regions(ks, places, places.caps)
        # Some address or size is refused: the per-key path names which.
        szs = sizes if sizes is None or np.ndim(sizes) == 0 else np.asarray(sizes).tolist()
        return self.get_into(ks, np.asarray(ptrs).reshape(-1).tolist(), 0, szs)

    def get_into_regions(
        self, keys: Sequence[Any], regions: Sequence[MemoryRegion], reg: Any, offsets: Any,
        sizes: Any, *, prefix: str = "", suffixes: Sequence[str] | None = None,
    ) -> BatchResults:  # fmt: skip
        """Batch get into memory the caller resolved once (its :meth:`register_buffer`
        regions): key ``i``'s bytes go to ``regions[reg[i]]`` at ``offsets[i]``, capacity
        ``sizes[i]``; ``offsets`` of shape ``(keys, ranges)``: filled range by range in
        order. Integer columns, ``reg`` and ``sizes`` broadcast to ``offsets``; checked for
        the whole batch, with no address lookup per call. Per key the number of bytes read.

        ``prefix``/``suffixes``: the objects are ``prefix + key + suffix`` for every key and
        every suffix, key-major (as :meth:`batch_exists`'s parts); ``i`` above counts those
        names. The master joins them (:class:`~kvmesh.store.protocol.GetPartsReq`): no
        name is built here unless some part is refused (then the names, key by key)."""
        if suffixes is not None or prefix:
            sufs = list(suffixes if suffixes is not None else [""])
            mid = list(keys)
            names: Any = _PartNames(prefix, mid, sufs)
            if bad_parts(prefix, mid, sufs) is not None:
                names = list(names)  # the per-key path names each bad key
            places = self._region_columns(regions, reg, offsets, sizes, len(names))
            caps = places.caps if isinstance(places, Places) else places.totals
            return self._get_regions(names, places, caps)
        ks = list(keys)
        places = self._region_columns(regions, reg, offsets, sizes, len(ks))
        caps = places.caps if isinstance(places, Places) else places.totals
        return self._get_regions(ks, places, caps)

    def get(self, keys: Any, *, into: Callable[[memoryview], Any] | None = None) -> Any:
        """Objects as ``bytes`` (one copy out of a staging buffer). ``into``: each object
        is ``into(view)`` instead, ``view`` its bytes in the staging buffer, valid during the
        call only (``bytearray`` or a subclass: the one copy lands in that object)."""
        ks, batch = listify(keys)
        n = len(ks)
        out: list[Any] = [None] * n
        idx = list(range(n)) if keys_valid(ks) else valid_indices(ks, out)
        if not idx:
            return finish(BatchResults(out), batch)
        looked = self._lookup(ks if len(idx) == n else [ks[i] for i in idx])  # one RPC
        codes, sizes = np.asarray(looked.codes), np.asarray(looked.sizes, np.int64)
        want = np.where(codes == 0, sizes, 0)
        stage = self._staging.acquire(max(1, int(want.sum())))
        try:
            region, arr = stage
            at = np.zeros(n, np.int64)
            caps = np.zeros(n, np.int64)
            ix = np.asarray(idx, np.int64)
            at[ix] = np.cumsum(want) - want
            caps[ix] = sizes
            res = self._read(ks, idx, Places(region, at, caps), caps, looked, out)
            pos = at.tolist()
            results = BatchResults(
                [
                    (
                        r
                        if not isinstance(r, int)
                        else arr[pos[i] : pos[i] + r].tobytes()
                        if into is None
                        else into(arr[pos[i] : pos[i] + r].data)
                    )
                    for i, r in enumerate(res)
                ],
                res.transports,
                res.served,
            )
        finally:
            self._staging.release(stage)
        return finish(results, batch)

    def get_into_multi(
        self, keys: list[str], buffers: list[list[Any]], sizes: list[list[int]]
    ) -> BatchResults:
        """Batch get filling object ``i``'s bytes into ``buffers[i]`` in order (capacity
        ``sum(sizes[i])``); per key the number of bytes read. Raw addresses as a ``(keys,
        ranges)`` integer array (``sizes`` of that shape, or one row for every key) are
        resolved at once and moved as columns."""
        cols = self._column_pieces(buffers, sizes, len(keys))
        if cols is not None:
            return self._get_regions(list(keys), cols, cols.totals)
        bufs, caps = self._multi_pieces(keys, buffers, sizes)
        return self._get_regions(list(keys), bufs, caps)

    def get_tensor(self, key: str, into: Any) -> Any:
        """Read an object into ``into`` (a contiguous CPU tensor of at least its size);
        returns ``into``."""
        if not into.is_contiguous():
            raise E.InvalidParams("get_tensor needs a contiguous tensor")
        nbytes = into.numel() * into.element_size()
        try:
            self._region_of(into.data_ptr(), nbytes)
        except E.NotRegistered:
            data = self.get(key)
            if len(data) > nbytes:
                raise E.BufferOverflow(
                    f"object {key!r} has {len(data)} bytes; the tensor holds {nbytes}"
                ) from None
            into.view(-1).numpy().view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
            return into
        self.get_into(key, into.data_ptr(), 0, nbytes)
        return into


def _refusal(key: Any, code: int, size: int, cap: int) -> E.StoreError:
    """Why a looked-up key is not read: its lookup code, a buffer too small, or no copy."""
    if code != 0:
        return E.error_for(code, f"get of {key!r}")
    if size > cap:
        return E.BufferOverflow(f"object {key!r} has {size} bytes; the buffer holds {cap}")
    return E.ObjectNotFound(f"no complete replica of {key!r}")


def _lease_expired(key: Any) -> E.StoreError:
    return E.LeaseExpired(f"the read lease of {key!r} ended before its copy finished")


def _read_failed(key: Any) -> E.StoreError:
    return E.TransferFailed(f"reading {key!r} from its replicas failed")


class _PartNames(Sequence[str]):
    """The names ``prefix + key + suffix`` (key-major) of a get by parts, built only when
    one is asked for (an error naming its key, a crc report): the usual batch never does."""

    __slots__ = ("prefix", "keys", "suffixes")

    def __init__(self, prefix: str, keys: list[str], suffixes: list[str]) -> None:
        self.prefix, self.keys, self.suffixes = prefix, keys, suffixes

    def __len__(self) -> int:
        return len(self.keys) * len(self.suffixes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.suffixes)
        k, s = divmod(range(len(self))[i], n)  # range: negative indexes and bounds
        return f"{self.prefix}{self.keys[k]}{self.suffixes[s]}"

    def __iter__(self) -> Any:
        return iter(P.parts_names(self.prefix, self.keys, self.suffixes))


class _Looked(NamedTuple):
    """A GetReplicas answer (table form) for the keys asked: per key its code and size
    (lists or int64 arrays),
    the slice rows (:data:`~.types.ROW` columns, key index relative to the keys asked,
    segment index into ``segs``), and when the leases end (client clock)."""

    codes: Any
    sizes: Any
    rows: np.ndarray
    segs: list[tuple[str, str, str]]
    lease_deadline: float
    crcs: Any = ()  # per key its disk copy's crc32c, -1: none (empty: no key has one)
