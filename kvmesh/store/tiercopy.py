"""The storage node's share of the disk tier: the copies themselves (docs/store.md, "Disk
tier"). A :class:`TierCopier` (one per :class:`~.node.StorageNode`, as ``node.copier``)
runs the demotions and promotions the master hands the node in its heartbeat replies:

* **Demotion** (:meth:`TierCopier.demote`): each object's memory copy written into the
  node's disk segment -- straight from its own memory segment when the copy is there, else
  through a staging buffer --, then fdatasync, crc32c and ``DemoteEnd`` on an end thread
  while the next batch is written. Only that entry makes a disk copy COMPLETE; a batch
  that fails is reported failed (:meth:`TierCopier.report_failed`) and the copying stops
  until the next poll.
* **Promotion on hit** (:meth:`TierCopier.promote`): a disk-only object's disk copy read
  into the memory the master reserved for it, checked against its crc32c, then
  ``PromoteEndReq``.

The node's lifecycle (mounting, heartbeats, re-adoption, close) stays in ``node.py``; this
module only moves bytes the master asked for, between the node's own segments.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..transfer import MemoryRegion, Op, TransferEngine
from ..transfer.disk import checksums
from . import errors as E
from . import protocol as P

if TYPE_CHECKING:
    from ..transfer import DiskSegment
    from .rpc import MasterClient


class NodeView(Protocol):
    """What the copies read of their storage node (:class:`~.node.StorageNode`): its
    segments as they are now (a remount renames the memory segment), its id, engine and
    master connection."""

    node_id: str
    engine: TransferEngine
    master: MasterClient
    region: MemoryRegion | None
    segment: str
    size: int
    disk: DiskSegment | None
    disk_segment: str


__all__ = ["DEMOTE_BATCH", "STAGE_BYTES", "NodeView", "TierCopier"]

# the node's logger: these are its messages ("store node X: ..."), filtered under its name
log = logging.getLogger("kvmesh.store.node")

DEMOTE_BATCH = 1024  # demotions one heartbeat asks for
STAGE_BYTES = 64 << 20  # bytes one demotion batch stages (a larger object alone)


class TierCopier:
    """The demotion and promotion copies of ``node`` (its segments are read through it:
    a remount renames them)."""

    def __init__(self, node: NodeView, stop: threading.Event) -> None:
        self._node = node
        self._stop = stop
        self.demoted = 0  # objects this node demoted (DemoteEnd accepted)
        self.promoted = 0  # objects this node promoted back to memory (PromoteEnd accepted)
        self._stage: MemoryRegion | None = None
        self._end_pool: ThreadPoolExecutor | None = None  # sends DemoteEnds (demote)
        self._sum_pool: ThreadPoolExecutor | None = None  # crcs while a batch is written

    @property
    def engine(self) -> TransferEngine:
        return self._node.engine

    @property
    def master(self) -> MasterClient:
        return self._node.master

    def demote(self, tasks: list[Any]) -> int:
        """Copy the demotions the master gave us (docs/store.md, "Disk tier"): each object's
        memory copy into our disk segment (straight from our memory segment when the copy
        is there, else through a staging buffer), fdatasync, then ``DemoteEnd`` with the
        crc32c of the bytes. Only that entry makes the disk copy COMPLETE; a batch that
        fails is reported failed (:meth:`report_failed`) with the rest, and the copying
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
                log.warning("store node %s: demotion end failed: %r", self._node.node_id, e)
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
                sums = self._write_batch(eng, batch, total)
            except Exception as e:  # noqa: BLE001 - reported: the master revokes them
                log.warning(
                    "store node %s: demotion of %d objects failed: %r",
                    self._node.node_id,
                    len(batch),
                    e,
                )
                # this batch and the ones not tried yet (the disk failed: they would too)
                self.report_failed(batch + tasks)
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

    def report_failed(self, tasks: list[Any]) -> None:
        """Tell the master that demotions ``tasks`` failed (``DemoteEndReq.failed``): it
        revokes them at once -- their memory copies stay the only ones -- and backs off
        from our disk before it places demotions there again. Unsent (the master does not
        answer): its demotion timeout revokes them as well."""
        try:
            self.master.mutate(
                lambda rid, s: P.DemoteEndReq(
                    rid, s, self._node.node_id, [], [], [], 0,
                    [t.key for t in tasks], [t.version for t in tasks],
                )
            )  # fmt: skip
        except E.StoreError as e:
            log.warning("store node %s: reporting failed demotions: %s", self._node.node_id, e)

    def promote(self, tasks: list[Any]) -> int:
        """Promotion on hit (docs/store.md, "Disk tier"): read each disk-only object's disk
        copy (on our disk) into the memory the master reserved for it (in our memory
        segment), check the bytes against the copy's crc32c -- a corrupt copy is never
        promoted -- and end them with one ``PromoteEndReq`` per reservation. A task that
        names anything else is skipped; one never ended is released by the master."""
        eng, region = self.engine, self._node.region
        if region is None or self._node.disk is None:
            return 0
        mine = [
            t
            for t in tasks
            if len(t.src.slices) == 1
            and len(t.dst.slices) == 1
            and t.src.slices[0].segment == self._node.disk_segment
            and t.dst.slices[0].segment == self._node.segment
            and t.src.slices[0].length == t.dst.slices[0].length == t.size
            and 0 <= t.dst.slices[0].offset <= self._node.size - t.size
        ]
        if not mine:
            return 0
        done = 0
        try:
            disk = eng.open_segment(eng.address, self._node.disk_segment)
            eng.transfer(
                Op.READ, region, [t.dst.slices[0].offset for t in mine], disk,
                [t.src.slices[0].offset for t in mine], [t.size for t in mine],
            )  # fmt: skip
            got = checksums(region.array(), [t.dst.slices[0].offset for t in mine],
                            [t.size for t in mine]).tolist()  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the master releases the memory later
            log.warning("store node %s: promotion of %d objects failed: %r", self._node.node_id,
                        len(mine), e)  # fmt: skip
            return 0
        by_tag: dict[int, list[Any]] = {}
        for t, c in zip(mine, got):
            if int(c) == t.crc:
                by_tag.setdefault(t.tag, []).append(t)
            else:
                log.warning("store node %s: disk copy of %r fails its crc: not promoted",
                            self._node.node_id, t.key)  # fmt: skip
        for tag, ts in by_tag.items():
            try:
                resp = self.master.mutate(
                    lambda rid, s, tag=tag, ts=ts: P.PromoteEndReq(
                        rid, s, self._node.node_id, tag, [t.key for t in ts],
                        [t.version for t in ts], [self._node.segment] * len(ts),
                        [t.dst.slices[0].offset for t in ts],
                    )
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the master releases the memory later
                log.warning("store node %s: promotion end failed: %r", self._node.node_id, e)
                continue
            if type(resp) is P.CodesResp:
                done += resp.codes.count(0)
        self.promoted += done
        return done

    def _end(self, eng: TransferEngine, batch: list[Any], sums: Callable[[], list[int]]) -> Any:
        """A written batch's end (the end thread of :meth:`demote`): fdatasync of the disk,
        the crc32c of the bytes (``sums``), then ``DemoteEnd``: the master makes the disk
        copies COMPLETE only from it, so only durable bytes with their crc are ever
        COMPLETE. A failure here (the sync's ``EIO``) is reported like a failed write
        (:meth:`report_failed`: the master revokes the batch at once and backs off from
        this disk) and raised to :meth:`demote`, which stops copying until the next poll."""
        try:
            eng.sync_segment(eng.open_segment(eng.address, self._node.disk_segment))
            crcs = sums()
        except Exception:
            self.report_failed(batch)
            raise
        return self.master.mutate(
            lambda rid, s: P.DemoteEndReq(
                rid,
                s,
                self._node.node_id,
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

    def _write_batch(
        self, eng: TransferEngine, batch: list[Any], total: int
    ) -> Callable[[], list[int]]:
        """Write ``batch`` into our disk (not yet synced); returns what computes the crcs
        of the bytes written (:meth:`_end` calls it after the sync)."""
        region = self._node.region
        if region is not None and all(
            len(t.src.slices) == 1
            and t.src.slices[0].segment == self._node.segment
            and t.src.slices[0].endpoint == eng.address
            for t in batch
        ):
            return self._write_direct(eng, region, batch)
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
                if op is Op.WRITE and name != self._node.disk_segment:
                    raise ValueError(f"a demotion into {name!r}, not this node's disk")
                rs = eng.open_segment(ep, name)
                lo, ro, ln = (list(x) for x in zip(*reqs))
                eng.transfer(op, stage, lo, rs, ro, ln)
        # now, not at the end: the next batch reuses the staging buffer
        sums = checksums(stage.array(), starts, [t.size for t in batch]).tolist()
        return lambda: sums

    def _write_direct(
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
                if d.segment != self._node.disk_segment:
                    raise ValueError(f"a demotion into {d.segment!r}, not this node's disk")
                lo.append(pos)
                ro.append(d.offset)
                ln.append(d.length)
                pos += d.length
        disk = eng.open_segment(eng.address, self._node.disk_segment)
        offs, sizes = [t.src.slices[0].offset for t in batch], [t.size for t in batch]
        if self._sum_pool is None:
            self._sum_pool = ThreadPoolExecutor(1, thread_name_prefix="store-node-crc")
        sums = self._sum_pool.submit(lambda: checksums(region.array(), offs, sizes).tolist())
        eng.transfer(Op.WRITE, region, lo, disk, ro, ln)
        return sums.result

    def close(self) -> None:
        """Stop the end and crc threads, unregister the staging buffer."""
        for pool in (self._end_pool, self._sum_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self._end_pool = self._sum_pool = None
        stage, self._stage = self._stage, None
        if stage is not None:
            try:
                self.engine.unregister(stage)
            except Exception:
                log.debug(
                    "store node %s: staging unregister failed", self._node.node_id, exc_info=True
                )
