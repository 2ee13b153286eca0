"""The store master's request handlers, and the table from request type to handler.

Reads (``LEASE_READS``) are answered by the leader after a read-index barrier, without a log
entry, and grant leases; every mutating request is one RPC and one log entry (an
:class:`~kvmesh.store.envelope.Echoed`), proposed under the client's exactly-once session
(``client_id``/``seq``): a retried request returns the first result. The lease rules and the
other leader decisions are :class:`~kvmesh.store.leader.Leader`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

from ..replog import (
    RaftNode,
    ReplogError,
    ResultEvicted,
    SessionExpiredError,
    SessionRejected,
)
from . import errors as E
from . import protocol as P
from .admission import MAX_OWNERS, Busy
from .envelope import Echoed, encode_envelope
from .master import commands as C
from .master.objects import State
from .types import (
    bad_key,
    key_error,
    replica_lists,
)

__all__ = ["HANDLERS", "Handlers", "LEASE_READS", "MAX_SCANS", "wall_clock"]

log = logging.getLogger(__name__)


LEASE_READS = (P.GetReplicasReq, P.GetPartsReq, P.ExistsReq, P.ExistsPartsReq, P.GetSizeReq)
_SCAN_SLICE = 4096  # keys a remove by prefix scans between yields to the event loop
_ROUND_KEY_BYTES = 1 << 20  # key bytes of one remove-by-prefix entry (then another round)
# Remove-by-prefix scans queued or running on a master (one per connection at a time); past
# it a round is answered busy (retryable) at once: each scan costs the whole table.
MAX_SCANS = 16


def wall_clock() -> float:
    """The leader's wall clock for commands (pins' TTLs, drain deadlines, the segment-name
    quarantine): nothing that frees memory a reader or writer may still use depends on it
    (docs/store-master.md, "Clocks")."""
    return time.time()


class Handlers:
    """The handlers (a part of :class:`~kvmesh.store.service.MasterService`)."""

    def _read_now(self, req: Any) -> Any:
        """A read request once the read index is applied here (no log entry)."""
        t = type(req)
        if t is P.GetReplicasReq:
            return self._get_replicas(req)
        if t is P.GetPartsReq:  # parts checked (and counted) by _check before any joining
            return self._get_replicas(req, P.parts_names(req.prefix, req.keys, req.suffixes))
        if t is P.ExistsReq:
            return P.CodesResp(req.rid, self.sm.exists_flags(req.keys))  # keys: _check
        if t is P.ExistsPartsReq:
            if req.leading:
                return P.CountResp(
                    req.rid, self.sm.exists_leading(req.prefix, req.keys, req.suffixes)
                )
            return P.CodesResp(req.rid, self.sm.exists_codes(req.prefix, req.keys, req.suffixes))
        sizes = self.sm.get_size(req.keys)
        return P.SizesResp(req.rid, [min(0, s) for s in sizes], [max(s, 0) for s in sizes])

    async def _dispatch(self, req: Any, peer: str = "") -> Any:
        t = type(req)
        if t is P.StatusReq:
            self.counters[t.__name__] = self.counters.get(t.__name__, 0) + 1
            return P.StatusResp(req.rid, self.status())
        node = self._admit(req, peer)
        handler = HANDLERS.get(t)
        if handler is None:
            raise E.InvalidParams(f"unsupported request {t.__name__}")
        return await handler(self, node, req, peer)

    async def _lease_read(self, node: RaftNode, req: Any) -> Any:
        await node.read_index()
        self._leader()
        return self._read_now(req)

    async def _register(self, node: RaftNode, req: P.RegisterReq, peer: str) -> P.RegisterResp:
        cid = await node.register_session()
        self._owners[cid] = peer
        return P.RegisterResp(req.rid, cid)

    async def _mount(self, node: RaftNode, req: P.MountReq, peer: str) -> P.CodesResp:
        if req.size <= 0:
            raise E.InvalidParams("segment size must be positive")
        # A cheap early refusal; the cap itself is judged in apply (in log order), as
        # mounts in flight together all pass this check.
        if self.sm.usage(None).segments >= self.cfg.max_segments:
            raise E.NoSpace(
                f"the pool holds {self.cfg.max_segments} segments, its limit (max_segments)"
            )
        cmd = C.Mount(
            node_id=req.node_id,
            segment=req.segment,
            endpoint=req.endpoint,
            host_id=req.host_id,
            size=req.size,
            now=wall_clock(),
            max_segments=self.cfg.max_segments,
            medium=req.medium,
            disk_id=req.disk_id,
            offline_ttl=self.cfg.disk_offline_ttl_s,
        )
        code = _code_of(await self._propose(node, req.session, cmd))
        if code == 0:
            self.leader.mounted(req.node_id, time.monotonic())
            self._node_owners[req.node_id] = peer
            self._node_owners.move_to_end(req.node_id)
            while len(self._node_owners) > MAX_OWNERS:
                self._node_owners.popitem(last=False)
        return P.CodesResp(req.rid, [code])

    async def _unmount(self, node: RaftNode, req: P.UnmountReq) -> P.CodesResp:
        if not 0.0 <= req.grace <= 3600.0:
            raise E.InvalidParams("grace must be within 0..3600 s")
        cmd = C.Unmount(node_id=req.node_id, segment=req.segment, now=wall_clock(), grace=req.grace)
        return P.CodesResp(req.rid, [_code_of(await self._propose(node, req.session, cmd))])

    async def _heartbeat_req(self, node: RaftNode, req: P.HeartbeatReq) -> P.CodesResp:
        return self._heartbeat(node, req)

    def _heartbeat(self, node: RaftNode, req: P.HeartbeatReq) -> Any:
        known = self.leader.heartbeat(req.node_id, time.monotonic())
        codes = [0 if known else E.NodeNotFound.code]
        if req.work > 0 and known:
            limit = min(req.work, self.cfg.max_batch_keys)
            tasks = self.leader.tiers.demote_tasks(req.node_id, limit)
            soon = not tasks and self._demote_asked(node)
            promote = self.leader.tiers.promote_tasks(req.node_id, limit)
            return P.DemoteTasksResp(req.rid, codes, tasks, promote, soon)
        return P.CodesResp(req.rid, codes)

    def _demote_asked(self, node: RaftNode) -> bool:
        """A node found no demotion to do: the next batch if one is due (Tiering.demote_asked),
        proposed in the background -- the heartbeat's reply never waits for a proposal --
        one such proposal at a time; the node's next poll finds it. True while one is
        being proposed (the reply's ``soon``: the node asks again shortly)."""
        busy = getattr(self, "_demote_asking", None)
        if busy is not None and not busy.done():
            return True
        chain = self.leader.tiers.demote_asked(time.monotonic(), wall_clock())
        if not chain:
            return False
        self._demote_asking = asyncio.get_running_loop().create_task(
            self._propose_chain(chain), name="store-demote-asked"
        )
        return True

    async def _report_corrupt(self, node: RaftNode, req: P.ReportCorruptReq) -> P.CodesResp:
        if len(req.crcs) != len(req.keys):
            raise E.InvalidParams(f"{len(req.crcs)} crcs for {len(req.keys)} keys")
        cmd = self.leader.tiers.plan_drop_corrupt(req.keys, req.crcs)
        if not cmd.keys:
            return P.CodesResp(req.rid, [E.ObjectNotFound.code] * len(req.keys))
        res = await self._propose(node, req.session, cmd)
        got = dict(zip(cmd.keys, res.codes))
        nf = E.ObjectNotFound.code
        return P.CodesResp(req.rid, [int(got.get(k, nf)) for k in req.keys])

    async def _adopt_list(self, node: RaftNode, req: P.AdoptListReq) -> P.AdoptListResp:
        self._leader()
        got = self.sm.adoptable(req.node_id, req.segment)
        if got is None:
            return P.AdoptListResp(req.rid, [E.SegmentNotFound.code])
        cols = [list(x) for x in zip(*got)] if got else [[], [], [], [], []]
        return P.AdoptListResp(req.rid, [0], *cols)

    async def _adopt(self, node: RaftNode, req: P.AdoptReq) -> P.CodesResp:
        if len(req.versions) != len(req.keys):
            raise E.InvalidParams(f"{len(req.versions)} versions for {len(req.keys)} keys")
        cmd = C.Adopt(req.node_id, req.segment, req.disk_id, req.keys, req.versions)
        return P.CodesResp(req.rid, [_code_of(await self._propose(node, req.session, cmd))])

    async def _demote_end(self, node: RaftNode, req: P.DemoteEndReq) -> Any:
        n = len(req.keys)
        if len(req.crcs) != n or len(req.versions) != n:
            raise E.InvalidParams(
                f"demotion end of {n} keys with {len(req.versions)} versions and "
                f"{len(req.crcs)} crcs"
            )
        ld = self.leader
        revoke = self._demote_failed(req) if req.failed or req.failed_versions else None
        cmd = C.DemoteEnd(req.node_id, req.keys, req.versions, req.crcs)
        res = await self._propose(node, req.session, cmd)
        codes = [int(c) for c in res.codes]
        if 0 in codes:
            ld.tiers.disk_recovered(req.node_id)
            self.counters["demote_ended"] = self.counters.get("demote_ended", 0) + codes.count(0)
        # What the end makes due (Tiering.demote_ended): the memory of these keys, now rather
        # than at the next tick, and the next batch, which the reply then carries -- the node
        # copies it at once instead of at its next poll
        chain = ld.tiers.demote_ended(cmd, res, time.monotonic(), wall_clock())
        if revoke is not None:
            chain.append((revoke, lambda r: None))
        await self._propose_chain(chain)
        if req.work > 0:
            limit = min(req.work, self.cfg.max_batch_keys)
            return P.DemoteTasksResp(req.rid, codes, ld.tiers.demote_tasks(req.node_id, limit))
        return P.CodesResp(req.rid, codes)

    def _demote_failed(self, req: P.DemoteEndReq) -> C.DemoteRevoke | None:
        """The demotions a node reports failed (``req.failed``), checked like ``keys``, as
        the leader plans them (Tiering.demote_failed: its own only; the disk backs off --
        planned before the end's next batch is chosen, which then avoids that disk)."""
        n = len(req.failed)
        if len(req.failed_versions) != n:
            raise E.InvalidParams(f"{n} failed demotions with {len(req.failed_versions)} versions")
        if n + len(req.keys) > self.cfg.max_batch_keys:
            raise E.InvalidParams(
                f"{n + len(req.keys)} keys in one request; the limit is {self.cfg.max_batch_keys}"
            )
        why = bad_key(req.failed)
        if why is not None:
            raise E.InvalidKey(why)
        ld = self.leader
        revoke = ld.tiers.demote_failed(
            req.node_id, req.failed, req.failed_versions, time.monotonic()
        )
        self.counters["demote_failed"] = ld.tiers.demote_failed_total
        return revoke

    async def _promote_end(self, node: RaftNode, req: P.PromoteEndReq) -> P.CodesResp:
        n = len(req.keys)
        if len(req.versions) != n or len(req.segments) != n or len(req.offsets) != n:
            raise E.InvalidParams(f"promotion end of {n} keys with unequal columns")
        asked = C.PromoteEnd(
            req.node_id, req.tag, req.keys, req.versions, req.segments, req.offsets
        )
        cmd = self.leader.tiers.plan_promote_end(asked)
        if not cmd.keys:
            return P.CodesResp(req.rid, [int(E.InvalidWrite.code)] * n)
        res = await self._propose(node, req.session, cmd)
        self.leader.tiers.promote_ended(cmd, res)
        got = dict(zip(cmd.keys, res.codes))
        bad = int(E.InvalidWrite.code)
        return P.CodesResp(req.rid, [int(got.get(k, bad)) for k in req.keys])

    async def _propose_chain(self, chain: list[tuple[Any, Callable[[Any], Any]]]) -> None:
        """Propose leader commands decided together, each result reported to its ``done``
        (None: failed or unknown); a failure is the leader's to retry at a tick, never the
        caller's error."""

        async def one(cmd: Any, done: Callable[[Any], Any]) -> None:
            out = None
            try:
                out = await self._propose_plain(cmd)
            except (TimeoutError, ReplogError) as e:
                log.debug("store master: %s not applied: %s", type(cmd).__name__, e)
            except Exception:  # noqa: BLE001 - a bug costs this proposal, not the request
                log.exception("store master: %s failed", type(cmd).__name__)
            finally:
                done(out)

        if chain:
            await asyncio.gather(*(one(c, d) for c, d in chain))

    async def _propose(self, node: RaftNode, sess: P.Session, cmd: Any) -> Any:
        return (await self._propose_echo(node, sess, Echoed(C.encode_command(cmd)))).result

    async def _propose_echo(self, node: RaftNode, sess: P.Session, env: Echoed) -> Any:
        res = await node.propose(encode_envelope(env), sess.client_id, sess.seq, sess.ack)
        if isinstance(res, SessionRejected):
            # result_evicted: the seq may have been applied once (never retried blindly)
            err = ResultEvicted if res.reason == "result_evicted" else SessionExpiredError
            raise err(f"session {res.client_id} seq {res.seq}: {res.reason}")
        return res

    def _planned(self, sess: P.Session, make: Any) -> tuple[list[int], float]:
        """The per-key answers (and hold release time) planned for this request: computed by
        ``make()`` the first time, reused for a retry of the same ``(client, seq)``."""
        k = (sess.client_id, sess.seq)
        kept = self._plans.get(k)
        if kept is not None:
            codes, release_at = kept
            return ([0] * codes if isinstance(codes, int) else codes.tolist()), release_at
        plan = make()
        codes = plan[0]
        # Kept compact: a count when nothing was refused (the common case), else an int32
        # array. Thousands of kept plans as lists of thousands of ints would be millions of
        # references for the cyclic GC to walk on every pass (the 10 M-load young-GC hold in
        # docs/store-master.md); a count or an array is not a GC container at all.
        self._plans[k] = (len(codes) if not any(codes) else array("i", codes), plan[1])
        while len(self._plans) > 4096:
            self._plans.popitem(last=False)
        return plan

    @staticmethod
    def _merge(planned: list[int], applied: list[int]) -> list[int]:
        """Per key: the planned refusal, or the applied entry's code (in order)."""
        if len(planned) == len(applied) and not any(planned):
            return list(applied)  # nothing refused before the log
        it = iter(applied)
        out = [c if c else next(it, int(E.InternalError.code)) for c in planned]
        return out

    def _get_replicas(
        self, req: P.GetReplicasReq | P.GetPartsReq, keys: list[str] | None = None
    ) -> P.ReplicasResp | P.ReplicaTableResp:
        """``keys``: the names asked (a GetPartsReq's joined parts); default ``req.keys``."""
        mono = time.monotonic()  # before the lookup: the lease is never longer than promised
        ttl = self.cfg.lease_ttl_s
        keys = req.keys if keys is None else keys
        t = self.sm.lookup_table(keys, req.host or None, self.cfg.max_reply_bytes)
        codes = t.codes
        every = codes.count(0) == len(codes)  # all found (the usual batch): no index lists
        ok: Any = range(len(keys)) if every else [i for i, c in enumerate(codes) if c == 0]
        until = self.leader.lease(keys if every else [keys[i] for i in ok], mono)
        if 0.0 in until:
            # A removal of these keys is in flight: no lease on memory about to be freed,
            # and no descriptor of it in the reply.
            codes = list(codes)
            for i, u in zip(ok, until):
                if u == 0.0:
                    codes[i] = E.ObjectNotFound.code
            granted = [keys[i] for i in ok if codes[i] == 0]
            keep = t.rows[np.asarray(codes, np.int64)[t.rows[:, 0]] == 0]
            t = t._replace(codes=codes, rows=keep)
        else:
            granted = keys if every else [keys[i] for i in ok]
        self.leader.touch(granted)
        self.hits += len(granted)
        self.misses += len(keys) - len(granted)
        sizes = t.sizes  # 0 for every key not found (lookup_table), blocked ones aside
        if len(granted) < len(ok):
            sizes = [z if c == 0 else 0 for c, z in zip(codes, sizes)]
        if req.table:
            rows = t.rows.astype("<i8", copy=False).tobytes()
            return P.ReplicaTableResp(
                req.rid, codes, sizes, t.segments, rows, int(ttl * 1000), t.crcs
            )
        return P.ReplicasResp(req.rid, codes, sizes, replica_lists(t), int(ttl * 1000))

    async def _put_start(self, node: RaftNode, req: P.PutStartReq) -> P.PutStartResp:
        keys = req.keys
        n = len(keys)
        now = wall_clock()
        if req.upsert:
            # The core's rule: an existing, leased key answers ObjectHasLease (an upsert would
            # rewrite or free memory a reader is copying).
            full = C.Upsert(keys=keys, sizes=req.sizes, config=req.config, now=now)

            def make() -> tuple[list[int], float]:
                exists = [self.sm.state_of(k) != State.GONE for k in keys]
                return self.leader.plan_upsert(exists, full, time.monotonic()).codes, 0.0

            planned, _ = self._planned(req.session, make)
        else:
            planned = [0] * n
        if any(planned):
            todo = [i for i in range(n) if not planned[i]]
            tk = [keys[i] for i in todo]
            ts = [req.sizes[i] for i in todo]
        else:
            tk, ts = keys, req.sizes
        # Make room first when the pool is short: a put reports NoSpace only when nothing is
        # evictable (the put itself stays one entry under the client's session). Only for
        # copies that could fit once room is made: a key larger than the whole pool, or more
        # copies than there are storage nodes, would evict everything and still not fit.
        copies = req.config.replica_num
        usage = self.sm.usage()
        if ts and max(ts) * copies <= usage.capacity:
            need = sum(ts) * copies
        else:
            need = sum(z * copies for z in ts if z * copies <= usage.capacity)
        free = usage.capacity - usage.used
        if need > free and copies <= len(self.sm.nodes()):
            await self._evict(time.monotonic(), need=min(need, usage.capacity) - free)
        if self.cfg.max_objects and not req.upsert:
            tk, ts, planned = await self._object_cap(req, tk, ts, planned)
        cls = C.Upsert if req.upsert else C.PutStart
        cmd = cls(keys=tk, sizes=ts, config=req.config, now=now)
        if req.upsert:
            self.leader.block(tk)
        pending = len(tk) if self.cfg.max_objects else 0  # counted by the object cap
        self._objects_pending += pending
        try:
            res = await self._propose_echo(
                node, req.session, Echoed(C.encode_command(cmd), planned)
            )
        finally:
            self._objects_pending -= pending
            if req.upsert:
                self.leader.unblock(tk)
        planned, r = res.codes or [0] * n, res.result
        if len(planned) != n:
            raise E.InvalidParams("a retried put named different keys than the first attempt")
        run = None
        if not any(planned) and len(r.codes) == n:  # nothing decided before the log
            codes, versions = list(r.codes), r.versions
            if type(r) is C.PutStartRun:
                replicas, run = [], r.run  # sent as it is cached: compact
            else:
                replicas = r.replicas
        else:
            codes = list(planned)
            replicas = [None] * n
            versions = [0] * n
            j = 0
            rr, rv = r.replicas, r.versions  # (properties of a PutStartRun: built once)
            for i in range(n):
                if planned[i]:
                    continue
                codes[i], replicas[i], versions[i] = r.codes[j], rr[j], rv[j]
                j += 1
        if 0 in codes:  # every key placed has the entry's index as version
            self.leader.bind_writer(
                versions[codes.index(0)], req.session.client_id, time.monotonic()
            )
        return P.PutStartResp(
            req.rid, codes, replicas, versions, int(self.cfg.put_timeout_s * 1000), run
        )

    async def _put_commit(self, node: RaftNode, req: P.PutCommitReq) -> P.PutCommitResp:
        """The one-round-trip put into the caller's reservation (docs/store-master.md,
        "Reservations"): one entry publishes the keys and refills the reservation. The tag
        must be a live reservation this leader granted to this session (else every key
        answers InvalidWrite and the entry only reserves, under a new tag); apply checks
        every extent against its own state."""
        keys = req.keys
        n = len(keys)
        me = req.session.client_id
        tag = req.tag

        # (a retry gets the first attempt's answer from the log entry's echo, whatever
        # this check says now: no plan to remember)
        if not tag or self.leader.owns_reservation(tag, me):
            planned = [0] * n
        else:
            planned = [int(E.InvalidWrite.code)] * n
            tag = 0  # never release or grow another session's tag
        reserve = req.reserve
        if reserve > 0:
            usage = self.sm.usage()
            free = usage.capacity - usage.used
            if free < reserve <= usage.capacity:
                # (room for puts not yet made: no object loses its only copy for it while
                # demotion can give it a disk copy -- Leader.evictions)
                await self._evict(time.monotonic(), need=reserve - free, reserve=True)
        if self.cfg.max_objects and not any(planned):
            _, _, planned = await self._object_cap(req, keys, req.sizes, planned)
        if any(planned):
            keep = [i for i, c in enumerate(planned) if not c]
            tk = [keys[i] for i in keep]
            ts = [req.sizes[i] for i in keep]
            to = [req.offsets[i] for i in keep]
        else:
            tk, ts, to = keys, req.sizes, req.offsets
        cmd = C.PutCommit(
            tk, ts, tag, req.sid, to, req.config, wall_clock(), reserve, req.release and bool(tag)
        )
        pending = len(tk) if self.cfg.max_objects else 0
        self._objects_pending += pending
        body = C.encode_command(cmd)
        self._machine.expect(body, cmd)  # its apply here takes cmd, not body decoded again
        try:
            res = await self._propose_echo(node, req.session, Echoed(body, planned))
        finally:
            self._objects_pending -= pending
        r = res.result
        out = self._merge(res.codes or [0] * n, r.codes)
        if len(out) != n:
            raise E.InvalidParams("a retried put_commit named different keys than the first")
        hold = 0.0
        if r.tag:
            hold = self.leader.bind_reservation(r.tag, me, time.monotonic())
        if req.tag and req.tag != r.tag and self.leader.owns_reservation(req.tag, me):
            self.leader.drop_reservation(req.tag)
        if n:
            done = keys if not any(out) else [k for k, c in zip(keys, out) if c == 0]
            asyncio.get_running_loop().call_soon(self.leader.touch, done)
        mc = self.sm.config
        return P.PutCommitResp(
            req.rid, out, r.tag, r.added, r.seg, int(hold * 1000), mc.slice_limit, mc.align
        )

    async def _object_cap(
        self, req: P.PutStartReq, tk: list[str], ts: list[int], planned: list[int]
    ) -> tuple[list[str], list[int], list[int]]:
        """The object-count cap (``max_objects``): new keys beyond it answer NoSpace per
        key (decided once per request, so a retry gets the same answer), after an eviction
        of as many objects as the put lacks. Judged on this leader before proposing, the
        keys of its puts still in the log counted too; upserts replace, never add."""
        cap = self.cfg.max_objects
        room = cap - self.sm.object_count() - self._objects_pending
        if len(tk) <= room:
            return tk, ts, planned
        new = [i for i, k in enumerate(tk) if self.sm.state_of(k) == State.GONE]
        if len(new) > room:
            await self._evict(time.monotonic(), objects=len(new) - max(room, 0))
            room = cap - self.sm.object_count() - self._objects_pending
        if len(new) <= room:
            return tk, ts, planned

        def make() -> tuple[list[int], float]:
            over = set(new[max(room, 0) :])  # positions in tk: the keys not refused yet
            codes, j = list(planned), 0
            for i, c in enumerate(planned):
                if not c:
                    if j in over:
                        codes[i] = int(E.NoSpace.code)
                    j += 1
            return codes, 0.0

        planned, _ = self._planned(req.session, make)
        keep = [i for i, c in enumerate(planned) if not c]
        keys, sizes = req.keys, req.sizes
        return [keys[i] for i in keep], [sizes[i] for i in keep], planned

    async def _finish_put(self, node: RaftNode, req: Any, end: bool) -> P.CodesResp:
        """PutEnd / PutRevoke. A put's version is its log index (easy to guess), so the
        leader also remembers which session started each put it answered and refuses
        (InvalidWrite) another session's PutEnd/PutRevoke of it: otherwise any peer could
        publish a writer's half-written bytes or free them under it. Puts started under an
        earlier leader are judged by version only."""
        keys, vers = req.keys, req.versions
        me = req.session.client_id

        def make() -> tuple[list[int], float]:
            n = len(keys)
            if len(vers) != n:  # apply answers InvalidParams per key
                return [0] * n, 0.0
            # per distinct version (a batch names one or a few), not per key
            foreign = self.leader.foreign_versions(vers, me)
            if not foreign:
                return [0] * n, 0.0
            bad = int(E.InvalidWrite.code)
            return [bad if v in foreign else 0 for v in vers], 0.0

        planned, _ = self._planned(req.session, make)
        if any(planned):
            todo = [i for i, c in enumerate(planned) if not c]
            tk = [keys[i] for i in todo]
            tv = [vers[i] for i in todo] if len(vers) == len(keys) else list(vers)
        else:
            tk, tv = keys, vers
        cmd = C.PutEnd(keys=tk, versions=tv) if end else C.PutRevoke(keys=tk, versions=tv)
        res = await self._propose_echo(node, req.session, Echoed(C.encode_command(cmd), planned))
        out = self._merge(res.codes or [0] * len(keys), res.result.codes)
        if len(out) != len(keys):
            raise E.InvalidParams("a retried put_end named different keys than the first attempt")
        if end:
            # The LRU touch is a recency hint, not part of the answer: it runs right after
            # the reply is handed to the socket (this turn of the loop), not before it.
            done = keys if not any(out) else [k for k, c in zip(keys, out) if c == 0]
            asyncio.get_running_loop().call_soon(self.leader.touch, done)
        return P.CodesResp(req.rid, out)

    async def _remove(self, node: RaftNode, req: P.RemoveReq) -> P.CodesResp:
        """The core's rule (``plan_remove``): leased keys answer ObjectHasLease, or with
        ``force`` are removed with their bytes held until the leases are over."""
        keys = req.keys
        plan = None

        def make() -> tuple[list[int], float]:
            nonlocal plan
            plan = self.leader.plan_remove(keys, time.monotonic(), req.force)
            return plan.codes, plan.release_at

        planned, release_at = self._planned(req.session, make)
        todo = [k for k, c in zip(keys, planned) if not c]
        if plan is None:  # a retry: rebuild the command from the first attempt's decisions
            plan_cmd = C.Remove(todo, force=req.force, hold=release_at > 0.0)
        else:
            plan_cmd = plan.command or C.Remove([], force=req.force)
        self.leader.block(todo)
        try:
            env = Echoed(C.encode_command(plan_cmd), planned, release_at, self.server_id)
            res = await self._propose_echo(node, req.session, env)
        finally:
            self.leader.unblock(todo)
        out = self._merge(res.codes or [0] * len(keys), list(res.result.codes))
        if len(out) != len(keys):
            raise E.InvalidParams("a retried remove named different keys than the first attempt")
        self.leader.forget(k for k, c in zip(keys, out) if c == 0)
        return P.CodesResp(req.rid, out)

    async def _remove_all(self, node: RaftNode, req: P.RemoveAllReq) -> P.CountResp:
        ld = self.leader
        ld.removing_all += 1  # no new leases anywhere while it is in flight
        try:
            plan = ld.plan_remove_all(time.monotonic(), req.force)
            if plan is None:
                raise Busy("a new leader is still applying the earlier terms' entries")
            cmd, release_at = plan
            env = Echoed(C.encode_command(cmd), [], release_at, self.server_id)
            res = (await self._propose_echo(node, req.session, env)).result
        finally:
            ld.removing_all -= 1
        return P.CountResp(req.rid, int(res.removed))

    async def _remove_prefix(self, node: RaftNode, req: P.RemovePrefixReq) -> P.RemovePrefixResp:
        """One round of a remove by prefix: a scan of the table in slices of
        ``_SCAN_SLICE`` keys (yielding between them: a huge table never holds the loop
        long) for at most ``prefix_round_keys`` removable keys, then one entry with the rules
        of :meth:`_remove` (``plan_remove_prefix``). Bounded per request, the client loops
        while ``more``. A retry of the same session seq gets the first round's result from
        the log (the replog session cache), whatever this scan finds."""
        why = key_error(req.prefix)
        if why is not None:
            raise E.InvalidKey(f"prefix: {why}")
        limit = self.cfg.prefix_round_keys
        found: list[str] = []
        skipped = 0
        more = False
        async with self._scan_turn():
            table = self.sm.key_list()
            for lo in range(0, len(table), _SCAN_SLICE):
                if lo:
                    await asyncio.sleep(0)
                mono = time.monotonic()
                leased = self.leader.prefix_leased(mono, req.force)
                f, n, more = self.sm.prefix_candidates(
                    req.prefix, table[lo : lo + _SCAN_SLICE], limit - len(found), leased
                )
                found += f
                skipped += n
                if more:
                    break
                if sum(map(len, found)) > _ROUND_KEY_BYTES:  # long keys: keep the entry small
                    more = True
                    break
            del table
        cmd, release_at = self.leader.plan_remove_prefix(
            req.prefix, found, skipped, more, time.monotonic(), req.force
        )
        self.leader.block(cmd.keys)
        try:
            env = Echoed(C.encode_command(cmd), [], release_at, self.server_id)
            res = (await self._propose_echo(node, req.session, env)).result
        finally:
            self.leader.unblock(cmd.keys)
        if type(res) is not C.RemovePrefixResult:
            raise E.InvalidParams("a retried remove_prefix was another request the first time")
        self.leader.forget(k for k in cmd.keys if self.sm.state_of(k) == State.GONE)
        return P.RemovePrefixResp(req.rid, int(res.removed), int(res.skipped), bool(res.more))

    @contextlib.asynccontextmanager
    async def _scan_turn(self) -> AsyncIterator[None]:
        """The scan lock, for at most MAX_SCANS requests queued or scanning at once."""
        if self._scans >= MAX_SCANS:
            raise Busy(f"busy: {self._scans} remove-by-prefix scans queued; retry")
        self._scans += 1
        try:
            async with self._scan_lock:
                yield
        finally:
            self._scans -= 1

    # ------------------------------------------------------------------------- status


def _code_of(res: Any) -> int:
    codes = getattr(res, "codes", None)
    if codes is not None:
        return int(codes[0]) if codes else 0
    return int(getattr(res, "code", 0))


# request type -> handler(service, node, request, authenticated peer): every request but
# StatusReq (answered before admission) passes Admission._admit first
HANDLERS: dict[type, Callable[[Any, RaftNode, Any, str], Awaitable[Any]]] = {
    **dict.fromkeys(LEASE_READS, lambda s, n, r, p: s._lease_read(n, r)),
    P.HeartbeatReq: lambda s, n, r, p: s._heartbeat_req(n, r),
    P.RegisterReq: lambda s, n, r, p: s._register(n, r, p),
    P.PutStartReq: lambda s, n, r, p: s._put_start(n, r),
    P.PutEndReq: lambda s, n, r, p: s._finish_put(n, r, True),
    P.PutCommitReq: lambda s, n, r, p: s._put_commit(n, r),
    P.PutRevokeReq: lambda s, n, r, p: s._finish_put(n, r, False),
    P.RemoveReq: lambda s, n, r, p: s._remove(n, r),
    P.RemoveAllReq: lambda s, n, r, p: s._remove_all(n, r),
    P.RemovePrefixReq: lambda s, n, r, p: s._remove_prefix(n, r),
    P.MountReq: lambda s, n, r, p: s._mount(n, r, p),
    P.UnmountReq: lambda s, n, r, p: s._unmount(n, r),
    P.DemoteEndReq: lambda s, n, r, p: s._demote_end(n, r),
    P.PromoteEndReq: lambda s, n, r, p: s._promote_end(n, r),
    P.ReportCorruptReq: lambda s, n, r, p: s._report_corrupt(n, r),
    P.AdoptListReq: lambda s, n, r, p: s._adopt_list(n, r),
    P.AdoptReq: lambda s, n, r, p: s._adopt(n, r),
}
