"""``kvmesh.StoreClient``: the synchronous, thread-safe, batch-first client of the store.

Every call takes one key or a list of keys. A list is one RPC to the master (at most one log
entry) plus one transfer-engine batch, and returns a :class:`BatchResults`: one entry per
key, in order -- the single call's value on success, the :class:`~.errors.StoreError` instance
on failure -- so one bad key never fails the batch. A single key raises that error instead.

Data path (the master never sees a byte):

* put: ``PutStart`` allocates PROCESSING replicas -> the engine WRITEs straight from the
  caller's registered buffer into the replicas' segments -> ``PutEnd`` makes them visible
  (``PutRevoke`` frees the keys whose write failed);
* get: ``GetReplicas`` returns COMPLETE replicas under a read lease -> the engine READs into
  the caller's buffer. The lease is counted from *before* the request left (the attempt the
  master answered, not an earlier one lost to an outage), so the client's view expires
  before the master's; a copy that finishes after it answers LeaseExpired for
  that key and its bytes must be ignored (the memory may have been reused).

Zero-copy: :meth:`StoreClient.register_buffer` once, then :meth:`put_from` / :meth:`get_into`
at offsets. The convenience forms (:meth:`put` of bytes, :meth:`get` returning bytes, tensor
helpers on unregistered tensors) go through internal registered staging buffers (one copy).

``BatchResults.transports`` names the transports that moved the batch's bytes.
"""

from __future__ import annotations

import logging
import operator
import os
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..net.security import SecurityConfig
from ..transfer import MemoryRegion, Op, TransferEngine, TransferError, get_engine
from ..transfer.memory import describe_object
from . import errors as E
from . import protocol as P
from .node import StorageNode
from .rpc import MasterClient
from .types import (
    MAX_OBJECT_SIZE,
    ROW,
    ObjectReplica,
    ReplicateConfig,
    bad_parts,
    key_error,
    keys_valid,
)

__all__ = ["BatchResults", "Removed", "StoreClient"]

log = logging.getLogger(__name__)

MAX_KEYS_PER_RPC = 4096
MAX_KEY_BYTES_PER_RPC = 512 << 10
"""Key bytes of one mutating request: it becomes one log entry, and the log takes entries of
at most 1 MiB (keys may be 1 KiB, so 4096 of them would not fit)."""


def _rpc_parts(idx: list[int], keys: Sequence[Any]) -> list[list[int]]:
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


def _valid_indices(keys: Sequence[Any], out: list[Any]) -> list[int]:
    """Indexes of the well-formed keys; each malformed key's error goes into ``out``."""
    idx: list[int] = []
    for i, k in enumerate(keys):
        err = _key_error(k)
        if err is not None:
            out[i] = err
        else:
            idx.append(i)
    return idx


_STAGING_MIN = 1 << 20
_STAGING_KEEP = 64 << 20


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


class BatchResults(list):
    """A list with one result per key plus ``transports`` (the transports that served the
    batch's bytes). ``codes``: 0 or the error code per key; ``ok``: no key failed."""

    transports: list[str]

    def __init__(self, items: Sequence[Any] = (), transports: list[str] | None = None) -> None:
        super().__init__(items)
        self.transports = transports or []

    @property
    def codes(self) -> list[int]:
        return [x.code if isinstance(x, E.StoreError) else 0 for x in self]

    @property
    def ok(self) -> bool:
        return not any(isinstance(x, E.StoreError) for x in self)


def _key_error(key: Any) -> E.StoreError | None:
    why = key_error(key)
    return None if why is None else E.InvalidKey(f"{why}: {str(key)[:100]!r}")


class _Staging:
    """Registered scratch buffers for the copying forms (put of bytes, get returning bytes)."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._free: list[tuple[MemoryRegion, np.ndarray]] = []
        self._all: list[MemoryRegion] = []

    def acquire(self, nbytes: int) -> tuple[MemoryRegion, np.ndarray]:
        with self._lock:
            best = None
            for i, (r, _arr) in enumerate(self._free):
                if r.size >= nbytes and (best is None or r.size < self._free[best][0].size):
                    best = i
            if best is not None:
                return self._free.pop(best)
        size = max(_STAGING_MIN, 1 << max(0, (nbytes - 1).bit_length()))
        arr = np.empty(size, np.uint8)
        region = self.engine.register(arr)
        with self._lock:
            self._all.append(region)
        return region, arr

    def release(self, item: tuple[MemoryRegion, np.ndarray]) -> None:
        with self._lock:
            # Keep a few for reuse (registration is expensive), but not huge ones.
            if len(self._free) < 4 and item[0].size <= _STAGING_KEEP:
                self._free.append(item)
                return
            self._all.remove(item[0])
        self.engine.unregister(item[0])

    def close(self) -> None:
        with self._lock:
            regions, self._all, self._free = self._all, [], []
        for r in regions:
            try:
                self.engine.unregister(r)
            except Exception:  # noqa: BLE001
                pass


class StoreClient:
    """Client of a store cluster (or of an embedded single-host one).

    ``master``: ``"host:port"``, ``"h1:p1,h2:p2,h3:p3"`` or a list of store RPC addresses of
    the master replicas; ``None`` starts (or reuses) this process's embedded master (see
    :mod:`kvmesh.store.embedded_master`) and contributes a local segment. ``segment_size``: bytes
    this process contributes as a storage node (default 0 with a master address, 256 MiB
    embedded). ``replica_num``: copies per object (on distinct nodes). ``token``/``security``:
    the cluster's shared secret (default: ``KVMESH_TOKEN`` etc. from the environment).
    ``spin_us``: how long a master call busy-polls for its reply before blocking (default
    ``$KVMESH_SPIN_US`` or 100 us; 0 = off; see :class:`~.rpc.MasterClient`).
    """

    def __init__(
        self,
        master: str | list[str] | None = None,
        *,
        segment_size: int | None = None,
        replica_num: int = 1,
        token: str | None = None,
        security: SecurityConfig | None = None,
        engine: TransferEngine | None = None,
        timeout: float = 15.0,
        transfer_timeout: float = 30.0,
        heartbeat_s: float = 2.0,
        spin_us: float | None = None,
    ) -> None:
        self._embedded = None
        sec = security
        if sec is None and token is not None:
            sec = SecurityConfig(token=token)
        if master is None:
            from .embedded_master import acquire_embedded

            self._embedded = acquire_embedded()
            addrs = [self._embedded.address]
            sec = self._embedded.security
            if segment_size is None:
                segment_size = int(os.environ.get("KVMESH_STORE_SEGMENT", str(256 << 20)))
        else:
            addrs = [
                a.strip()
                for a in (master.split(",") if isinstance(master, str) else master)
                if a.strip()
            ]
            if sec is None:
                sec = SecurityConfig.from_env()
        self.engine = engine if engine is not None else get_engine()
        self.rpc = MasterClient(
            addrs,
            sec,
            name=f"store-client-{self.engine.node_id}",
            # With a segment this process is also storage node <engine node id>: it needs
            # that node's credential (or the secret), not only a client's.
            node_id=self.engine.node_id if segment_size else None,
            timeout=timeout,
            spin_us=spin_us,
        )
        self.config = ReplicateConfig(replica_num=replica_num, writer_host=self.engine.host_id)
        self.transfer_timeout = transfer_timeout
        self._buffers: dict[int, MemoryRegion] = {}
        self._buf_lock = threading.Lock()
        self._staging = _Staging(self.engine)
        self._seg_lock = threading.Lock()
        self._segments: dict[tuple[str, str], Any] = {}
        self.last_transports: list[str] = []
        # "read:shm" -> [batches, bytes]: what moved over which transport (this client).
        self.stats: dict[str, list[int]] = {}
        self._closed = False
        self.node: StorageNode | None = None
        if segment_size:
            try:
                self.node = StorageNode(
                    self.rpc, segment_size, engine=self.engine, heartbeat_s=heartbeat_s
                ).start()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Unmount this process's segment (if any), release buffers and connections."""
        if self._closed:
            return
        self._closed = True
        if self.node is not None:
            self.node.close()
        self._staging.close()
        with self._buf_lock:
            regions, self._buffers = list(self._buffers.values()), {}
        for r in regions:
            try:
                self.engine.unregister(r)
            except Exception:  # noqa: BLE001
                pass
        self.rpc.close()
        if self._embedded is not None:
            from .embedded_master import release_embedded

            release_embedded(self._embedded)
            self._embedded = None

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ buffers

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

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _listify(keys: Any) -> tuple[list[Any], bool]:
        if isinstance(keys, (list, tuple)):
            return list(keys), True
        return [keys], False

    def _finish(self, results: BatchResults, batch: bool) -> Any:
        if batch:
            return results
        r = results[0]
        if isinstance(r, E.StoreError):
            raise r
        return r

    def _segment(self, endpoint: str, name: str) -> Any:
        key = (endpoint, name)
        seg = self._segments.get(key)
        if seg is None or getattr(seg, "closed", False):
            seg = self.engine.open_segment(endpoint, name)
            with self._seg_lock:
                self._segments[key] = seg
        return seg

    def _count(self, op: Op, res: Any) -> tuple[str, ...]:
        """Count a finished engine batch in :attr:`stats`; returns its transports' names."""
        kinds = tuple(res.transports)
        names = _COUNT_KEYS.get((op, kinds))
        if names is None:  # an enum's .value and the key's join cost more than the count
            vals = tuple(t.value for t in kinds)
            names = _COUNT_KEYS[(op, kinds)] = (f"{op.value}:{','.join(vals) or '-'}", *vals)
        with self._seg_lock:
            st = self.stats.get(names[0])
            if st is None:
                st = self.stats[names[0]] = [0, 0]
            st[0] += 1
            st[1] += int(res.nbytes)
        return names[1:]

    def _forget_segment(self, endpoint: str, name: str) -> None:
        with self._seg_lock:
            self._segments.pop((endpoint, name), None)

    def _move(
        self,
        op: Op,
        reqs: list[tuple[int, MemoryRegion, int, str, str, int, int]],
        timeout: float | None = None,
    ) -> tuple[set[int], list[str]]:
        """Move ``(owner, region, local_off, endpoint, segment, remote_off, length)`` requests
        as one engine batch. Returns the owners (caller indices) whose requests failed and
        the transports used."""
        regs: dict[int, int] = {}
        regions: list[MemoryRegion] = []
        segx: dict[tuple[str, str], int] = {}
        segs: list[tuple[str, str, str]] = []
        cols = np.empty((len(reqs), 6), np.int64)  # owner, region, lo, segment, ro, ln
        for r, (owner, region, lo, ep, name, ro, ln) in enumerate(reqs):
            x = regs.get(id(region))
            if x is None:
                x = regs[id(region)] = len(regions)
                regions.append(region)
            y = segx.get((ep, name))
            if y is None:
                y = segx[(ep, name)] = len(segs)
                segs.append((name, "", ep))
            cols[r] = (owner, x, lo, y, ro, ln)
        failed, transports = self._move_arrays(
            op, cols[:, 0], regions, cols[:, 1], cols[:, 2], segs, cols[:, 3], cols[:, 4],
            cols[:, 5], timeout,
        )  # fmt: skip
        return set(failed.tolist()), transports

    def _open(self, seg: tuple[str, str, str]) -> Any:
        """The engine's handle on segment ``(name, node id, endpoint)``; None (logged) when
        it cannot be reached: its requests fail."""
        name, _node, ep = seg
        try:
            return self._segment(ep, name)
        except (TransferError, OSError, ValueError) as e:
            log.info("store: segment %s at %s unreachable: %s", name, ep, e)
            return None

    def _transfer(
        self,
        op: Op,
        region: MemoryRegion,
        lo: Any,
        handle: Any,
        seg: tuple[str, str, str],
        ro: Any,
        ln: Any,
        deadline: float,
    ) -> tuple[str, ...] | None:
        """One engine batch between ``region`` and the open segment ``seg``: int64 arrays of
        offsets and lengths, or three ints for one request (a single get: no arrays). The
        transports used, or None (logged, the segment forgotten) when it failed."""
        try:
            if type(ln) is int:
                move = self.engine.read if op is Op.READ else self.engine.write
                res = move(region, lo, handle, ro, ln, timeout=deadline)
            else:
                res = self.engine.transfer(op, region, lo, handle, ro, ln, timeout=deadline)
            return self._count(op, res)
        except (TransferError, OSError, ValueError) as e:
            name, _node, ep = seg
            log.info("store: %s batch on %s failed: %s", op.value, name, e)
            self._forget_segment(ep, name)
            return None

    def _move_arrays(
        self,
        op: Op,
        owner: np.ndarray,
        regions: list[MemoryRegion],
        reg: np.ndarray,
        lo: np.ndarray,
        segs: list[tuple[str, str, str]],
        seg: np.ndarray,
        ro: np.ndarray,
        ln: np.ndarray,
        timeout: float | None = None,
    ) -> tuple[np.ndarray, list[str]]:
        """Move request ``r``: ``ln[r]`` bytes between ``regions[reg[r]]`` at ``lo[r]`` and
        segment ``segs[seg[r]]`` (name, node id, endpoint) at ``ro[r]``, as one engine batch.
        Returns the distinct owners with a failed request and the transports used."""
        deadline = self.transfer_timeout if timeout is None else timeout
        transports: set[str] = set()
        handles: dict[int, Any] = {}
        dead: list[int] = []
        for y in np.unique(seg).tolist() if len(seg) > 1 else seg.tolist():
            h = self._open(segs[y])
            if h is None:
                dead.append(y)
            else:
                handles[y] = h
        failed: list[np.ndarray] = []
        if dead:
            gone = np.isin(seg, dead)
            failed.append(owner[gone])
            keep = ~gone
            owner, reg, lo, seg, ro, ln = (
                owner[keep],
                reg[keep],
                lo[keep],
                seg[keep],
                ro[keep],
                ln[keep],
            )
        if not len(owner):
            return _owners(failed), []
        group = None if len(owner) == 1 else reg * len(segs) + seg
        if group is None or int(group.min()) == int(group.max()):
            x, y = int(reg[0]), int(seg[0])
            used = self._transfer(op, regions[x], lo, handles[y], segs[y], ro, ln, deadline)
            if used is None:
                failed.append(owner)
                return _owners(failed), []
            if not failed and len(used) <= 1:  # one request or group, all moved
                return _NO_OWNERS, list(used)
            transports.update(used)
            return _owners(failed), sorted(transports)
        order = np.argsort(group, kind="stable")
        group, owner = group[order], owner[order]
        reg, lo, seg, ro, ln = reg[order], lo[order], seg[order], ro[order], ln[order]
        cuts = [0, *(np.flatnonzero(group[1:] != group[:-1]) + 1).tolist(), len(group)]
        b = self.engine.batch()
        try:
            for a, z in zip(cuts[:-1], cuts[1:]):
                b.add_many(
                    op, regions[int(reg[a])], lo[a:z], handles[int(seg[a])], ro[a:z], ln[a:z]
                )
            try:
                b.submit(deadline)
            except TransferError:
                # One group was refused before anything moved: run the groups one by one.
                b.free()
                for a, z in zip(cuts[:-1], cuts[1:]):
                    sl = slice(a, z)
                    f, t = self._move_arrays(
                        op, owner[sl], regions, reg[sl], lo[sl], segs, seg[sl], ro[sl], ln[sl],
                        deadline,
                    )  # fmt: skip
                    failed.append(f)
                    transports.update(t)
                return _owners(failed), sorted(transports)
            res = b.wait(raise_on_error=False)
            transports.update(self._count(op, res))
            failed.append(owner[b.status() != 1])
        finally:
            b.free()
        return _owners(failed), sorted(transports)

    # ------------------------------------------------------------------ put

    def _put_regions(
        self,
        keys: list[Any],
        bufs: list[tuple[MemoryRegion, int] | E.StoreError],
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
        usual = (  # every key checked at once, no buffer or size refused: nothing per key
            keys_valid(keys)
            # no buffer refused: a type test per distinct type, not per key
            and not any(issubclass(t, E.StoreError) for t in set(map(type, bufs)))
            and set(map(type, sizes)) == {int}
            and min(sizes) > 0
        )
        for i, k in enumerate(() if usual else keys):
            err = _key_error(k)
            if err is None and isinstance(bufs[i], E.StoreError):
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
        for part in _rpc_parts(todo, keys):
            transports = self._put_part(keys, bufs, sizes, part, out, upsert, config)
        self.last_transports = transports
        return BatchResults(out, transports)

    def _put_part(self, keys, bufs, sizes, part, out, upsert, config) -> list[str]:
        if len(part) == len(keys):  # the whole batch in one RPC (part is 0..n-1)
            pkeys, psizes, pbufs = keys, sizes, bufs
        else:
            pkeys = [keys[i] for i in part]
            psizes = [sizes[i] for i in part]
            pbufs = [bufs[i] for i in part]
        t0 = time.monotonic()
        resp = self.rpc.mutate(lambda rid, s: P.PutStartReq(rid, s, pkeys, psizes, config, upsert))
        if type(resp) is not P.PutStartResp or not resp.fits(len(part)):
            err = _whole_error(resp)
            for i in part:
                out[i] = err
            return []
        versions = resp.versions
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
                reqs.extend(_copy_reqs(j, bufs[i], rep))
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
            if type(r2) is P.CodesResp and len(r2.codes) == len(ok):
                for j, code in zip(ok, r2.codes) if any(r2.codes) else ():  # else all None
                    out[part[j]] = (
                        None if code == 0 else E.error_for(code, f"put_end of {pkeys[j]!r}")
                    )
            else:
                err = _whole_error(r2)
                for j in ok:
                    out[part[j]] = err
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

    def _put_api(self, keys, buffer, offsets, sizes, upsert, config) -> Any:
        ks, batch = self._listify(keys)
        n = len(ks)
        offs = _per_key(offsets, n, "offsets", batch)
        szs = _per_key(sizes, n, "sizes", batch)
        bufl = buffer if (batch and isinstance(buffer, list)) else [buffer] * n
        if len(bufl) != n:
            raise E.InvalidParams(f"{n} keys but {len(bufl)} buffers")
        bufs: list[Any] = []
        where = self._resolver()
        one = None if buffer is bufl else self._one_buffer(where, buffer, offs, szs)
        if one is not None:  # every key's range inside the one buffer: no check per key
            bufs, n = one, 0
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
        return self._finish(
            self._put_regions(ks, bufs, [s if s is not None else 0 for s in szs], upsert, config),
            batch,
        )

    @staticmethod
    def _one_buffer(
        where: Any, buffer: Any, offs: list[Any], szs: list[Any]
    ) -> list[tuple[MemoryRegion, int]] | None:
        """``(region, offset)`` per key of a put from one buffer when every size and offset
        is an int and every range lies inside the buffer's registration (checked for the
        batch at once); None: some key is refused, its error found by the per-key loop."""
        if not offs or set(map(type, szs)) != {int} or set(map(type, offs)) != {int}:
            return None
        if min(szs) <= 0 or min(offs) < 0:
            return None
        try:
            region, base = where(buffer, 1)
        except E.StoreError:
            return None
        if base + max(map(operator.add, offs, szs)) > region.size:
            return None
        return [(region, base + o) for o in offs]

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
        bufs, totals = self._multi_pieces(keys, buffers, sizes)
        return self._put_regions(list(keys), bufs, totals, upsert, config)

    def get_into_multi(
        self, keys: list[str], buffers: list[list[Any]], sizes: list[list[int]]
    ) -> BatchResults:
        """Batch get filling object ``i``'s bytes into ``buffers[i]`` in order (capacity
        ``sum(sizes[i])``); per key the number of bytes read."""
        bufs, caps = self._multi_pieces(keys, buffers, sizes)
        return self._get_regions(list(keys), bufs, caps)

    def put(self, keys: Any, values: Any, *, config: ReplicateConfig | None = None) -> Any:
        """Store bytes-like ``values`` (one copy into a registered staging buffer)."""
        return self._put_bytes(keys, values, False, config)

    def upsert(self, keys: Any, values: Any, *, config: ReplicateConfig | None = None) -> Any:
        """:meth:`put` that replaces existing objects (a size change reallocates)."""
        return self._put_bytes(keys, values, True, config)

    def _put_bytes(self, keys, values, upsert, config) -> Any:
        ks, batch = self._listify(keys)
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
        return self._finish(res, batch)

    # ------------------------------------------------------------------ get

    def _lookup(self, keys: list[str]) -> _Looked:
        """GetReplicas (table form) in RPC-sized parts: per key code and size, the slice rows
        of the found keys (key index relative to ``keys``), and the lease deadline."""
        n = len(keys)
        if n <= MAX_KEYS_PER_RPC:  # one RPC (the usual case): its arrays as they are
            host = self.engine.host_id
            resp, t0 = self.rpc.call_timed(lambda rid: P.GetReplicasReq(rid, keys, host, True))
            try:
                if type(resp) is not P.ReplicaTableResp:
                    raise _whole_error(resp)
                c, z, rows = _table(resp, n)
            except E.StoreError as err:
                return _Looked([err.code] * n, [0] * n, _NO_ROWS, [], float("inf"))
            return _Looked(c, z, rows, resp.segments, t0 + resp.lease_ms / 1000.0)
        codes = np.zeros(n, np.int64)
        sizes = np.zeros(n, np.int64)
        parts: list[np.ndarray] = []
        segs: list[tuple[str, str, str]] = []
        deadline = float("inf")
        host = self.engine.host_id
        for start in range(0, n, MAX_KEYS_PER_RPC):
            part = keys[start : start + MAX_KEYS_PER_RPC]
            end = start + len(part)
            resp, t0 = self.rpc.call_timed(
                lambda rid, part=part: P.GetReplicasReq(rid, part, host, True)
            )
            try:
                if type(resp) is not P.ReplicaTableResp:
                    raise _whole_error(resp)
                c, z, rows = _table(resp, len(part))
            except E.StoreError as err:
                codes[start:end] = err.code
                continue
            deadline = min(deadline, t0 + resp.lease_ms / 1000.0)
            codes[start:end] = c
            sizes[start:end] = z
            if len(rows):
                rows[:, 0] += start
                rows[:, 2] += len(segs)
                parts.append(rows)
            segs += resp.segments
        rows = np.concatenate(parts) if parts else _NO_ROWS
        return _Looked(codes, sizes, rows, segs, deadline)

    def _ranks(self, rows: np.ndarray, segs: list[tuple[str, str, str]]) -> np.ndarray:
        """Per row the attempt in which its copy is read: the master's order (copies on this
        host first), except that copies wholly in this process come before all others."""
        rank = rows[:, 1]
        if not len(rank) or not rank.any():  # one copy per key (the common case)
            return rank
        me = self.engine.address
        local = np.fromiter((ep == me for _, _, ep in segs), bool, len(segs))[rows[:, 2]]
        kc = rows[:, 0] * (int(rank.max()) + 1) + rank
        starts = _heads(kc)
        mine = np.logical_and.reduceat(local, starts)
        gkey, gcopy = rows[starts, 0], rank[starts]
        order = np.lexsort((gcopy, ~mine, gkey))  # per key: ours first, then master's order
        first = _heads(gkey[order])
        pos = np.arange(len(order)) - np.repeat(first, np.diff(np.append(first, len(order))))
        new = np.empty(len(starts), np.int64)
        new[order] = pos
        return np.repeat(new, np.diff(np.append(starts, len(rows))))

    def _get_regions(self, keys: list[Any], bufs: Any, caps: Any) -> BatchResults:
        n = len(keys)
        out: list[Any] = [None] * n
        one = isinstance(bufs, _OneRegion)
        if one and keys_valid(keys):
            idx: list[int] = list(range(n))
        else:
            idx = []
            for i, k in enumerate(keys):
                b = None if one else bufs[i]
                err = _key_error(k) or (b if isinstance(b, E.StoreError) else None)
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
        """READ the looked-up objects ``keys[idx[j]]`` into their buffers: ``bufs`` is a
        :class:`_OneRegion` (offsets per key of ``keys``) or per key ``(region, offset)``
        or a list of ``(region, offset, length)`` pieces; ``caps``: capacities per key."""
        _, _, rows, segs, lease_deadline = looked
        m = len(idx)
        if (
            m == 1
            and len(rows) == 1
            and (isinstance(bufs, _OneRegion) or type(bufs[idx[0]]) is tuple)
        ):
            return self._read_one(keys, idx[0], bufs, caps, looked, out)
        if m == len(keys) and len(segs) == 1 and isinstance(bufs, _OneRegion):
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
        # One copy of one slice per found key (checked whole by _table): no ranking, and
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
        if isinstance(bufs, _OneRegion):
            regions = [bufs.region]
            kreg = np.zeros(m, np.int64)
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
        while pend.any():
            if rank is None:
                r = rows if pend.all() else rows[pend[kj]]
            else:
                r = rows[(rank == attempt) & pend[kj]]
            k, seg, ro, ln = r[:, 0], r[:, 2], r[:, 3], r[:, 4]
            reg, lo = kreg[k], koff[k]
            if rank is not None and len(k):
                # Each key's slices fill its buffer in order: + bytes of earlier slices.
                before = np.cumsum(ln) - ln
                head = _heads(k)
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
                    for rg, lo_, y, ro_, ln_ in _split(b, sl):
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
            for j in np.flatnonzero(tried & ~failed).tolist():
                out[idx[j]] = sz[j]
            attempt += 1
            pend = tried & failed & (copies > attempt)  # next copy, under the same lease
            for j in np.flatnonzero(tried & failed & (copies <= attempt)).tolist():
                out[idx[j]] = _read_failed(keys[idx[j]])
        self.last_transports = sorted(transports)
        return BatchResults(out, self.last_transports)

    def _read_simple(
        self, keys: list[Any], bufs: _OneRegion, caps: Any, looked: _Looked, out: list[Any]
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
        # _table checked that row j is key j, one slice of the object's full size, in the
        # one segment (index 0); its offsets and lengths go to the engine as they are.
        lo = np.asarray(bufs.offs, np.int64)
        used, expired = self._read_leased(looked, 0, bufs.region, lo, rows[:, 3], rows[:, 4])
        if expired:
            out[:] = [_lease_expired(k) for k in keys]
        elif used is None:
            out[:] = [_read_failed(k) for k in keys]
        else:
            out[:] = sizes.tolist()
        t = [] if used is None else sorted(used)
        self.last_transports = t
        return BatchResults(out, t)

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
        if isinstance(bufs, _OneRegion):
            region, at = bufs.region, int(bufs.offs[i])
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
        return BatchResults(out, t)

    def get_into(self, keys: Any, buffer: Any, offsets: Any = 0, sizes: Any = None) -> Any:
        """Read objects into registered memory at ``buffer + offsets[i]`` (capacity
        ``sizes[i]`` bytes, default: to the end of the registered region). Returns the number
        of bytes read per key."""
        ks, batch = self._listify(keys)
        n = len(ks)
        if not (batch and isinstance(buffer, list)):
            one = self._one_region(buffer, offsets, sizes, n, batch)
            if one is not None:
                return self._finish(self._get_regions(ks, one, one.caps), batch)
        offs = _per_key(offsets, n, "offsets", batch)
        caps_in = _per_key(sizes, n, "sizes", batch)
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
        return self._finish(self._get_regions(ks, bufs, caps), batch)

    def _one_region(
        self, buffer: Any, offsets: Any, sizes: Any, n: int, batch: bool
    ) -> _OneRegion | None:
        """The batch's destinations when every key reads into one registered buffer at valid
        offsets, worked out with numpy; None sends the call down the per-key path (which
        reports each bad key, or raises for a malformed call)."""
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
            return _OneRegion(region, [at], [cap])
        offs = _int_array(offsets if batch else [offsets])
        caps = None if sizes is None else _int_array(sizes if batch else [sizes])
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
        return _OneRegion(region, at, caps)

    def get(self, keys: Any, *, into: Callable[[memoryview], Any] | None = None) -> Any:
        """Objects as ``bytes`` (one copy out of a staging buffer). ``into``: each object
        is ``into(view)`` instead, ``view`` its bytes in the staging buffer, valid during the
        call only (``bytearray`` or a subclass: the one copy lands in that object)."""
        ks, batch = self._listify(keys)
        n = len(ks)
        out: list[Any] = [None] * n
        idx = list(range(n)) if keys_valid(ks) else _valid_indices(ks, out)
        if not idx:
            return self._finish(BatchResults(out), batch)
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
            res = self._read(ks, idx, _OneRegion(region, at, caps), caps, looked, out)
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
            )
        finally:
            self._staging.release(stage)
        return self._finish(results, batch)

    # ------------------------------------------------------------------ metadata

    def exists(self, keys: Any, *, prefix: str = "", suffixes: Sequence[str] | None = None) -> Any:
        """True if a COMPLETE object has the key (no lease is taken).

        With ``prefix`` or ``suffixes``: the objects named ``prefix + key + suffix`` for every
        key and then every suffix (key-major; ``suffixes`` defaults to ``[""]``), one result
        per name, always a batch. The master gets the parts, not the names
        (:class:`protocol.ExistsPartsReq`), so names that share a long start pay for their
        middles only."""
        if prefix or suffixes is not None:
            return self._exists_parts(keys, prefix, list(suffixes or [""]))
        ks, batch = self._listify(keys)
        out: list[Any] = [None] * len(ks)
        # The hot path (HiCache's batch_exists): all keys valid, checked once for the batch,
        # and results written by slice, with no per-key Python work on this side.
        idx: list[int] | None = None if keys_valid(ks) else _valid_indices(ks, out)
        n = len(ks) if idx is None else len(idx)
        for start in range(0, n, MAX_KEYS_PER_RPC):
            if idx is None:
                part: Sequence[int] = range(start, min(start + MAX_KEYS_PER_RPC, n))
                pk = ks[start : start + MAX_KEYS_PER_RPC]
            else:
                part = idx[start : start + MAX_KEYS_PER_RPC]
                pk = [ks[i] for i in part]
            resp = self.rpc.call(lambda rid, pk=pk: P.ExistsReq(rid, pk))
            if type(resp) is P.CodesResp and len(resp.codes) == len(pk):
                flags = list(map(bool, resp.codes))
                if idx is None:
                    out[start : start + len(flags)] = flags
                else:
                    for i, f in zip(part, flags):
                        out[i] = f
            else:
                err = _whole_error(resp)
                for i in part:
                    out[i] = err
        return self._finish(BatchResults(out), batch)

    def _exists_parts(self, keys: Any, prefix: str, sufs: list[str]) -> BatchResults:
        ks = self._listify(keys)[0]  # one key (a str) is a batch of one key here
        if len(sufs) > MAX_KEYS_PER_RPC or bad_parts(prefix, ks, sufs) is not None:
            # Some name is invalid (or too many suffixes): name by name, for per-name errors.
            return self.exists(P.parts_names(prefix, ks, sufs))
        m = len(sufs)
        out: list[Any] = [None] * (len(ks) * m)
        step = MAX_KEYS_PER_RPC // m
        for start in range(0, len(ks), step):
            pk = ks[start : start + step]
            resp = self.rpc.call(lambda rid, pk=pk: P.ExistsPartsReq(rid, prefix, pk, sufs))
            lo, hi = start * m, (start + len(pk)) * m
            if type(resp) is P.CodesResp and len(resp.codes) == hi - lo:
                out[lo:hi] = map(bool, resp.codes)
            else:
                out[lo:hi] = [_whole_error(resp)] * (hi - lo)
        return BatchResults(out)

    def count_leading(
        self, keys: Any, *, prefix: str = "", suffixes: Sequence[str] | None = None
    ) -> int:
        """The number of leading keys whose every name ``prefix + key + suffix`` is a
        COMPLETE object (``suffixes`` defaults to ``[""]``): what :meth:`exists` by parts
        answers, up to the first key with a missing name. The master counts (one int in the
        reply; it stops at the first missing name). A name that is invalid, or a request the
        master fails, counts as missing; when the first request fails its error is raised
        (``StoreUnavailable`` when no master answers), as nothing was counted."""
        ks = self._listify(keys)[0]
        sufs = list(suffixes or [""])
        m = len(sufs)
        if m > MAX_KEYS_PER_RPC or bad_parts(prefix, ks, sufs) is not None:
            # Name by name: an invalid name is an error result there, i.e. missing here.
            flags = self.exists(P.parts_names(prefix, ks, sufs))
            if (
                flags
                and isinstance(flags[0], E.StoreError)
                and not isinstance(flags[0], E.InvalidKey)
            ):
                raise flags[0]  # the first name is not known: nothing was counted
            return _leading(flags, m)
        step = MAX_KEYS_PER_RPC // m
        total = 0
        for start in range(0, len(ks), step):
            pk = ks[start : start + step]
            resp = self.rpc.call(lambda rid, pk=pk: P.ExistsPartsReq(rid, prefix, pk, sufs, True))
            t = type(resp)
            if t is P.CountResp and type(resp.count) is int and 0 <= resp.count <= len(pk):
                n = resp.count
            elif t is P.CodesResp and len(resp.codes) == len(pk) * m:
                n = _leading(resp.codes, m)  # a master without the count answers per name
            elif start == 0:
                raise _whole_error(resp)
            else:
                return total  # not known past here: missing
            total += n
            if n < len(pk):
                break
        return total

    def get_size(self, keys: Any) -> Any:
        ks, batch = self._listify(keys)
        out: list[Any] = [None] * len(ks)
        idx = _valid_indices(ks, out)
        for start in range(0, len(idx), MAX_KEYS_PER_RPC):
            part = idx[start : start + MAX_KEYS_PER_RPC]
            pk = [ks[i] for i in part]
            resp = self.rpc.call(lambda rid, pk=pk: P.GetSizeReq(rid, pk))
            if type(resp) is P.SizesResp and len(resp.codes) == len(resp.sizes) == len(pk):
                for i, c, s in zip(part, resp.codes, resp.sizes):
                    out[i] = s if c == 0 else E.error_for(c, f"get_size of {ks[i]!r}")
            else:
                err = _whole_error(resp)
                for i in part:
                    out[i] = err
        return self._finish(BatchResults(out), batch)

    def remove(self, keys: Any, *, force: bool = False) -> Any:
        """Remove objects. A key with a live read lease answers ObjectHasLease unless
        ``force`` (then readers holding a lease may get LeaseExpired)."""
        ks, batch = self._listify(keys)
        out: list[Any] = [None] * len(ks)
        idx = _valid_indices(ks, out)
        for part in _rpc_parts(idx, ks):
            pk = [ks[i] for i in part]
            resp = self.rpc.mutate(lambda rid, s, pk=pk: P.RemoveReq(rid, s, pk, force))
            if type(resp) is P.CodesResp and len(resp.codes) == len(pk):
                for i, c in zip(part, resp.codes):
                    out[i] = None if c == 0 else E.error_for(c, f"remove of {ks[i]!r}")
            else:
                err = _whole_error(resp)
                for i in part:
                    out[i] = err
        return self._finish(BatchResults(out), batch)

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every object (leased ones too with ``force``); returns how many."""
        resp = self.rpc.mutate(lambda rid, s: P.RemoveAllReq(rid, s, force))
        if type(resp) is not P.CountResp:
            raise _whole_error(resp)
        return resp.count

    def remove_prefix(
        self, prefix: str, *, force: bool = False, timeout: float | None = None
    ) -> Removed:
        """Remove every object whose key starts with ``prefix`` (a non-empty valid key
        prefix: literal, no patterns); returns how many, an ``int`` whose ``skipped`` says
        how many matching objects were left because a reader holds a lease on them (or a
        put of the key was in flight). With ``force`` leased ones go too (readers holding a
        lease may get LeaseExpired), as in :meth:`remove`. The master removes at most its
        batch limit per round (one log entry each); this call sends rounds until done, or
        until ``timeout`` seconds (default: 20 x the client's ``timeout``) have passed, then
        raises :class:`StoreTimeout` (rounds already committed stay done): a master that
        keeps answering ``more`` cannot hold the caller forever."""
        why = key_error(prefix)
        if why is not None:
            raise E.InvalidKey(f"prefix: {why}")
        removed = idle = 0
        limit = 20 * self.rpc.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if time.monotonic() > deadline:
                raise E.StoreTimeout(
                    f"remove_prefix({prefix!r}) not done after {limit:g} s "
                    f"({removed} removed so far)"
                )
            resp = self.rpc.mutate(lambda rid, s: P.RemovePrefixReq(rid, s, prefix, force))
            if type(resp) is not P.RemovePrefixResp:
                raise _whole_error(resp)
            removed += resp.removed
            idle = 0 if resp.removed else idle + 1
            if not resp.more or idle >= 3:  # a round that found only vanishing keys
                return Removed(removed, resp.skipped)

    def replicas(self, keys: Any) -> Any:
        """The COMPLETE copies of objects (per key a list of :class:`ObjectReplica`, slices
        in byte order, copies on this host first): where each object lives, for callers that
        show or reason about placement. Like a read, it grants a lease on each found key."""
        ks, batch = self._listify(keys)
        out: list[Any] = [None] * len(ks)
        idx = _valid_indices(ks, out)
        host = self.engine.host_id
        for start in range(0, len(idx), MAX_KEYS_PER_RPC):
            part = idx[start : start + MAX_KEYS_PER_RPC]
            pk = [ks[i] for i in part]
            resp = self.rpc.call(lambda rid, pk=pk: P.GetReplicasReq(rid, pk, host))
            if type(resp) is P.ReplicasResp and len(resp.codes) == len(resp.replicas) == len(pk):
                for i, c, reps in zip(part, resp.codes, resp.replicas):
                    out[i] = list(reps or []) if c == 0 else E.error_for(c, f"lookup of {ks[i]!r}")
            else:
                err = _whole_error(resp)
                for i in part:
                    out[i] = err
        return self._finish(BatchResults(out), batch)

    def status(self) -> dict[str, Any]:
        """The leader's view (members, term, segments, usage, objects, leases)."""
        resp = self.rpc.call(lambda rid: P.StatusReq(rid))
        if type(resp) is not P.StatusResp:
            raise _whole_error(resp)
        return resp.info

    # ------------------------------------------------------------------ tensors

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
    as :meth:`StoreClient._move_arrays` takes them (owner, regions, region index, local
    offset, segments, segment index, remote offset, length): built from the reply's columns
    without expanding a copy object per key. ``None``: any other answer (a code, no copy, a
    forged size, pieces) goes through the per-key loop and its checks."""
    run = resp.run
    if run is None or any(resp.codes) or run.lengths != sizes or min(run.where, default=-1) < 0:
        return None
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
    return [(owner, rg, lo, *where, ro, ln) for rg, lo, where, ro, ln in _split(buf, slices)]


def _split(pieces: list[tuple], slices: Any) -> list[tuple]:
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


_NO_ROWS = np.empty((0, ROW), np.int64)
assert array("q").itemsize == 8


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


class _OneRegion(NamedTuple):
    """A batch's destinations in one registered region: per key the offset and capacity
    (numpy arrays, or lists for a single key)."""

    region: MemoryRegion
    offs: Any
    caps: Any


def _table(resp: P.ReplicaTableResp, n: int) -> tuple[Any, Any, np.ndarray]:
    """(codes, sizes, rows) of a table reply for ``n`` keys, checked: a reply that does not
    describe exactly one full copy per row group of each found key is refused whole (it
    would otherwise make us report bytes we never copied)."""
    bad = E.InternalError("the master sent a malformed replica table")
    if len(resp.codes) != n or len(resp.sizes) != n or len(resp.rows) % (8 * ROW):
        raise bad
    codes, sizes = resp.codes, resp.sizes
    if n == 1 and len(resp.rows) == 8 * ROW:  # a single get: the checks below, on five ints
        k, c, y, ro, ln = _ONE_ROW.unpack(resp.rows)
        if codes[0] != 0 or k or c or not 0 <= y < len(resp.segments) or ro < 0:
            raise bad
        if ln <= 0 or ln != sizes[0]:
            raise bad
        return codes, sizes, np.array([(k, c, y, ro, ln)], np.int64)
    flat = array("q")  # int64 (checked at import)
    flat.frombytes(resp.rows)
    if sys.byteorder != "little":
        flat.byteswap()
    rows = np.frombuffer(flat, np.int64).reshape(-1, ROW)
    if not flat:
        if 0 in codes:
            raise bad
        return _int64(codes, bad), _int64(sizes, bad), rows
    lo, hi = rows.min(0).tolist(), rows.max(0).tolist()
    if (
        lo[0] < 0
        or hi[0] >= n
        or lo[1] < 0
        or hi[1] >= len(rows)  # copies are numbered 0, 1, ... (and k * copies fits int64)
        or lo[2] < 0
        or hi[2] >= len(resp.segments)
        or lo[3] < 0
        or lo[4] <= 0
        # Slices of at most an object's size: their sum per copy (checked against the size
        # below) cannot wrap int64 (2**40 bytes x fewer than 2**23 rows in any reply).
        or hi[4] > MAX_OBJECT_SIZE
    ):
        raise bad
    codes = _int64(codes, bad)
    sizes = _int64(sizes, bad)
    found_mask = codes == 0
    k, c, ln = rows[:, 0], rows[:, 1], rows[:, 4]
    if hi[1] == 0 and len(k) == int(np.count_nonzero(found_mask)):
        # One copy of one slice per found key (the common case): the rows must be exactly
        # the found keys, in order, each slice the whole object.
        if not (np.array_equal(k, np.flatnonzero(found_mask)) and (ln == sizes[k]).all()):
            raise bad
        return codes, sizes, rows
    kc = k * (int(c.max()) + 1) + c
    if (
        (np.diff(kc) < 0).any()
        or not found_mask[k].all()
        or (np.bincount(k, minlength=n)[found_mask] == 0).any()
    ):
        raise bad
    heads = _heads(kc)
    gk, gc = k[heads], c[heads]
    first = _heads(gk)
    nth = np.arange(len(heads)) - np.repeat(first, np.diff(np.append(first, len(heads))))
    if (gc != nth).any() or (np.add.reduceat(ln, heads) != sizes[gk]).any():
        raise bad  # copies numbered 0, 1, ... per key, each exactly the object's size
    return codes, sizes, rows


def _int64(values: list[int], bad: E.StoreError) -> np.ndarray:
    """A reply's list of ints as int64, or ``bad``: msgpack ints reach 2**64 - 1, and an
    OverflowError must not escape a read as if it were the caller's bug."""
    try:
        return np.asarray(values, np.int64)
    except OverflowError:
        raise bad from None


def _heads(v: np.ndarray) -> np.ndarray:
    """Indexes where a run of equal values in ``v`` starts (``v`` non-empty)."""
    return np.flatnonzero(np.concatenate(([True], v[1:] != v[:-1])))


_ONE_ROW = struct.Struct(f"<{ROW}q")  # one little-endian table row
_NO_OWNERS = np.empty(0, np.int64)
_NO_OWNERS.flags.writeable = False  # shared: callers only read it
# (op, transport kinds of a batch) -> (stats key, transport names): a handful of entries
_COUNT_KEYS: dict[tuple[Op, tuple[Any, ...]], tuple[str, ...]] = {}


def _owners(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _NO_OWNERS
    return np.unique(np.concatenate(parts))


def _per_key(value: Any, n: int, what: str, batch: bool) -> list[Any]:
    if batch and isinstance(value, (list, tuple, np.ndarray)):
        vals = list(value)
        if len(vals) != n:
            raise E.InvalidParams(f"{n} keys but {len(vals)} {what}")
        if set(map(type, vals)) == {int}:  # plain ints (the usual batch): nothing per value
            return vals
        return [None if v is None else _index(v, what) for v in vals]
    return [None if value is None else _index(value, what)] * n


def _index(v: Any, what: str) -> int:
    """``v`` as an int when it is one (numpy integers too); an offset of 1.5 or a size of
    ``"4096"`` is refused, not truncated or parsed (``int()`` would do both)."""
    if type(v) is int:
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    raise E.InvalidParams(f"{what} must be ints, got {v!r}")


_INT64_MAX = np.iinfo(np.int64).max


def _int_array(values: Any) -> np.ndarray | None:
    """``values`` (an int or a sequence of ints) as int64, or None when some value is not an
    int (floats, strings, bools) or does not fit int64: ``np.asarray(v, np.int64)`` would
    truncate 1.5 to 1 and parse "4096"."""
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        return None
    k = a.dtype.kind
    if k == "i":
        return a.astype(np.int64, copy=False)
    if k == "u" and (not a.size or int(a.max()) <= _INT64_MAX):
        return a.astype(np.int64)
    if k == "f" and not a.size:  # np.asarray([]) is float64
        return a.astype(np.int64)
    return None


def _leading(flags: Sequence[Any], per: int) -> int:
    """Leading groups of ``per`` adjacent flags that are all ``True`` (or 1)."""
    ok = [f is True or (type(f) is int and f == 1) for f in flags]
    return ok.index(False) // per if False in ok else len(ok) // per


def _whole_error(resp: Any) -> E.StoreError:
    if type(resp) is P.ErrorResp:
        return E.error_for(resp.code, resp.message)
    return E.StoreError(f"unexpected reply {type(resp).__name__}")
