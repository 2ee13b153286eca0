"""Memory lifetime across processes: no same-host peer copies into a region after unregister.

A peer on this host copies into our memory by itself: it maps our ``/dev/shm`` file (``shm``)
or UCX writes with ``process_vm_writev`` (``nixl``, cma). We cannot stop its ``memcpy``; the
peer has to stop, and we have to know when it did. The protocol uses file locks, which the
kernel keeps consistent between processes and drops when a process dies:

* Every process that publishes memory owns one *fence file* (a ``/dev/shm`` file made by
  :func:`kvmesh.transfer.shmfile.create`, named in every ``SegmentDescriptor.fence``). Region
  ``r`` (ids are unique per process and never reused) has two bytes in it: ``GATE(r)`` and
  ``USE(r)``.
* A peer job holds a read lock on ``USE(r)`` while it copies (one lock per peer process,
  counted between its threads) and tests ``GATE(r)`` between chunks of at most
  ``transports.base.CHUNK_BYTES``; a write lock on ``GATE(r)`` means "removed": the job stops
  with ``SegmentNotFound``. A read lock on ``USE(r)`` that cannot be taken means the same.
* ``revoke(r)`` (from ``unregister``) write-locks ``GATE(r)`` (never contended), then waits
  until it can write-lock ``USE(r)``: from then on no peer copies into ``r`` and none can start.
  Both locks stay held for the life of the process. A peer that dies drops its locks; a peer
  that is stopped mid-chunk makes ``revoke`` time out (``TransferTimeout``), and the memory is
  then not handed back (see docs/transfer.md, "Memory lifetime").
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import threading
import time

from . import shmfile
from .errors import SegmentNotFound, TransferTimeout

log = logging.getLogger("kvmesh.transfer")

_BASE = 1 << 40  # lock bytes live far past byte 0, the file's liveness lock


def _gate(region_id: int) -> int:
    return _BASE + 2 * region_id


def _use(region_id: int) -> int:
    return _BASE + 2 * region_id + 1


# --- owner side ----------------------------------------------------------------------------
class _OwnerFence:
    def __init__(self) -> None:
        self.name, self.fd = shmfile.create(0)
        self.published: set[int] = set()
        self.revoked: set[int] = set()


_owner: _OwnerFence | None = None
_owner_lock = threading.Lock()


_no_fence: str | None = None  # why this process has no fence file (no usable /dev/shm)


def publish(region_id: int) -> str | None:
    """Name of this process's fence file (created on first use); ``region_id`` gets fenced.

    ``None`` when no fence file can be made here: same-host peers then cannot copy directly
    (``shm``, ``nixl`` refuse a segment without a fence) and use the ``tcp`` path, where we
    copy ourselves.
    """
    global _owner, _no_fence
    with _owner_lock:
        if _owner is None:
            if _no_fence is not None:
                return None
            try:
                _owner = _OwnerFence()
            except OSError as exc:
                _no_fence = str(exc)
                log.warning(
                    "no fence file in %s (%s): same-host peers will use tcp", shmfile.SHM_DIR, exc
                )
                return None
        _owner.published.add(region_id)
        return _owner.name


@atexit.register
def _remove_fence_file() -> None:
    # Our regions die with us: the file has no use left (a killed process leaves it to the
    # sweep, which sees its lock gone).
    if _owner is not None:
        try:
            os.unlink(os.path.join(shmfile.SHM_DIR, _owner.name))
        except OSError:
            pass


def revoke(region_id: int, timeout: float) -> None:
    """Close ``region_id`` to same-host peers and wait until none copies into it any more.

    Raises ``TransferTimeout`` if a peer still holds it after ``timeout`` seconds (the gate
    stays closed: calling again waits again). A no-op for regions never published.
    """
    with _owner_lock:
        own = _owner
        if own is None or region_id not in own.published or region_id in own.revoked:
            return
    fd = own.fd
    shmfile.try_lock(fd, _gate(region_id), write=True)
    end = time.monotonic() + timeout
    pause = 5e-5
    while not shmfile.try_lock(fd, _use(region_id), write=True):
        if time.monotonic() > end:
            raise TransferTimeout(
                f"memory region {region_id} is still being copied by a same-host peer after "
                f"{timeout:.1f}s; it is not handed back"
            )
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    with _owner_lock:
        own.published.discard(region_id)
        own.revoked.add(region_id)


# --- peer side -----------------------------------------------------------------------------
class FenceClient:
    """A peer's open handle on an owner's fence file, shared by the routes of this process.

    On the per-job path (4 KiB copies take ~10 µs) every microsecond shows: the lock requests
    are packed once per region and passed to ``fcntl`` directly.
    """

    __slots__ = ("_fd", "_held", "_lock", "_packed", "_routes", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._fd, _ = shmfile.open_peer(name, write=False)
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # region id -> jobs of this process inside it
        self._packed: dict[int, tuple[bytes, bytes, bytes]] = {}
        self._routes = 0

    def _requests(self, region_id: int) -> tuple[bytes, bytes, bytes]:
        """(read-lock USE, unlock USE, query GATE) for ``region_id``, packed."""
        req = self._packed.get(region_id)
        if req is None:
            if len(self._packed) > 4096:  # bounded: regions come and go
                self._packed.clear()
            use, gate = _use(region_id), _gate(region_id)
            req = self._packed[region_id] = (
                shmfile.flock_request(fcntl.F_RDLCK, use),
                shmfile.flock_request(fcntl.F_UNLCK, use),
                shmfile.flock_request(fcntl.F_RDLCK, gate),
            )
        return req

    def enter(self, region_id: int, segment: str) -> None:
        """Start a job on ``region_id``; ``SegmentNotFound`` if its owner removed it.

        One lock request when no other job of this process is inside. The gate is not tested
        here: a job that starts while the owner waits only delays it by one job, and the
        owner's removal notice stops new jobs (``validate_requests``) within milliseconds.
        """
        with self._lock:
            n = self._held.get(region_id, 0)
            if n == 0:
                try:
                    fcntl.fcntl(self._fd, shmfile.F_OFD_SETLK, self._requests(region_id)[0])
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    raise SegmentNotFound(
                        f"segment {segment!r} was unregistered by its owner"
                    ) from None
            self._held[region_id] = n + 1

    def enter_many(self, regions: list[tuple[int, str]]) -> None:
        """:meth:`enter` for ``(region id, segment name)`` pairs of one call, under one lock;
        on a refusal the ones entered so far are left and ``SegmentNotFound`` names it."""
        done: list[int] = []
        with self._lock:
            held = self._held
            try:
                for rid, segment in regions:
                    n = held.get(rid, 0)
                    if n == 0:
                        try:
                            fcntl.fcntl(self._fd, shmfile.F_OFD_SETLK, self._requests(rid)[0])
                        except OSError as exc:
                            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                                raise
                            raise SegmentNotFound(
                                f"segment {segment!r} was unregistered by its owner"
                            ) from None
                    held[rid] = n + 1
                    done.append(rid)
            except BaseException:
                self._leave_locked(done)
                raise

    def leave_many(self, region_ids: list[int]) -> None:
        """:meth:`leave` for every region of an :meth:`enter_many`, under one lock."""
        with self._lock:
            self._leave_locked(region_ids)

    def _leave_locked(self, region_ids: list[int]) -> None:
        held = self._held
        for rid in region_ids:
            n = held[rid] - 1
            if n:
                held[rid] = n
                continue
            del held[rid]
            fcntl.fcntl(self._fd, shmfile.F_OFD_SETLK, self._requests(rid)[1])

    def check(self, region_id: int, segment: str) -> None:
        """Raise ``SegmentNotFound`` once the owner started removing ``region_id``."""
        res = fcntl.fcntl(self._fd, shmfile.F_OFD_GETLK, self._requests(region_id)[2])
        if shmfile.flock_type(res) != fcntl.F_UNLCK:
            raise SegmentNotFound(f"segment {segment!r} was unregistered by its owner")

    def leave(self, region_id: int) -> None:
        with self._lock:
            n = self._held[region_id] - 1
            if n:
                self._held[region_id] = n
                return
            del self._held[region_id]
            fcntl.fcntl(self._fd, shmfile.F_OFD_SETLK, self._requests(region_id)[1])


_clients: dict[str, FenceClient] = {}
_clients_lock = threading.Lock()


def attach(name: str) -> FenceClient:
    """The process's client of fence file ``name`` (one more route uses it)."""
    with _clients_lock:
        fc = _clients.get(name)
        if fc is None:
            fc = _clients[name] = FenceClient(name)
        fc._routes += 1
        return fc


def detach(fc: FenceClient) -> None:
    """A route using ``fc`` closed; the file is closed with the last one."""
    with _clients_lock:
        fc._routes -= 1
        if fc._routes > 0 or fc._held:
            return
        if _clients.get(fc.name) is fc:
            del _clients[fc.name]
    os.close(fc._fd)
