"""The cache of prepared descriptor lists of one agent (``prep_xfer_dlist`` handles).

One list per (peer or local side, region, granule): one row per ``granule`` bytes of the
region (:func:`~kvmesh.transfer.nixl.plan.granule_table`). Preparing one costs milliseconds,
using it for a batch 10-100 us, so lists are kept in LRU order, bounded by the total number of
rows, and reference counted: deregistering a region, removing a peer or evicting never
releases a list that a live transfer handle still uses (it is released by the last user).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["Prepped", "PreppedCache"]

log = logging.getLogger("kvmesh.transfer.nixl")

# (peer name or "" for local memory, addr, size, kind, device, granule)
Key = tuple[str, int, int, str, int, int]


class Prepped:
    """A cached prepared descriptor list: one row per ``granule`` bytes of a region."""

    __slots__ = ("key", "handle", "rows", "users", "dead")

    def __init__(self, key: Key, handle: Any, rows: int) -> None:
        self.key = key
        self.handle = handle
        self.rows = rows
        self.users = 0
        self.dead = False


def _release(entry: Prepped) -> None:
    try:
        entry.handle.release()
    except Exception as exc:
        log.debug("NIXL: releasing a prepared list: %s", exc)


class PreppedCache:
    """Prepared lists of one agent. The caller holds ``lock`` for every call but :meth:`unuse`.

    ``prepare(peer, addr, size, kind, device, granule)`` builds a list and returns
    ``(handle, rows)``.
    """

    def __init__(
        self,
        prepare: Callable[[str, int, int, str, int, int], tuple[Any, int]],
        max_rows: int,
        lock: threading.RLock,
    ) -> None:
        self._prepare = prepare
        self._max_rows = max_rows
        self._lock = lock
        self._entries: OrderedDict[Key, Prepped] = OrderedDict()
        self._closed = False
        self.rows = 0  # over every cached list

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, peer: str, addr: int, size: int, kind: str, device: int, granule: int) -> Prepped:
        """The list for (peer, region, granule), with one more user (:meth:`unuse` it).

        Counting the user before anything else is prepared keeps the eviction of the next
        list from releasing this one.
        """
        key = (peer, addr, size, kind, device, granule)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.users += 1
            return entry
        handle, rows = self._prepare(peer, addr, size, kind, device, granule)
        entry = Prepped(key, handle, rows)
        entry.users = 1
        self._entries[key] = entry
        self.rows += rows
        self._evict()
        return entry

    def _evict(self) -> None:
        if self.rows <= self._max_rows:
            return
        for key in list(self._entries):
            if self.rows <= self._max_rows:
                break
            entry = self._entries[key]
            if entry.users == 0:
                self._drop(entry)

    def _drop(self, entry: Prepped) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self.rows -= entry.rows
        entry.dead = True
        if entry.users == 0 and not self._closed:
            _release(entry)

    def drop(self, match: Callable[[Key], bool]) -> None:
        """Forget the lists whose key matches; each is released once nobody uses it."""
        for key in [k for k in self._entries if match(k)]:
            self._drop(self._entries[key])

    def unuse(self, entries: tuple[Prepped, ...]) -> None:
        """A transfer handle is done with ``entries`` (takes the lock itself)."""
        if not entries:
            return
        with self._lock:
            for entry in entries:
                entry.users -= 1
                if entry.dead and entry.users == 0 and not self._closed:
                    _release(entry)

    def close(self) -> None:
        """Release every list now (the agent is closing); later calls release nothing."""
        for entry in self._entries.values():
            try:
                entry.handle.release()
            except Exception as exc:
                log.debug("NIXL close: prepared list: %s", exc)
        self._entries.clear()
        self.rows = 0
        self._closed = True
