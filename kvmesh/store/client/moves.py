"""The client's engine batches: segment handles, one batch of requests as numpy columns
(grouped by region and segment), per-transport counts. No keys here: owners are indexes."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...transfer import MemoryRegion, Op, TransferError

__all__ = ["Moves"]

log = logging.getLogger(__name__)


class Moves:
    """Engine batches of the client: ``(owner, region, local offset, segment, remote offset,
    length)`` requests moved as one batch; the owners whose requests failed come back."""

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
        handle = [handles.get(y) for y in range(len(segs))]
        moved = self.engine.transfer_grouped(
            op, regions, reg, lo, handle, seg, ro, ln, timeout=deadline
        )
        for res in moved.results:
            transports.update(self._count(op, res))
        if not moved.ok.all():
            failed.append(owner[~moved.ok])
            if moved.one_by_one:  # a group refused alone: its segment is opened afresh
                for y in np.unique(seg[~moved.ok]).tolist():
                    name, _node, ep = segs[y]
                    log.info("store: %s batch on %s failed", op.value, name)
                    self._forget_segment(ep, name)
        return _owners(failed), sorted(transports)


_NO_OWNERS = np.empty(0, np.int64)


_NO_OWNERS.flags.writeable = False  # shared: callers only read it


# (op, transport kinds of a batch) -> (stats key, transport names): a handful of entries
_COUNT_KEYS: dict[tuple[Op, tuple[Any, ...]], tuple[str, ...]] = {}


def _owners(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _NO_OWNERS
    return np.unique(np.concatenate(parts))
