"""Placement of objects' slices on the mounted segments: the
:class:`~.state.StoreStateMachine` part that chooses a segment per slice and allocates.

Placement of one object (``_place``): the size is cut into slices of at most
``MasterConfig.slice_limit`` bytes; for each copy and each slice a segment is chosen among
the mounted segments whose largest free extent fits, whose node holds no other copy of the
object, preferring (1) ``preferred_segment`` for the first copy, (2) nodes already holding
this copy's earlier slices, then (3) the strategy: ``local`` = segments on ``writer_host``,
most free bytes first; ``most_free``; ``random`` = a SplitMix64 draw seeded by (log index,
key position, copy, slice). Inside the segment the allocator takes the best fit. If any slice
finds no segment, everything allocated for the object is returned and the key gets
``NoSpace`` (the service then evicts and retries).

The common PutStart (one copy of one slice per key, not ``random``, no preferred segment)
is placed per batch (``_put_start_batch``), with exactly the per-key path's outcome.
"""

from __future__ import annotations

from ..errors import Code
from ..types import MAX_OBJECT_SIZE, ReplicaRun, ReplicateConfig, key_error, keys_valid
from .commands import PutStart, PutStartRun, Upsert
from .objects import Event, State, next_state, pin_of, slice_lengths
from .segments import MEMORY, MOUNTED, Segment

__all__ = ["Placement"]

_M64 = (1 << 64) - 1
_NONE: frozenset[str] = frozenset()


def _mix(x: int) -> int:
    """SplitMix64 finaliser: a well-spread 64-bit hash of ``x`` (deterministic)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _free_bytes(s: Segment) -> int:
    return s.alloc.free_bytes


class Placement:
    """The placement part of :class:`~.state.StoreStateMachine`."""

    def _pick(
        self,
        n: int,
        exclude: set[str] | frozenset[str],
        prefer: set[str] | frozenset[str],
        cfg: ReplicateConfig,
        first: bool,
        draw: int,
        mounted: list[Segment],
    ) -> Segment | None:
        """The segment for one slice of ``n`` (aligned) bytes; see the module docstring."""
        if first and cfg.preferred_segment is not None:
            s = self.segs.get(self.by_name.get(cfg.preferred_segment, 0))
            if (
                s is not None
                and s.state == MOUNTED
                and s.medium == MEMORY
                and s.node_id not in exclude
                and s.alloc.largest() >= n
            ):
                return s
        if exclude:
            cands = [s for s in mounted if s.node_id not in exclude and s.alloc.largest() >= n]
        else:
            cands = [s for s in mounted if s.alloc.largest() >= n]
        if not cands:
            return None
        if prefer:
            same = [s for s in cands if s.node_id in prefer]
            if same:
                cands = same
        strategy = cfg.strategy
        if strategy == "random":
            return cands[_mix(draw) % len(cands)]
        if strategy == "local" and cfg.writer_host is not None:
            loc = [s for s in cands if s.host_id == cfg.writer_host]
            if loc:
                cands = loc
        return cands[0] if len(cands) == 1 else max(cands, key=_free_bytes)

    def _place(
        self, size: int, cfg: ReplicateConfig, index: int, pos: int, mounted: list[Segment]
    ) -> list[list[tuple[int, int]]] | None:
        a = self.config.align
        if cfg.replica_num == 1 and size <= self.config.slice_limit:  # the common case
            s = self._pick(
                (size + a - 1) & -a, _NONE, _NONE, cfg, True, (index << 24) ^ (pos << 12), mounted
            )
            return None if s is None else [[(s.id, s.alloc.alloc(size))]]
        lens = slice_lengths(size, self.config.slice_limit)
        used_nodes: set[str] = set()
        copies: list[list[tuple[int, int]]] = []
        done: list[tuple[Segment, int, int]] = []
        for r in range(cfg.replica_num):
            nodes: set[str] = set()
            copy = []
            for j, ln in enumerate(lens):
                draw = (index << 24) ^ (pos << 12) ^ (r << 8) ^ j
                s = self._pick((ln + a - 1) & -a, used_nodes, nodes, cfg, r == 0, draw, mounted)
                off = -1 if s is None else s.alloc.alloc(ln)
                if s is None or off < 0:
                    for seg, o, length in reversed(done):
                        seg.alloc.free(o, length)
                    return None
                done.append((s, off, ln))
                copy.append((s.id, off))
                nodes.add(s.node_id)
            used_nodes |= nodes
            copies.append(copy)
        return copies

    def _put_start_batch(self, index: int, c: PutStart | Upsert) -> PutStartRun | None:
        """The common PutStart (one copy, one slice per key, no preferred segment, not
        ``random``) for a whole batch at once, with exactly the outcome of the per-key path
        in :meth:`_put` (None: not this case, nothing changed). Keys are classified first;
        the ones to allocate are cut into runs of equal (aligned) size; per run the segment
        of each key is chosen as :meth:`_pick` would, with per-segment free bytes and the
        count of pieces each segment can still take (:meth:`SegmentAllocator.capacity`)
        standing in for the allocator, and then each segment allocates its share with one
        :meth:`SegmentAllocator.alloc_run` (the same offsets as one ``alloc`` per key).
        The answer is the compact :class:`PutStartRun` (what the per-key path would answer,
        see :meth:`PutStartRun.expand`)."""
        cfg = c.config
        lim = self.config.slice_limit
        if cfg.replica_num != 1 or cfg.strategy == "random" or cfg.preferred_segment is not None:
            return None
        keys, sizes = c.keys, c.sizes
        n = len(keys)
        objs = self.objects
        codes = [0] * n
        todo: list[int] = []
        fresh: dict[str, int] = {}  # the batch's keys -> this version (distinct if len n)
        if (
            n
            and keys_valid(keys)
            and set(map(type, sizes)) == {int}
            and min(sizes) >= 1
            and max(sizes) <= min(lim, MAX_OBJECT_SIZE)
            and len(fresh := dict.fromkeys(keys, index)) == n
        ):
            # The batch a conforming client sends: every key valid and distinct, every size
            # one slice (checked with C-level passes); only the table decides per key.
            olds = objs.rows_get(keys)
            if olds.count(None) == n:
                todo = list(range(n))
            else:
                proc = self.processing
                for pos, old in enumerate(olds):
                    if old is None:
                        todo.append(pos)
                    elif keys[pos] in proc:
                        codes[pos] = int(Code.REPLICA_IS_NOT_READY)  # a put is in flight
                    else:
                        codes[pos] = int(Code.OBJECT_ALREADY_EXISTS)
        else:
            seen: set[str] = set()
            for pos, (key, size) in enumerate(zip(keys, sizes)):
                if (
                    not (
                        type(key) is str
                        and 0 < len(key) <= 256
                        and key.isascii()
                        and "\0" not in key
                    )
                    and key_error(key) is not None
                ):
                    codes[pos] = int(Code.INVALID_KEY)
                elif not 1 <= size <= MAX_OBJECT_SIZE:
                    codes[pos] = int(Code.INVALID_PARAMS)
                elif size > lim or key in seen:
                    return None  # slices, or a key twice: the per-key path (nothing changed)
                else:
                    old = objs.index.get(key)
                    if old is None:
                        todo.append(pos)
                        seen.add(key)
                    elif key in self.processing:
                        codes[pos] = int(Code.REPLICA_IS_NOT_READY)  # a put is in flight
                    else:
                        codes[pos] = int(Code.OBJECT_ALREADY_EXISTS)
        if todo and next_state(State.GONE, Event.PUT_START) is not State.PROCESSING:
            return None
        where = [-1] * n
        offsets = [0] * n
        used: dict[int, int] = {}  # segment id -> its index in the result's segs
        used_segs: list[Segment] = []
        a = self.config.align
        mounted = [s for s in self.segs.values() if s.state == MOUNTED and s.medium == MEMORY]
        host = cfg.writer_host if cfg.strategy == "local" else None
        pin, until = pin_of(cfg, c.now, c.pin_ttl)
        processing = self.processing
        no_space = int(Code.NO_AVAILABLE_HANDLE)
        now = c.now
        everyone = len(todo) == n  # todo is then 0..n-1
        if everyone and n and (min(sizes) + a - 1) & -a == (max(sizes) + a - 1) & -a:
            runs = [todo]  # one aligned size: one run (no per-key scan)
        else:
            runs = []
            lo = 0
            while lo < len(todo):
                rounded = (sizes[todo[lo]] + a - 1) & -a
                hi = lo + 1
                while hi < len(todo) and (sizes[todo[hi]] + a - 1) & -a == rounded:
                    hi += 1
                runs.append(todo[lo:hi])
                lo = hi
        for run in runs:
            rounded = (sizes[run[0]] + a - 1) & -a
            left = [s.alloc.capacity(rounded, len(run)) for s in mounted]
            free = [s.alloc.free_bytes for s in mounted]
            share: list[list[int]] = [[] for _ in mounted]  # run positions per segment
            i = 0
            while i < len(run):
                cands = [j for j in range(len(mounted)) if left[j] > 0]
                if host is not None:
                    loc = [j for j in cands if mounted[j].host_id == host]
                    if loc:
                        cands = loc
                if not cands:
                    for pos in run[i:]:
                        codes[pos] = no_space
                    break
                if len(cands) == 1:  # the rest of the run (or what fits) goes there
                    j = cands[0]
                    take = min(left[j], len(run) - i)
                else:
                    j = max(cands, key=free.__getitem__)  # first of the most free, as _pick
                    take = 1
                share[j].extend(run[i : i + take])
                left[j] -= take
                free[j] -= take * rounded
                i += take
            whole = None  # the one segment that took the whole run, if one did
            for j, mine in enumerate(share):
                if not mine:
                    continue
                s = mounted[j]
                w = used.get(s.id)
                if w is None:
                    w = used[s.id] = len(used_segs)
                    used_segs.append(s)
                offs = s.alloc.alloc_run(rounded, len(mine))
                s.slices += len(mine)
                if len(mine) == len(run):
                    whole = (s, w, offs)
                    break
                for pos, off in zip(mine, offs):
                    where[pos] = w
                    offsets[pos] = off
            # table order as in the per-key path (snapshots, digests)
            if whole is not None:
                s, w, offs = whole
                sid = s.id
                m = len(run)
                if m == n:
                    rkeys, rsizes = keys, sizes
                else:
                    rkeys = [keys[pos] for pos in run]
                    rsizes = [sizes[pos] for pos in run]
                # column writes for the run, not a record per key
                objs.put_run(rkeys, rsizes, index, now, sid, offs, pin, until)
                # the PROCESSING index gets the batch's keys -> version (built above when
                # they checked distinct, which a set would have cost as much)
                processing.update(
                    fresh if m == n and len(fresh) == n else dict.fromkeys(rkeys, index)
                )
                if len(run) == n:  # the whole batch
                    where, offsets = [w] * n, offs
                    continue
                for pos, off in zip(run, offs):
                    where[pos] = w
                    offsets[pos] = off
                continue
            # several segments: the placed keys of the run in key order (the table order
            # of the per-key path), one column write for them all
            placed = [pos for pos in run if where[pos] >= 0]
            if placed:
                pkeys = [keys[pos] for pos in placed]
                objs.put_run(
                    pkeys,
                    [sizes[pos] for pos in placed],
                    index,
                    now,
                    [used_segs[where[pos]].id for pos in placed],
                    [offsets[pos] for pos in placed],
                    pin,
                    until,
                )
                processing.update(dict.fromkeys(pkeys, index))
        return PutStartRun(
            codes,
            index,
            ReplicaRun(
                [(s.name, s.node_id, s.endpoint) for s in used_segs],
                where,
                offsets,
                list(sizes)
                if -1 not in where
                else [z if w >= 0 else 0 for z, w in zip(sizes, where)],
            ),
        )
