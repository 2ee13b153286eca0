"""The :class:`~.state.StoreStateMachine` part that frees objects: ``Remove``,
``RemoveAll``, ``RemovePrefix``, ``Reclaim``, ``Evict``, the ``Release`` of held bytes, and
``_drop`` (one object through the lifecycle, its bytes freed or held), which the put
protocol's revoke uses too.
"""

from __future__ import annotations

from ..errors import Code
from ..types import MAX_BATCH_KEYS
from .commands import (
    Codes,
    Evict,
    EvictResult,
    Reclaim,
    ReclaimResult,
    Release,
    Remove,
    RemoveAll,
    RemoveAllResult,
    RemovePrefix,
    RemovePrefixResult,
)
from .objects import PIN_HARD, PIN_SOFT, Event, State, next_state
from .segments import DRAINING, OFFLINE

__all__ = ["Removes"]

_P, _C = int(State.PROCESSING), int(State.COMPLETE)


class Removes:
    """The freeing handlers of :class:`~.state.StoreStateMachine`."""

    def _drop(self, key: str, event: Event, hold_tag: int = 0) -> bool:
        """Remove ``key`` through ``event`` if the lifecycle allows it; frees its bytes."""
        o = self.objects.get(key)
        if o is None:
            return False
        busy = key in self.processing
        if next_state(_P if busy else _C, event) is not State.GONE:
            return False
        del self.objects[key]
        if busy:
            del self.processing[key]
        else:
            self.complete -= 1
        self._release_copies(key, o, hold_tag)
        return True

    def _remove(self, index: int, c: Remove) -> Codes:
        if not self._batch_ok(c.keys):
            return Codes([int(Code.INVALID_PARAMS)] * len(c.keys))
        codes = []
        tag = index if c.hold else 0
        for key in c.keys:
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
            elif not self._drop(key, Event.REMOVE, tag):
                codes.append(int(Code.REPLICA_IS_NOT_READY))
            else:
                codes.append(0)
        if tag and not self.held.get(tag):
            self.held.pop(tag, None)
        return Codes(codes)

    def _remove_all(self, index: int, c: RemoveAll) -> RemoveAllResult:
        skip = set(c.skip)
        tag = index if c.hold else 0
        n = 0
        for key in list(self.objects):
            if key not in skip and self._drop(key, Event.REMOVE, tag):
                n += 1
        if tag and not self.held.get(tag):
            self.held.pop(tag, None)
        return RemoveAllResult(n)

    def _remove_prefix(self, index: int, c: RemovePrefix) -> RemovePrefixResult:
        if not self._batch_ok(c.keys):
            return RemovePrefixResult(0, c.skipped, c.more)
        tag = index if c.hold else 0
        removed = busy = 0
        objs = self.objects
        p = c.prefix
        for key in c.keys:
            o = objs.get(key) if type(key) is str else None
            if o is None or not key.startswith(p):
                continue  # gone since the leader's scan (or never matched): nothing to do
            if self._drop(key, Event.REMOVE, tag):
                removed += 1
            else:
                busy += 1  # PROCESSING again (re-put since the scan): its writer owns it
        if tag and not self.held.get(tag):
            self.held.pop(tag, None)
        return RemovePrefixResult(removed, c.skipped + busy, c.more)

    def _reclaim(self, index: int, c: Reclaim) -> ReclaimResult:
        cutoff = c.now - c.put_timeout
        objs = self.objects
        # (version, key) order: the same on a replica restored from a snapshot
        stale = sorted(
            (k for k in self.processing if objs[k].started < cutoff),
            key=lambda k: (objs[k].version, k),
        )
        for k in stale:
            self._drop(k, Event.RECLAIM)
        # (an offline disk segment whose node did not come back in time goes too)
        due = [
            s for s in self.segs.values() if s.state in (DRAINING, OFFLINE) and s.deadline <= c.now
        ]
        lost: list[str] = []
        for s in due:
            lost.extend(self._drop_segment(s, c.now, index))
        return ReclaimResult(stale, [s.name for s in due], lost)

    def _evict(self, index: int, c: Evict) -> EvictResult:
        if not self._batch_ok(c.keys) or (c.versions and len(c.versions) != len(c.keys)):
            return EvictResult([int(Code.INVALID_PARAMS)] * len(c.keys), 0)
        codes = []
        freed = 0
        for i, key in enumerate(c.keys):
            o = self.objects.get(key) if type(key) is str else None
            if o is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            if (
                (c.versions and c.versions[i] != o.version)
                or o.pin == PIN_HARD
                or (o.pin == PIN_SOFT and o.pin_until > c.now and not c.allow_soft)
            ):
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            nbytes = self._bytes(o)
            if not self._drop(key, Event.EVICT):
                codes.append(int(Code.NOT_EVICTABLE))
                continue
            freed += nbytes
            codes.append(0)
        return EvictResult(codes, freed)

    def _release(self, index: int, c: Release) -> Codes:
        codes = []
        for tag in c.tags[:MAX_BATCH_KEYS]:
            ext = self.held.pop(tag, None)
            if ext is None:
                ext = self.reserved.pop(tag, None)  # a writer's reservation that lapsed
            if ext is None:
                codes.append(int(Code.OBJECT_NOT_FOUND))
                continue
            for sid, off, ln in ext:
                self.segs[sid].alloc.free(off, ln)
            codes.append(0)
        return Codes(codes)
