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
from typing import Any

from ..net import speaks_for_node
from ..transfer import DiskSegment, MemoryRegion, TransferEngine, get_engine
from . import errors as E
from . import protocol as P
from .rpc import MasterClient
from .tiercopy import DEMOTE_BATCH, TierCopier

__all__ = ["StorageNode"]

log = logging.getLogger(__name__)

DEMOTE_POLL_S = 0.2  # a node with a disk heartbeats (asking for demotions) this often
# ... and this often for a while after demotions progressed: the leader starts the next batch
# at a tick of its own, which a poll every DEMOTE_POLL_S would meet that much later
DEMOTE_BUSY_POLL_S = 0.003
DEMOTE_BUSY_S = 1.0


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
        self.disk_id = ""
        self.adopted = (0, 0)  # the last re-adoption: (copies kept, copies dropped)
        self.copier = TierCopier(self, self._stop)  # the disk tier's copies (tiercopy.py)

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
                    self.copier.promote(resp.promote)
                if type(resp) is P.DemoteTasksResp and resp.tasks and resp.codes == [0]:
                    # ask again at once while the demotions progress: the leader has likely
                    # started the next batch while this one was copied (a poll period per
                    # batch bounded demotion); no progress (a failing disk) waits a period
                    again = self.copier.demote(resp.tasks) > 0
                if _one_code(resp) != 0 and not self._stop.is_set():
                    log.warning(
                        "store node %s: the master forgot this node; mounting again", self.node_id
                    )
                    self._remount()
            except E.StoreError as e:
                log.warning("store node %s: heartbeat failed: %s", self.node_id, e)
            except Exception:
                log.exception("store node %s: heartbeat failed", self.node_id)

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
        self.copier.close()
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
