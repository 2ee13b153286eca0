"""The client's put protocol: PutStart -> engine WRITEs from the caller's memory into the
allocated replicas -> PutEnd (PutRevoke for the keys whose write failed); or, for a batch
of one copy per key, the one-round-trip put: engine WRITEs into this client's reservation
-> PutCommit (docs/store-master.md, "Reservations"; :mod:`.reservation`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...transfer import MemoryRegion, Op
from .. import errors as E
from .. import protocol as P
from ..types import (
    ObjectReplica,
    ReplicaRun,
    ReplicateConfig,
    keys_valid,
)
from .args import listify, per_key
from .buffers import Pieces, Places, split_pieces
from .replies import (
    BatchResults,
    coded,
    fail_all,
    fan_out,
    finish,
    invalid_key,
    rpc_parts,
    whole_error,
)
from .reservation import MAX_RESERVE, Reservation

__all__ = ["Writes"]

log = logging.getLogger(__name__)


class Writes:
    """The put forms of :class:`~kvmesh.store.client.StoreClient`."""

    def _put_regions(
        self,
        keys: list[Any],
        bufs: list[tuple[MemoryRegion, int] | E.StoreError] | Places,
        sizes: list[int],
        upsert: bool,
        config: ReplicateConfig | None,
    ) -> BatchResults:
        if config is None:
            config = self.config
        elif type(config) is not ReplicateConfig:
            # The master could not decode it: refused here, at once, not after retries.
            raise E.InvalidParams(f"config must be a ReplicateConfig, got {config!r}")
        n = len(keys)
        out: list[Any] = [None] * n
        todo: list[int] = []
        places = type(bufs) in (Places, Pieces)  # columns: every place resolved and checked
        usual = (  # every key checked at once, no buffer or size refused: nothing per key
            keys_valid(keys)
            # no buffer refused: a type test per distinct type, not per key
            and (places or not any(issubclass(t, E.StoreError) for t in set(map(type, bufs))))
            and set(map(type, sizes)) == {int}
            and min(sizes) > 0
        )
        for i, k in enumerate(() if usual else keys):
            err = invalid_key(k)
            if err is None and not places and isinstance(bufs[i], E.StoreError):
                err = bufs[i]  # type: ignore[assignment]
            if err is None and (not isinstance(sizes[i], int) or sizes[i] <= 0):
                err = E.InvalidParams(f"size of {k!r} must be a positive int, got {sizes[i]!r}")
            if err is not None:
                out[i] = err
            else:
                todo.append(i)
        if usual:
            todo = list(range(n))
        transports: list[str] = []
        for part in rpc_parts(keys, todo, key_bytes=True):
            transports = self._put_part(keys, bufs, sizes, part, out, upsert, config)
        self.last_transports = transports
        return BatchResults(out, transports)

    def _put_part(self, keys, bufs, sizes, part, out, upsert, config) -> list[str]:
        if not upsert and type(bufs) is not Pieces and self._reserved.eligible(config):
            done = self._put_committed(keys, bufs, sizes, part, out, config)
            if done is not None:
                return done
        return self._put_started(keys, bufs, sizes, part, out, upsert, config)

    def _release_reservations(self) -> None:
        """Give every reservation back (at close): idle reserved bytes are memory no other
        writer and no eviction can use until their hold lapses."""
        res = self._reserved
        with res.lock:
            held, res.by_config = list(res.by_config.items()), {}
        for config, r in held:
            try:
                self.rpc.mutate(
                    lambda rid, s, c=config, t=r.tag: P.PutCommitReq(
                        rid, s, [], [], t, 0, [], c, 0, release=True
                    ),
                    timeout=1.0,
                )
            except Exception:  # noqa: BLE001 - the hold lapses on the master anyway
                pass

    def _reserve(self, config: ReplicateConfig, want: int) -> Reservation | None:
        """A new reservation of ``want`` bytes (the rest of the old one released in the
        same entry, unless another thread's put is still writing into it: that one is left
        to lapse after its hold); None if the master has no room or takes no commits.
        Called under ``res.lock``."""
        res = self._reserved
        old = res.by_config.pop(config, None)
        tag = old.tag if old is not None and not old.busy else 0
        t0 = time.monotonic()
        try:
            resp = self.rpc.mutate(
                lambda rid, s: P.PutCommitReq(
                    rid, s, [], [], tag, 0, [], config, want, release=bool(tag)
                )
            )
        except E.InvalidParams:  # a master without commits (it cannot decode the request)
            res.supported = False
            return None
        except E.StoreError:
            return None
        if type(resp) is not P.PutCommitResp or not resp.tag or not resp.added:
            if type(resp) is P.ErrorResp and resp.code == E.InvalidParams.code:
                res.supported = False
            res.quiet_until = time.monotonic() + 1.0  # no room: not asked again at once
            return None
        if resp.align <= 0 or resp.align & (resp.align - 1):
            res.supported = False  # a broken master: its layout cannot be followed
            return None
        r = Reservation(resp.tag, resp.limit, resp.align)
        r.grant(resp.added, resp.seg, resp.hold_ms, t0)
        return r

    def _put_committed(self, keys, bufs, sizes, part, out, config) -> list[str] | None:
        """The one-round-trip put of ``part`` (None: not taken, nothing done: the caller
        takes the two-round-trip put). Its bytes are laid out end to end in one extent of
        the reservation, written, then published by one PutCommit that also refills the
        reservation to hold one more batch like it."""
        res = self._reserved
        if not res.supported:
            return None
        whole = len(part) == len(keys)
        pkeys = keys if whole else [keys[i] for i in part]
        psizes = sizes if whole else [sizes[i] for i in part]
        n = len(pkeys)
        if not n:
            return None
        guess = _extent(psizes, 64)[0]
        if guess > MAX_RESERVE or time.monotonic() < res.quiet_until:
            return None
        margin = min(1.0, 0.05 * self.transfer_timeout)
        with res.lock:
            r = res.usable(config, margin)
            if r is None:
                r = self._reserve(config, guess)
                if r is None:
                    return None
                res.by_config[config] = r
            total, rounded = _extent(psizes, r.align)
            if max(psizes) > r.limit:
                return None
            place = r.take(total)
            if place is None:  # fragmented or too small: a new one, the rest released
                r = self._reserve(config, total)
                if r is None:
                    return None
                res.by_config[config] = r
                place = r.take(total)
                if place is None:
                    return None
            # room for one more batch like this one (the next put's, as a put stream goes)
            refill = max(0, total - r.free_bytes())
            r.busy += 1
        try:
            return self._commit_carved(
                keys, bufs, sizes, part, out, config, r, place, refill, total, rounded
            )
        finally:
            with res.lock:
                r.busy -= 1

    def _commit_carved(
        self, keys, bufs, sizes, part, out, config, r, place, refill, total, rounded
    ):
        """Write ``part`` into the extent ``place`` carved from reservation ``r`` and publish
        it with one PutCommit (see :meth:`_put_committed`; ``total``, ``rounded``: its
        :func:`_extent`)."""
        res = self._reserved
        whole = len(part) == len(keys)
        pkeys = keys if whole else [keys[i] for i in part]
        psizes = sizes if whole else [sizes[i] for i in part]
        n = len(pkeys)
        sid, base = place
        step = rounded[0]
        if rounded.count(step) == n:  # equal sizes (the usual batch): no numpy per put
            offs = list(range(base, base + total, step))
        else:
            offs = (np.cumsum(rounded) - np.asarray(rounded, np.int64) + base).tolist()
        places = type(bufs) is Places
        pbufs = bufs if whole else bufs.take(part) if places else [bufs[i] for i in part]
        # One request only for a batch the engine runs in this thread anyway: a larger one
        # goes to its workers in parts, and 256 KiB x 128 measured no faster as one request.
        one = total <= self.engine.config.split_bytes
        arrays = _one_run(pbufs, psizes, rounded, base, r.segs[sid]) if one else None
        if arrays is None:
            arrays = _arrays(ReplicaRun([r.segs[sid]], [0] * n, offs, psizes), pbufs, psizes)
        left = min(self.transfer_timeout, r.deadline - time.monotonic())
        if arrays is None or left <= 0:
            with res.lock:
                r.give(sid, base, total)
            return None
        bad_owners, transports = self._move_arrays(Op.WRITE, *arrays, left)
        if len(arrays[0]) == n:
            failed = set(bad_owners.tolist())
        else:  # one request for the whole batch (_one_run): its failure is every key's
            failed = set(range(n)) if len(bad_owners) else set()
        ok = [j for j in range(n) if j not in failed] if failed else list(range(n))
        okeys = pkeys if not failed else [pkeys[j] for j in ok]
        osizes = psizes if not failed else [psizes[j] for j in ok]
        ooffs = offs if not failed else [offs[j] for j in ok]
        t0 = time.monotonic()
        try:
            resp = self.rpc.mutate(
                lambda rid, s: P.PutCommitReq(
                    rid, s, okeys, osizes, r.tag, sid, ooffs, config, refill
                )
            )
        except E.StoreError as e:
            resp = e
        where = part if not failed else [part[j] for j in ok]
        if type(resp) is not P.PutCommitResp or len(resp.codes) != len(okeys):
            with res.lock:  # the outcome is unknown: this reservation is not used again
                if res.by_config.get(config) is r:
                    del res.by_config[config]
            fail_all(out, where, whole_error(resp))
            for j in failed:
                out[part[j]] = E.TransferFailed(f"writing {pkeys[j]!r} to its replicas failed")
            return transports
        with res.lock:
            for j in failed:
                r.give(sid, offs[j], int(rounded[j]))
            if failed:  # its segment may be gone (its node expired): not used again
                r.deadline = 0.0
            if resp.tag != r.tag:  # released (or replaced): what is left here is gone
                if res.by_config.get(config) is r:
                    del res.by_config[config]
                if resp.tag:
                    r2 = Reservation(resp.tag, r.limit, r.align)
                    r2.grant(resp.added, resp.seg, resp.hold_ms, t0)
                    res.by_config[config] = r2
            else:
                r.grant(resp.added, resp.seg, resp.hold_ms, t0)
                if E.InvalidWrite.code in resp.codes:
                    r.deadline = 0.0  # not ours as we thought (drained): not used again
        # written into bytes the master no longer holds for us, or not written: put anew
        again = [part[j] for j in sorted(failed)]
        if not any(resp.codes) and not again:
            return transports
        for j, code in zip(ok, resp.codes):
            if code == 0:
                continue
            if code == E.InvalidWrite.code:  # not (or no longer) bytes of our reservation
                again.append(part[j])
                continue
            if resp.tag == r.tag:  # refused before its bytes were taken: still ours
                with res.lock:
                    r.give(sid, offs[j], int(rounded[j]))
            out[part[j]] = E.error_for(code, f"put of {keys[part[j]]!r}")
        if again:
            transports = self._put_started(keys, bufs, sizes, sorted(again), out, False, config)
        return transports

    def _put_started(self, keys, bufs, sizes, part, out, upsert, config) -> list[str]:
        whole = len(part) == len(keys)  # the whole batch in one RPC (part is 0..n-1)
        pkeys = keys if whole else [keys[i] for i in part]
        psizes = sizes if whole else [sizes[i] for i in part]
        t0 = time.monotonic()
        resp = self.rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, pkeys, psizes, config, upsert))
        if type(resp) is not P.PutStartResp or not resp.fits(len(part)):
            fail_all(out, part, whole_error(resp))
            return []
        versions = resp.versions
        places = type(bufs) in (Places, Pieces)
        pbufs = bufs if whole else bufs.take(part) if places else [bufs[i] for i in part]
        arrays = _run_requests(resp, pbufs, psizes)
        if arrays is not None:  # the usual batch: every key one slice, the engine's arrays
            copies, malformed, reqs = [], set(), []
            started = list(range(len(part)))
        else:
            copies = resp.copies()
            malformed = _malformed_copies(resp.codes, copies, resp.run, psizes)
            reqs, started = [], []
        for j, i in enumerate(part if arrays is None else ()):
            code = resp.codes[j]
            if code != 0:
                out[i] = E.error_for(code, f"put of {keys[i]!r}")
                continue
            if malformed and j in malformed:
                out[i] = E.InternalError(f"the master's copies of {keys[i]!r} are malformed")
                continue
            started.append(j)
            for rep in copies[j] or []:
                reqs.extend(_copy_reqs(j, bufs.at(i) if places else bufs[i], rep))
        # The allocation is ours only until the master's put timeout: writes must be over
        # well before it (a reclaimed range may be handed to another put). Counted from
        # before PutStart left, with a fifth of it as margin; too late -> revoke, no write.
        left = self.transfer_timeout
        if resp.hold_ms:
            left = min(left, t0 + 0.8 * resp.hold_ms / 1000.0 - time.monotonic())
        if left <= 0:
            failed, transports = set(started if arrays is not None else (j for j, *_ in reqs)), []
        elif arrays is not None:
            bad_owners, transports = self._move_arrays(Op.WRITE, *arrays, left)
            failed = set(bad_owners.tolist())
        else:
            failed, transports = self._move(Op.WRITE, reqs, left) if reqs else (set(), [])
        if failed:
            ok = [j for j in started if j not in failed]
            bad = [j for j in started if j in failed]
        else:
            ok, bad = started, []
        if bad:
            bkeys = [pkeys[j] for j in bad]
            bvers = [versions[j] for j in bad]
            try:
                self.rpc.mutate(lambda rid, s: P.PutRevokeReq(rid, s, bkeys, bvers))
            except E.StoreError as e:  # the master reclaims them after its put timeout
                log.warning("store: put_revoke failed: %s", e)
            for j in bad:
                out[part[j]] = E.TransferFailed(f"writing {pkeys[j]!r} to its replicas failed")
        if ok:
            whole = len(ok) == len(pkeys)  # every key started and written, in order
            okeys = pkeys if whole else [pkeys[j] for j in ok]
            overs = versions if whole else [versions[j] for j in ok]
            r2 = self.rpc.mutate(lambda rid, s: P.PutEndReq(rid, s, okeys, overs))
            where = part if whole else [part[j] for j in ok]
            each = coded("put_end", keys, where)
            fan_out(out, where, r2, P.CodesResp, ("codes",), each)
        return transports

    def put_from(
        self,
        keys: Any,
        buffer: Any,
        offsets: Any = 0,
        sizes: Any = None,
        *,
        config: ReplicateConfig | None = None,
    ) -> Any:
        """Store ``sizes[i]`` bytes at ``buffer + offsets[i]`` (registered memory) under
        ``keys[i]``, zero-copy. ``buffer``: the registered object, its MemoryRegion, or a raw
        address inside registered memory (one per key allowed: a list)."""
        return self._put_api(keys, buffer, offsets, sizes, False, config)

    def upsert_from(
        self,
        keys: Any,
        buffer: Any,
        offsets: Any = 0,
        sizes: Any = None,
        *,
        config: ReplicateConfig | None = None,
    ) -> Any:
        """:meth:`put_from` that replaces existing objects instead of answering ObjectExists."""
        return self._put_api(keys, buffer, offsets, sizes, True, config)

    def put_from_raw(
        self,
        keys: Sequence[Any],
        ptrs: Any,
        sizes: Any,
        *,
        upsert: bool = False,
        config: ReplicateConfig | None = None,
    ) -> BatchResults:
        """Batch :meth:`put_from` of ``sizes[i]`` bytes at the raw address ``ptrs[i]`` inside
        registered memory under ``keys[i]``: integer columns (numpy arrays as they are, or
        sequences), resolved in one vectorised lookup and written from the master's replica
        runs without a tuple per key."""
        ks = list(keys)
        places = self._raw_places(ptrs, 0, sizes, len(ks))
        if places is not None:
            return self._put_regions(ks, places, places.caps.tolist(), upsert, config)
        # Some address or size is refused: the per-key path names which.
        szs = sizes if np.ndim(sizes) == 0 else np.asarray(sizes).tolist()
        return self._put_api(ks, np.asarray(ptrs).reshape(-1).tolist(), 0, szs, upsert, config)

    def _put_api(self, keys, buffer, offsets, sizes, upsert, config) -> Any:
        ks, batch = listify(keys)
        n = len(ks)
        if sizes is not None and n:
            if batch and isinstance(buffer, list):  # raw addresses, resolved at once
                places = self._raw_places(buffer, offsets, sizes, n)
            else:  # every key's range inside the one buffer: checked as columns
                places = self._one_region(buffer, offsets, sizes, n, batch)
            if places is not None:
                caps = places.caps
                szs = caps.tolist() if type(caps) is np.ndarray else list(caps)
                return finish(self._put_regions(ks, places, szs, upsert, config), batch)
        offs = per_key(offsets, n, "offsets", batch)
        szs = per_key(sizes, n, "sizes", batch)
        bufl = buffer if (batch and isinstance(buffer, list)) else [buffer] * n
        if len(bufl) != n:
            raise E.InvalidParams(f"{n} keys but {len(bufl)} buffers")
        bufs: list[Any] = []
        where = self._resolver()
        for i in range(n):
            try:
                sz = szs[i]
                if sz is None:
                    raise E.InvalidParams("a size is required")
                region, base = where(bufl[i], sz)
                off = base + int(offs[i])
                if offs[i] < 0 or off + sz > region.size:
                    raise E.InvalidParams(
                        f"range [{off}, {off + sz}) is outside the registered buffer "
                        f"of {region.size} bytes"
                    )
                bufs.append((region, off))
            except E.StoreError as e:
                bufs.append(e)
        return finish(
            self._put_regions(ks, bufs, [s if s is not None else 0 for s in szs], upsert, config),
            batch,
        )

    def put_from_multi(
        self,
        keys: list[str],
        buffers: list[list[Any]],
        sizes: list[list[int]],
        *,
        config: ReplicateConfig | None = None,
        upsert: bool = False,
    ) -> BatchResults:
        """Batch put where object ``i`` is the concatenation of ``sizes[i][k]`` bytes at
        ``buffers[i][k]`` (registered memory), written zero-copy."""
        cols = self._column_pieces(buffers, sizes, len(keys))
        if cols is not None:  # raw-address columns: moved as columns
            return self._put_regions(list(keys), cols, cols.totals.tolist(), upsert, config)
        bufs, totals = self._multi_pieces(keys, buffers, sizes)
        return self._put_regions(list(keys), bufs, totals, upsert, config)

    def put(self, keys: Any, values: Any, *, config: ReplicateConfig | None = None) -> Any:
        """Store bytes-like ``values`` (one copy into a registered staging buffer)."""
        return self._put_bytes(keys, values, False, config)

    def upsert(self, keys: Any, values: Any, *, config: ReplicateConfig | None = None) -> Any:
        """:meth:`put` that replaces existing objects (a size change reallocates)."""
        return self._put_bytes(keys, values, True, config)

    def _put_bytes(self, keys, values, upsert, config) -> Any:
        ks, batch = listify(keys)
        vals = list(values) if batch else [values]
        if len(vals) != len(ks):
            raise E.InvalidParams(f"{len(ks)} keys but {len(vals)} values")
        views = []
        for v in vals:
            try:
                views.append(memoryview(v).cast("B"))
            except TypeError:
                raise E.InvalidParams(
                    f"values must be bytes-like, got {type(v).__name__}"
                ) from None
        total = sum(len(v) for v in views)
        stage = self._staging.acquire(max(1, total))
        try:
            region, arr = stage
            bufs: list[Any] = []
            pos = 0
            for v in views:
                arr[pos : pos + len(v)] = np.frombuffer(v, np.uint8)
                bufs.append((region, pos))
                pos += len(v)
            res = self._put_regions(ks, bufs, [len(v) for v in views], upsert, config)
        finally:
            self._staging.release(stage)
        return finish(res, batch)

    def put_tensor(self, key: str, tensor: Any, *, upsert: bool = False) -> None:
        """Store a contiguous CPU tensor's bytes (zero-copy when it lies in registered
        memory, else through staging). Shape/dtype are the caller's to remember."""
        t = tensor.detach()
        if not t.is_contiguous():
            raise E.InvalidParams("put_tensor needs a contiguous tensor")
        nbytes = t.numel() * t.element_size()
        try:
            self._region_of(t.data_ptr(), nbytes)
        except E.NotRegistered:
            data = t.cpu().contiguous().view(-1).numpy().view(np.uint8) if nbytes else b""
            return (self.upsert if upsert else self.put)(key, data)
        return self._put_api(key, t.data_ptr(), 0, nbytes, upsert, None)


def _malformed_copies(codes: list[int], copies: list[Any], run: Any, sizes: list[int]) -> set[int]:
    """Keys of a put answer (part indices) answered 0 without a copy, or with a copy whose
    slices are not positive or do not add up to the object's size: a broken or forged
    answer. Written as told, a longer copy reads past the key's bytes in the caller's memory
    and sends them to the named segment; a missing one reports a put that wrote nothing."""
    if run is not None and run.lengths == sizes and min(run.where, default=0) >= 0:
        return set()  # the usual batch: one slice per key, each exactly its size
    bad = set()
    for j, (code, reps, size) in enumerate(zip(codes, copies, sizes)):
        if code != 0:
            continue
        if not reps:
            bad.add(j)
        for r in reps or ():
            sl = r.slices
            if len(sl) == 1:  # the usual copy (sizes are positive: checked before PutStart)
                if sl[0].length != size:
                    bad.add(j)
            elif not sl or sum(x.length for x in sl) != size or min(x.length for x in sl) <= 0:
                bad.add(j)
    return bad


def _run_requests(resp: P.PutStartResp, bufs: list[Any], sizes: list[int]) -> tuple | None:
    """The engine requests of a put answered in the compact form (``resp.run``) where every
    key was started with one slice of exactly its size and comes from one contiguous buffer,
    as :meth:`Moves._move_arrays` takes them (owner, regions, region index, local
    offset, segments, segment index, remote offset, length): built from the reply's columns
    without expanding a copy object per key. ``None``: any other answer (a code, no copy, a
    forged size, pieces) goes through the per-key loop and its checks."""
    run = resp.run
    if run is None or any(resp.codes) or run.lengths != sizes or min(run.where, default=-1) < 0:
        return None
    return _arrays(run, bufs, sizes)


def _extent(sizes: list[int], a: int) -> tuple[int, list[int]]:
    """The bytes a batch of positive int ``sizes`` takes laid end to end, each rounded up
    to the alignment ``a``, and those rounded sizes: list arithmetic when every size is
    the same (the usual batch; ~1 us), numpy otherwise."""
    s0 = sizes[0]
    n = len(sizes)
    if sizes.count(s0) == n:
        step = (s0 + a - 1) & -a
        return step * n, [step] * n
    rounded = ((np.asarray(sizes, np.int64) + (a - 1)) & -a).tolist()
    return sum(rounded), rounded


def _one_run(
    bufs: Any, sizes: list[int], rounded: list[int], base: int, seg: tuple
) -> tuple | None:
    """The engine request of a one-round-trip put whose keys lie end to end in one
    registration (``bufs``: :class:`Places` in one region) and whose sizes, but for the
    last, are multiples of the alignment: the extent is then the same bytes in the same
    order, written as one request of their total (None: any other batch). One request
    instead of one per key: the engine's per-request checks and coalescing are skipped."""
    n = len(sizes)
    if type(bufs) is not Places or bufs.reg is not None or n < 2:
        return None
    if rounded[: n - 1] != sizes[: n - 1]:
        return None
    so = np.asarray(bufs.offs, np.int64)
    gaps = so[1:] - so[:-1]
    if sizes.count(sizes[0]) == n:  # equal sizes: one scalar compare of the gaps
        if not (gaps == sizes[0]).all():
            return None
    elif not np.array_equal(gaps, np.asarray(sizes[:-1], np.int64)):
        return None
    one = np.zeros(1, np.int64)
    return (
        one,
        [bufs.region],
        one,
        so[:1],
        [seg],
        one,
        np.array([base], np.int64),
        np.array([sum(sizes)], np.int64),
    )


def _arrays(run: ReplicaRun, bufs: Any, sizes: list[int]) -> tuple | None:
    """The engine requests of :func:`_run_requests` for ``run`` (every key placed)."""
    n = len(sizes)
    if type(bufs) is Pieces:  # multi-range columns: each range one request, in order
        r = bufs.ln.shape[1]
        before = np.cumsum(bufs.ln, axis=1) - bufs.ln
        return (
            np.repeat(np.arange(n, dtype=np.int64), r),
            bufs.regions,
            bufs.reg.reshape(-1),
            bufs.off.reshape(-1),
            list(run.segs),
            np.repeat(np.array(run.where, np.int64), r),
            (np.array(run.offsets, np.int64)[:, None] + before).reshape(-1),
            bufs.ln.reshape(-1),
        )
    if type(bufs) is Places:  # the caller's places as columns: no tuple per key
        return (
            np.arange(n, dtype=np.int64),
            [bufs.region] if bufs.reg is None else bufs.regions,
            np.zeros(n, np.int64) if bufs.reg is None else np.asarray(bufs.reg, np.int64),
            np.asarray(bufs.offs, np.int64),
            list(run.segs),
            np.array(run.where, np.int64),
            np.array(run.offsets, np.int64),
            np.array(sizes, np.int64),
        )
    regions: list[MemoryRegion] = []
    first = bufs[0]
    if type(first) is not tuple:
        return None
    if all(type(b) is tuple and b[0] is first[0] for b in bufs):
        regions.append(first[0])
        reg = np.zeros(len(bufs), np.int64)
    else:
        if not all(type(b) is tuple for b in bufs):
            return None
        idx: dict[int, int] = {}
        for b in bufs:
            if id(b[0]) not in idx:
                idx[id(b[0])] = len(regions)
                regions.append(b[0])
        reg = np.array([idx[id(b[0])] for b in bufs], np.int64)
    n = len(bufs)
    return (
        np.arange(n, dtype=np.int64),
        regions,
        reg,
        np.array([b[1] for b in bufs], np.int64),
        list(run.segs),
        np.array(run.where, np.int64),
        np.array(run.offsets, np.int64),
        np.array(sizes, np.int64),
    )


def _copy_reqs(owner: int, buf: Any, replica: ObjectReplica) -> list[tuple]:
    """Engine requests moving one copy's slices to/from the caller's memory: ``buf`` is
    ``(region, offset)`` (contiguous) or a list of ``(region, offset, length)`` pieces that
    the object's bytes fill in order (the multi-buffer forms)."""
    if type(buf) is tuple:
        region, pos = buf
        out = []
        for sl in replica.slices:
            out.append((owner, region, pos, sl.endpoint, sl.segment, sl.offset, sl.length))
            pos += sl.length
        return out
    slices = (((sl.endpoint, sl.segment), sl.offset, sl.length) for sl in replica.slices)
    return [(owner, rg, lo, *where, ro, ln) for rg, lo, where, ro, ln in split_pieces(buf, slices)]
