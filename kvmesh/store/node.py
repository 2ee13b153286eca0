"""The storage-node role: give a shared-memory segment of this process to the store pool.

A :class:`StorageNode` allocates ``size`` bytes with ``alloc_shared`` on the process's
transfer engine, publishes them as a segment, mounts the segment through the master (one log
entry), and heartbeats from a daemon thread. The master allocates replica space inside the
segment; clients move bytes into and out of it with their own engines, never through the
master or through this object. When the master answers a heartbeat with "unknown node" (it
expired us after a pause longer than its node TTL, dropping our replicas) the node mounts
again under a new segment name (see :meth:`StorageNode._remount`).
:meth:`StorageNode.close` unmounts first, then keeps the memory for a grace period so that
readers holding leases finish, then frees it.

With ``disk``/``disk_size`` the node also registers a disk segment (a file or a directory on a
local filesystem, ``kvmesh/transfer/disk.py``) on its engine, published as
``<segment>.disk``, before it mounts anything: a path that is not writable, in use, or on a
filesystem too small stops the node at start with the reason. It is mounted at the master
with medium ``disk`` and its *disk id* (random at first use, kept in ``PATH.kvmesh-id``): a
node that restarts on the same path and id re-adopts the copies the master still lists there
after checking each one's crc32c where the bytes are (:meth:`StorageNode._adopt`; docs/store.md,
"Restart re-adoption"). Puts are never placed there, the master's demotions are (docs/store.md,
"Disk tier"). Its files outlive the node, and a node restarted on the same path finds their
bytes.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..net import speaks_for_node
from ..transfer import DiskSegment, MemoryRegion, Op, TransferEngine, get_engine
from ..transfer.disk import checksums
from . import errors as E
from . import protocol as P
from .rpc import MasterClient

__all__ = ["StorageNode"]

log = logging.getLogger(__name__)

DEMOTE_BATCH = 1024  # demotions one heartbeat asks for
DEMOTE_POLL_S = 0.2  # a node with a disk heartbeats (asking for demotions) this often
# ... and this often for a while after demotions progressed: the leader starts the next batch
# at a tick of its own, which a poll every DEMOTE_POLL_S would meet that much later
DEMOTE_BUSY_POLL_S = 0.003
DEMOTE_BUSY_S = 1.0
STAGE_BYTES = 64 << 20  # bytes one demotion batch stages (a larger object alone)


class StorageNode:
    """``master``: a :class:`MasterClient`; ``size``: bytes to contribute; ``heartbeat_s``:
    interval (keep it well under the master's node TTL, default 10 s); ``segment``/``node_id``:
    the names it mounts under (default: from the engine's node id); ``disk``/``disk_size``: a
    disk segment to register too (``disk_direct``: O_DIRECT auto/required/never)."""

    def __init__(
        self,
        master: MasterClient,
        size: int,
        *,
        engine: TransferEngine | None = None,
        segment: str | None = None,
        node_id: str | None = None,
        heartbeat_s: float = 2.0,
        disk: str | None = None,
        disk_size: int | None = None,
        disk_direct: bool | None = None,
    ) -> None:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"segment size must be a positive int, got {size!r}")
        if (disk is None) != (disk_size is None):
            raise ValueError("a disk segment needs both disk (a path) and disk_size")
        if disk_size is not None and (not isinstance(disk_size, int) or disk_size <= 0):
            raise ValueError(f"disk size must be a positive int, got {disk_size!r}")
        self.master = master
        self.engine = engine if engine is not None else get_engine()
        # One process may run several storage nodes on its one engine (Mooncake's clients
        # each own a segment): each needs its own id, so that the copies of one object still
        # go to distinct nodes and each node's heartbeat and unmount speak only for it. Those
        # ids are "<engine node id>/<segment>": the engine's node credential covers them.
        self.node_id = node_id or self.engine.node_id
        if not speaks_for_node(master.node_id, self.node_id):
            # The master lets only storage node X (or a node X/... hosted by X's process)
            # mount, unmount and heartbeat X.
            raise ValueError(
                f"a storage node {self.node_id!r} needs MasterClient(node_id=...) naming it "
                f"(this one speaks as {master.role} {master.node_id or master.name!r})"
            )
        self._base = segment or f"kvstore-{self.node_id}"
        self._generation = 0
        self.segment = self._base
        self.size = size
        self.heartbeat_s = heartbeat_s
        self.region: MemoryRegion | None = None
        self.disk_path = disk
        self.disk_size = disk_size
        self.disk_direct = disk_direct
        self.disk_segment = f"{self._base}.disk"
        self.disk: DiskSegment | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.mounts = 0
        self.heartbeats = 0
        self.demoted = 0  # objects this node demoted (DemoteEnd accepted)
        self.promoted = 0  # objects this node promoted back to memory (PromoteEnd accepted)
        self.disk_id = ""
        self.adopted = (0, 0)  # the last re-adoption: (copies kept, copies dropped)
        self._stage: MemoryRegion | None = None
        self._end_pool: ThreadPoolExecutor | None = None  # sends DemoteEnds (node.py _demote)
        self._sum_pool: ThreadPoolExecutor | None = None  # crcs while a batch is written

    def start(self) -> StorageNode:
        if self.disk_path is not None:
            # First: an unusable disk path must stop the node before anything is mounted.
            assert self.disk_size is not None
            self.disk = self.engine.register_disk(
                self.disk_path, self.disk_size, name=self.disk_segment, direct=self.disk_direct
            )
            try:
                self.disk_id = disk_id(self.disk_path)
            except BaseException:
                self._close_disk()
                raise
        try:
            self.region = self.engine.alloc_shared(self.size, name=self.segment)
            try:
                self._mount()
            except BaseException:
                self.engine.unregister(self.region)
                self.region = None
                raise
        except BaseException:
            self._close_disk()
            raise
        self._thread = threading.Thread(
            target=self._beat_loop, name=f"store-node-{self.segment}", daemon=True
        )
        self._thread.start()
        return self

    def _mount(self) -> None:
        self._mount_one(self.segment, self.size, "memory")
        self.mounts += 1
        if self.disk is not None:
            try:
                self._mount_one(self.disk_segment, self.disk.size, "disk")
            except E.StoreError as e:
                if self.mounts == 1:
                    raise
                # a remount after an expiry: the master quarantines the dropped name for a
                # while; the node serves memory meanwhile (re-adoption: docs/store.md)
                log.warning("store node %s: disk segment not mounted again: %s", self.node_id, e)
                return
            self._adopt()

    def _adopt(self) -> None:
        """Re-adoption (docs/store.md, "Restart re-adoption"): the master lists the copies
        it still holds in our disk id's segment (offline since our previous life); each is
        checked against its crc32c where the bytes are, and one ``Adopt`` drops the ones
        whose bytes are gone or differ and brings the rest back online."""
        resp = self.master.call(
            lambda rid: P.AdoptListReq(rid, self.node_id, self.disk_segment),
            timeout=max(10.0, self.heartbeat_s * 2),
        )
        if type(resp) is not P.AdoptListResp or resp.codes != [0]:
            return  # a fresh disk id (or a segment already online): nothing to adopt
        eng = self.engine
        seg = eng.open_segment(eng.address, self.disk_segment)
        bad: list[int] = []
        step = 4096
        for lo in range(0, len(resp.keys), step):
            offs, lens = resp.offsets[lo : lo + step], resp.lengths[lo : lo + step]
            try:
                got = eng.checksum_segment(seg, offs, lens).tolist()
            except Exception as e:  # noqa: BLE001 - ranges outside the file: their bytes are gone
                log.warning("store node %s: re-adoption check failed: %r", self.node_id, e)
                got = [-1] * len(offs)
            bad += [
                lo + i for i, (g, c) in enumerate(zip(got, resp.crcs[lo : lo + step])) if g != c
            ]
        keys = [resp.keys[i] for i in bad]
        versions = [resp.versions[i] for i in bad]
        out = self.master.mutate(
            lambda rid, s: P.AdoptReq(
                rid, s, self.node_id, self.disk_segment, self.disk_id, keys, versions
            )
        )
        code = _one_code(out)
        if code != 0:
            raise E.error_for(code, f"re-adopting disk segment {self.disk_segment!r} failed")
        self.adopted = (len(resp.keys) - len(bad), len(bad))
        log.info(
            "store node %s: re-adopted %d disk copies, dropped %d that failed their check",
            self.node_id, *self.adopted,
        )  # fmt: skip

    def _mount_one(self, name: str, size: int, medium: str) -> None:
        resp = self.master.mutate(
            lambda rid, s: P.MountReq(
                rid,
                s,
                self.node_id,
                name,
                self.engine.address,
                self.engine.host_id,
                size,
                medium,
                self.disk_id if medium == "disk" else "",
            )
        )
        code = _one_code(resp)
        if code != 0:
            raise E.error_for(code, f"mounting segment {name!r} failed")

    def _remount(self) -> None:
        """The master expired us (its copies in our memory are gone). Mount again under a
        new segment name: the old name stays quarantined at the master, and republishing
        invalidates every peer's handle on it, so a writer still holding an old descriptor
        gets SegmentNotFound instead of writing into memory that is now allocated anew."""
        assert self.region is not None
        self._generation += 1
        new = f"{self._base}.{self._generation}"
        self.engine.unpublish(self.segment)
        self.engine.publish(self.region, new)
        self.segment = new
        self._mount()

    def _beat_loop(self) -> None:
        again = False  # the last demotions progressed: ask for more at once
        # with a disk, heartbeats also fetch demotions: at least every DEMOTE_POLL_S
        period = min(self.heartbeat_s, DEMOTE_POLL_S) if self.disk is not None else self.heartbeat_s
        busy_until = 0.0
        soon = False  # the master is proposing a batch (DemoteTasksResp.soon)
        while again or not self._stop.wait(
            DEMOTE_BUSY_POLL_S if soon or time.monotonic() < busy_until else period
        ):
            if again:
                busy_until = time.monotonic() + DEMOTE_BUSY_S
            again = soon = False
            if self._stop.is_set():
                return
            try:
                work = DEMOTE_BATCH if self.disk is not None else 0
                resp = self.master.call(
                    lambda rid, work=work: P.HeartbeatReq(rid, self.node_id, work),
                    timeout=self.heartbeat_s * 2,
                )
                self.heartbeats += 1
                soon = type(resp) is P.DemoteTasksResp and resp.soon and not resp.tasks
                if type(resp) is P.DemoteTasksResp and resp.promote and resp.codes == [0]:
                    self._promote(resp.promote)
                if type(resp) is P.DemoteTasksResp and resp.tasks and resp.codes == [0]:
                    # ask again at once while the demotions progress: the leader has likely
                    # started the next batch while this one was copied (a poll period per
                    # batch bounded demotion); no progress (a failing disk) waits a period
                    again = self._demote(resp.tasks) > 0
                if _one_code(resp) != 0 and not self._stop.is_set():
                    log.warning(
                        "store node %s: the master forgot this node; mounting again", self.node_id
                    )
                    self._remount()
            except E.StoreError as e:
                log.warning("store node %s: heartbeat failed: %s", self.node_id, e)
            except Exception:
                log.exception("store node %s: heartbeat failed", self.node_id)

    # ------------------------------------------------------------------ the disk tier

    def _demote(self, tasks: list[Any]) -> int:
        """Copy the demotions the master gave us (docs/store.md, "Disk tier"): each object's
        memory copy into our disk segment (straight from our memory segment when the copy
        is there, else through a staging buffer), fdatasync, then ``DemoteEnd`` with the
        crc32c of the bytes. Only that entry makes the disk copy COMPLETE; a batch that
        fails is reported failed (:meth:`_demote_failed`) with the rest, and the copying
        stops until the next poll.

        A pipeline: once a batch's bytes are written, its fdatasync, crc and end run on
        another thread (:meth:`_end`, one end in flight) while this one writes the next
        batch, and the reply to each end names the demotions the master has for us now --
        the next batch among them, started as the end applied -- so the work goes on
        without waiting for a poll, until none is left or an end made no progress (the
        master keeps two batches per node in flight when memory has room for them, so the
        next batch is usually known before this one ends). Returns the demotions accepted."""
        eng = self.engine
        done = 0
        ending: Future[Any] | None = None  # the end in flight
        ending_keys: set[tuple[str, int]] = set()
        stalled = False

        def answered(fut: Future[Any], copied: set[tuple[str, int]]) -> None:
            # the end's reply; ``copied``: the batch copied meanwhile, not yet ended
            nonlocal tasks, done, stalled
            try:
                resp = fut.result()
            except Exception as e:  # noqa: BLE001 - reported by _end, or the master's timeout
                log.warning("store node %s: demotion end failed: %r", self.node_id, e)
                stalled = True  # a failing disk: a poll period before asking again
                return
            if type(resp) not in (P.CodesResp, P.DemoteTasksResp):
                return
            ok = resp.codes.count(0)
            self.demoted += ok
            done += ok
            if not ok:
                stalled = True  # refused: a poll period before asking again
            elif type(resp) is P.DemoteTasksResp:
                # the master's list of what is left for us (not yet ended, and new)
                tasks = [t for t in resp.tasks if (t.key, t.version) not in copied]

        while (tasks or ending is not None) and not self._stop.is_set():
            if not tasks or stalled:
                if ending is None:
                    break
                answered(ending, set())
                ending = None
                if stalled:
                    break
                continue
            batch, total, i = [], 0, 0
            while i < len(tasks) and (not batch or total + tasks[i].size <= STAGE_BYTES):
                batch.append(tasks[i])
                total += tasks[i].size
                i += 1
            tasks = tasks[i:]
            try:
                sums = self._demote_batch(eng, batch, total)
            except Exception as e:  # noqa: BLE001 - reported: the master revokes them
                log.warning(
                    "store node %s: demotion of %d objects failed: %r", self.node_id, len(batch), e
                )
                # this batch and the ones not tried yet (the disk failed: they would too)
                self._demote_failed(batch + tasks)
                tasks = []
                stalled = True
                continue
            copied = {(t.key, t.version) for t in batch}
            if ending is not None:
                answered(ending, copied)
            ending_keys = copied
            ending = self._ender().submit(self._end, eng, batch, sums)
        if ending is not None:  # stopping: the last end still counts
            answered(ending, ending_keys)
        return done

    def _demote_failed(self, tasks: list[Any]) -> None:
        """Tell the master that demotions ``tasks`` failed (``DemoteEndReq.failed``): it
        revokes them at once -- their memory copies stay the only ones -- and backs off
        from our disk before it places demotions there again. Unsent (the master does not
        answer): its demotion timeout revokes them as well."""
        try:
            self.master.mutate(
                lambda rid, s: P.DemoteEndReq(
                    rid, s, self.node_id, [], [], [], 0,
                    [t.key for t in tasks], [t.version for t in tasks],
                )
            )  # fmt: skip
        except E.StoreError as e:
            log.warning("store node %s: reporting failed demotions: %s", self.node_id, e)

    def _promote(self, tasks: list[Any]) -> int:
        """Promotion on hit (docs/store.md, "Disk tier"): read each disk-only object's disk
        copy (on our disk) into the memory the master reserved for it (in our memory
        segment), check the bytes against the copy's crc32c -- a corrupt copy is never
        promoted -- and end them with one ``PromoteEndReq`` per reservation. A task that
        names anything else is skipped; one never ended is released by the master."""
        eng, region = self.engine, self.region
        if region is None or self.disk is None:
            return 0
        mine = [
            t
            for t in tasks
            if len(t.src.slices) == 1
            and len(t.dst.slices) == 1
            and t.src.slices[0].segment == self.disk_segment
            and t.dst.slices[0].segment == self.segment
            and t.src.slices[0].length == t.dst.slices[0].length == t.size
            and 0 <= t.dst.slices[0].offset <= self.size - t.size
        ]
        if not mine:
            return 0
        done = 0
        try:
            disk = eng.open_segment(eng.address, self.disk_segment)
            eng.transfer(
                Op.READ, region, [t.dst.slices[0].offset for t in mine], disk,
                [t.src.slices[0].offset for t in mine], [t.size for t in mine],
            )  # fmt: skip
            got = checksums(region.array(), [t.dst.slices[0].offset for t in mine],
                            [t.size for t in mine]).tolist()  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the master releases the memory later
            log.warning("store node %s: promotion of %d objects failed: %r", self.node_id,
                        len(mine), e)  # fmt: skip
            return 0
        by_tag: dict[int, list[Any]] = {}
        for t, c in zip(mine, got):
            if int(c) == t.crc:
                by_tag.setdefault(t.tag, []).append(t)
            else:
                log.warning("store node %s: disk copy of %r fails its crc: not promoted",
                            self.node_id, t.key)  # fmt: skip
        for tag, ts in by_tag.items():
            try:
                resp = self.master.mutate(
                    lambda rid, s, tag=tag, ts=ts: P.PromoteEndReq(
                        rid, s, self.node_id, tag, [t.key for t in ts], [t.version for t in ts],
                        [self.segment] * len(ts), [t.dst.slices[0].offset for t in ts],
                    )
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the master releases the memory later
                log.warning("store node %s: promotion end failed: %r", self.node_id, e)
                continue
            if type(resp) is P.CodesResp:
                done += resp.codes.count(0)
        self.promoted += done
        return done

    def _end(self, eng: TransferEngine, batch: list[Any], sums: Callable[[], list[int]]) -> Any:
        """A written batch's end (the end thread of :meth:`_demote`): fdatasync of the disk,
        the crc32c of the bytes (``sums``), then ``DemoteEnd``: the master makes the disk
        copies COMPLETE only from it, so only durable bytes with their crc are ever
        COMPLETE. A failure here (the sync's ``EIO``) is reported like a failed write
        (:meth:`_demote_failed`: the master revokes the batch at once and backs off from
        this disk) and raised to :meth:`_demote`, which stops copying until the next poll."""
        try:
            eng.sync_segment(eng.open_segment(eng.address, self.disk_segment))
            crcs = sums()
        except Exception:
            self._demote_failed(batch)
            raise
        return self.master.mutate(
            lambda rid, s: P.DemoteEndReq(
                rid,
                s,
                self.node_id,
                [t.key for t in batch],
                [t.version for t in batch],
                crcs,
                DEMOTE_BATCH,
            )
        )

    def _ender(self) -> ThreadPoolExecutor:
        if self._end_pool is None:
            self._end_pool = ThreadPoolExecutor(1, thread_name_prefix="store-node-end")
        return self._end_pool

    def _demote_batch(
        self, eng: TransferEngine, batch: list[Any], total: int
    ) -> Callable[[], list[int]]:
        """Write ``batch`` into our disk (not yet synced); returns what computes the crcs
        of the bytes written (:meth:`_end` calls it after the sync)."""
        region = self.region
        if region is not None and all(
            len(t.src.slices) == 1
            and t.src.slices[0].segment == self.segment
            and t.src.slices[0].endpoint == eng.address
            for t in batch
        ):
            return self._demote_direct(eng, region, batch)
        if self._stage is None or self._stage.size < total:
            if self._stage is not None:
                eng.unregister(self._stage)
            self._stage = eng.register(np.zeros(max(total, min(STAGE_BYTES, 1 << 20)), np.uint8))
        stage = self._stage
        at = 0
        starts = []
        reads: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        writes: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        for t in batch:
            starts.append(at)
            for plan, rep in ((reads, t.src), (writes, t.dst)):
                pos = at
                for d in rep.slices:
                    plan.setdefault((d.endpoint, d.segment), []).append((pos, d.offset, d.length))
                    pos += d.length
            at += t.size
        for plan, op in ((reads, Op.READ), (writes, Op.WRITE)):
            for (ep, name), reqs in plan.items():
                if op is Op.WRITE and name != self.disk_segment:
                    raise ValueError(f"a demotion into {name!r}, not this node's disk")
                rs = eng.open_segment(ep, name)
                lo, ro, ln = (list(x) for x in zip(*reqs))
                eng.transfer(op, stage, lo, rs, ro, ln)
        # now, not at the end: the next batch reuses the staging buffer
        sums = checksums(stage.array(), starts, [t.size for t in batch]).tolist()
        return lambda: sums

    def _demote_direct(
        self, eng: TransferEngine, region: Any, batch: list[Any]
    ) -> Callable[[], list[int]]:
        """Copies whose memory copy is one range of our own segment: written from it
        straight into the disk (the engine bounces what O_DIRECT cannot take), no staging
        memcpy. The crc is of the source, computed on another thread while the bytes are
        written (the source is a COMPLETE object's memory, unchanged until the object is
        freed): bytes that changed meanwhile belong to an object freed under us, whose
        DemoteEnd the master refuses (by version or absence). :meth:`_end` waits for it."""
        lo: list[int] = []
        ro: list[int] = []
        ln: list[int] = []
        for t in batch:
            pos = t.src.slices[0].offset
            for d in t.dst.slices:
                if d.segment != self.disk_segment:
                    raise ValueError(f"a demotion into {d.segment!r}, not this node's disk")
                lo.append(pos)
                ro.append(d.offset)
                ln.append(d.length)
                pos += d.length
        disk = eng.open_segment(eng.address, self.disk_segment)
        offs, sizes = [t.src.slices[0].offset for t in batch], [t.size for t in batch]
        if self._sum_pool is None:
            self._sum_pool = ThreadPoolExecutor(1, thread_name_prefix="store-node-crc")
        sums = self._sum_pool.submit(lambda: checksums(region.array(), offs, sizes).tolist())
        eng.transfer(Op.WRITE, region, lo, disk, ro, ln)
        return sums.result

    def close(self, grace_s: float = 0.0, lease_s: float = 0.0) -> None:
        """Unmount and free the memory. ``grace_s`` 0: the master drops this segment's
        copies at once; else they stay readable (no new allocations) for ``grace_s`` while
        the memory is kept, plus ``lease_s`` (the master's lease TTL) for readers that were
        granted a lease just before the end. Readers still copying when the memory goes get
        a per-key error, never other bytes: the segment is unpublished, not reused."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.region is None:
            self._close_disk()
            return
        try:
            self.master.mutate(
                lambda rid, s: P.UnmountReq(rid, s, self.node_id, self.segment, grace_s),
                timeout=5.0,
            )
        except E.StoreError as e:
            log.warning(
                "store node %s: unmount failed (the master expires it later): %s", self.node_id, e
            )
        if grace_s > 0:
            time.sleep(grace_s + lease_s)
        region, self.region = self.region, None
        try:
            self.engine.unregister(region)
        except Exception:
            log.debug("store node %s: unregister failed", self.node_id, exc_info=True)
        self._close_disk()

    def _close_disk(self) -> None:
        """Unregister the disk segment (its files stay: a restart on the path finds them)."""
        for pool in (self._end_pool, self._sum_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self._end_pool = self._sum_pool = None
        stage, self._stage = self._stage, None
        if stage is not None:
            try:
                self.engine.unregister(stage)
            except Exception:
                log.debug("store node %s: staging unregister failed", self.node_id, exc_info=True)
        seg, self.disk = self.disk, None
        if seg is None:
            return
        try:
            self.engine.unregister(seg)
        except Exception:
            log.debug("store node %s: disk unregister failed", self.node_id, exc_info=True)


def disk_id(path: str) -> str:
    """The id of the disk segment at ``path``, kept in ``PATH.kvmesh-id``: read, or made at
    random and written durably (fdatasync of the file, fsync of its directory) before the
    segment is mounted with it -- an id the master knows is never lost by a power cut. A
    missing or unreadable file gives a new id: the disk adopts nothing."""
    f = f"{os.fspath(path).rstrip(os.sep)}.kvmesh-id"
    try:
        with open(f, encoding="ascii") as fh:
            got = fh.read().strip()
        if len(got) == 32 and all(c in "0123456789abcdef" for c in got):
            return got
        log.warning("disk id file %s is not an id: the disk gets a new one", f)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        log.warning("disk id file %s unreadable (%r): the disk gets a new one", f, e)
    new = secrets.token_hex(16)
    tmp = f"{f}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{new}\n".encode("ascii"))
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, f)
    d = os.open(os.path.dirname(os.path.abspath(f)), os.O_RDONLY)
    try:
        os.fsync(d)
    finally:
        os.close(d)
    return new


def _one_code(resp: Any) -> int:
    if type(resp) in (P.CodesResp, P.DemoteTasksResp):
        return int(resp.codes[0]) if resp.codes else 0
    if type(resp) is P.ErrorResp:
        return int(resp.code)
    raise E.StoreError(f"unexpected reply {type(resp).__name__}")
