"""The simulated clients: two-phase puts and upserts, reads under leases (a copy that
takes time, then a byte check), exists, removes and removes by prefix, each recorded in the
history; they ask the production leader (:class:`~kvmesh.store.leader.Leader`) as the
service's handlers do."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from ....replog import (
    NotLeader,
)
from ...errors import Code
from ...types import ReplicateConfig
from ..commands import (
    PutEnd,
    PutRevoke,
    PutStart,
    Upsert,
)
from .config import SimViolation
from .model import StoreOp

__all__ = ["Clients", "Read", "tag_of"]


def tag_of(key: str, version: int, i: int) -> int:
    return zlib.crc32(b"%s\0%d\0%d" % (key.encode(), version, i))


class Read:
    """A read in progress: the copy runs under a lease until ``finish``."""

    __slots__ = ("key", "version", "slices", "until", "op", "incs", "seen")

    def __init__(
        self, key: str, version: int, slices: list[tuple[str, int, int]], until: float, op: int
    ) -> None:
        self.key = key
        self.version = version
        self.slices = slices  # (segment, offset, slice number)
        self.until = until
        self.op = op
        # the leader's applied index at the lookup: a copy added at the same version (a
        # promotion's memory copy) is the object's only from there on
        self.seen = 0


# ======================================================================================


class Clients:
    """The client operations (a part of :class:`~.cluster.StoreSim`)."""

    def _client(self, cid: int) -> None:
        r = self.rng.random()
        key = self.rng.choice(self.keys)
        if r < 0.35:
            self._put(cid, key, upsert=self.rng.random() < 0.15)
        elif r < 0.7:
            self._get(cid, key)
        elif r < 0.8:
            self._exists(cid, key)
        elif r < 0.85:
            prefix = "k" if self.rng.random() < 0.3 else key
            self._remove_prefix(cid, prefix, force=self.rng.random() < 0.3)
        else:
            self._remove(cid, key, force=self.rng.random() < 0.3)

    def _next(self, cid: int) -> None:
        self.at(self.now + self.rng.uniform(0.01, 0.2), lambda: self._client(cid))

    def _put(self, cid: int, key: str, upsert: bool) -> None:
        self.seq += 1
        token = f"c{cid}.{self.seq}"
        h = self.history.invoke(cid, StoreOp("hide", key) if upsert else StoreOp("put", key, token))
        size = self.rng.choice((64, 200, 300, 600, 900))
        pin = self.rng.random()
        rcfg = ReplicateConfig(
            replica_num=self.rng.choice((1, 1, 2)),
            strategy=self.rng.choice(("local", "random", "most_free")),
            writer_host="hn0",
            soft_pin=pin < 0.1,
            hard_pin=0.1 <= pin < 0.13,
        )
        started = self.now
        if not self.lead:
            self.history.fail(h)
            return self._next(cid)
        if upsert:
            sm = self.sms[self.lead]
            up = Upsert([key], [size], rcfg, self.wall(), 2.0)
            plan = self.ldr.plan_upsert([sm.state_of(key) != 0], up, self.now)
            if plan.command is None:
                self.history.ok(h, "leased")
                return self._next(cid)
            self._count_exempt([key])
            cmd: Any = plan.command
            blocked = self.ldr
            blocked.block([key])  # no new lease while a rewrite of the key is in flight
        else:
            cmd = PutStart([key], [size], rcfg, self.wall(), 2.0)
            blocked = None
        self.term_keys.add(key)

        def started_cb(r: Any) -> None:
            if blocked is not None:
                blocked.unblock([key])
            if r is None:
                self.history.info(h)
                return self._next(cid)
            code = r.codes[0]
            if code == Code.OBJECT_ALREADY_EXISTS:
                self.history.ok(h, "exists")
            elif code == Code.REPLICA_IS_NOT_READY:
                self.history.ok(h, "busy")
            elif code != 0:
                self.history.fail(h)
                if code == Code.NO_AVAILABLE_HANDLE:
                    self._maybe_evict(size * 2)
            else:
                version = r.versions[0]
                slices = [
                    (d.segment, d.offset, j)
                    for copy in r.replicas[0]
                    for j, d in enumerate(copy.slices)
                ]
                incs = {s: self.seg_incarn.get(s, -1) for s, _, _ in slices}
                if upsert:
                    # Upsert first hides the old value (the key is PROCESSING until PutEnd),
                    # then publishes the new one: two operations in the history.
                    self.history.ok(h, "ok")
                    h2 = self.history.invoke(cid, StoreOp("put", key, token))
                else:
                    h2 = h
                # most writes are quick; some are slow (a big object, a busy link) and end
                # close to the writer's own deadline (0.8 of the put timeout)
                slow = self.rng.random() < 0.2
                took = self.rng.uniform(0.3, 0.75) if slow else self.rng.uniform(0.01, 0.3)
                self.at(
                    self.now + took * (self.cfg.put_timeout if slow else 1.0),
                    lambda: self._write_done(cid, h2, key, version, slices, started, incs, token),
                )
                return
            self._next(cid)

        if not self.propose(cmd, started_cb):
            if blocked is not None:
                blocked.unblock([key])
            self.history.fail(h)
            self._next(cid)

    def _write_done(
        self,
        cid: int,
        h: int,
        key: str,
        version: int,
        slices: list,
        started: float,
        incs: dict[str, int],
        token: str,
    ) -> None:
        if self.now > started + self.cfg.put_timeout * 0.8 or not all(
            self._serving(s[4:]) and self.seg_incarn[s] == inc for s, inc in incs.items()
        ):
            # Too late (it may be reclaimed) or a target node died: never publish. Revoke.
            self.propose(PutRevoke([key], [version]), lambda r: None)
            self.history.fail(h)
            return self._next(cid)
        self._check_owned(key, version, [(s, o) for s, o, _ in slices], "write")
        for s, o, j in slices:
            self.mem[(s, o)] = tag_of(key, version, j)
        self.tokens[(key, version)] = token

        def ended(r: Any) -> None:
            if r is None:
                self.history.info(h)
            elif r.codes[0] == 0:
                self.history.ok(h, "ok")
                self.ldr.touch([key])
            else:
                self.history.fail(h)
            self._next(cid)

        if not self.propose(PutEnd([key], [version]), ended):
            self.history.info(h)  # never proposed: not visible, but its PROCESSING may be reclaimed
            self._next(cid)

    def _read_index(self, cb: Callable[[int], None]) -> bool:
        i = self.lead
        if not i:
            return False
        self.seq += 1
        ctx = b"r%d" % self.seq
        term = self.lead_term

        def served(index: int) -> None:
            if self.lead != i or self.lead_term != term:
                return  # leadership changed: the read is dropped (the client times out)
            if self.sms[i].applied >= index:
                cb(index)
            else:
                self.at(self.now + self.cfg.step, lambda: served(index))

        self.read_ctx[ctx] = served
        try:
            self.net.nodes[i].core.read_index(ctx)
        except NotLeader:
            self.read_ctx.pop(ctx, None)
            return False
        return True

    def _get(self, cid: int, key: str) -> None:
        h = self.history.invoke(cid, StoreOp("get", key))
        state = {"done": False}

        def timeout() -> None:
            if not state["done"]:
                state["done"] = True
                self.history.fail(h)
                self._next(cid)

        def serve(_index: int) -> None:
            if state["done"]:
                return
            state["done"] = True
            sm = self.sms[self.lead]
            if self.ldr.blocked(key):
                self.history.fail(h)
                return self._next(cid)
            lk = sm.lookup([key])[0]
            if lk.code:
                self.history.ok(h, None)
                return self._next(cid)
            if not lk.replicas:
                # an acknowledged put stays readable from some tier until it is removed or
                # dropped from the last one (the disk tier)
                raise SimViolation(f"read of {key!r} v{lk.version}: found with no copy to read")
            until = self.ldr.lease([key], self.now)[0]
            self.ldr.touch([key])
            copy = lk.replicas[self.rng.randrange(len(lk.replicas))]
            self.res.disk_reads += copy.slices[0].segment.startswith("dsk-")
            slices = [(d.segment, d.offset, j) for j, d in enumerate(copy.slices)]
            rd = Read(key, lk.version, slices, until, h)
            rd.incs = {d.segment: self.seg_incarn.get(d.segment, -1) for d in copy.slices}
            rd.seen = sm.applied
            self.reads.append(rd)
            token = self.tokens.get((key, lk.version))
            self.at(
                self.now + self.rng.uniform(0.0, self.cfg.lease_ttl * 1.3),
                lambda: self._read_done(cid, rd, token),
            )

        if not self._read_index(serve):
            self.history.fail(h)
            return self._next(cid)
        self.at(self.now + 1.0, timeout)

    def _read_done(self, cid: int, rd: Read, token: Any) -> None:
        self.reads.remove(rd)
        if self.now > rd.until:
            self.res.lease_expired_reads += 1
            self.history.fail(rd.op)  # LeaseExpired: the bytes are discarded
            return self._next(cid)
        for seg, inc in rd.incs.items():
            if not self._serving(seg[4:]) or self.seg_incarn.get(seg) != inc:
                # ReplicaGone: the process that published this segment died (a restarted
                # node publishes its new segment only after the old one expired and the
                # quarantine passed, long after any lease on the old one).
                self.history.fail(rd.op)
                return self._next(cid)
        for seg, off, j in rd.slices:
            got = self.mem.get((seg, off))
            if got != tag_of(rd.key, rd.version, j):
                raise SimViolation(
                    f"read of {rd.key!r} v{rd.version} under a lease (until {rd.until:.3f}, "
                    f"now {self.now:.3f}) got foreign bytes at {seg}@{off}"
                )
        self.res.reads_checked += 1
        self.history.ok(rd.op, token)
        self._next(cid)

    def _exists(self, cid: int, key: str) -> None:
        h = self.history.invoke(cid, StoreOp("exists", key))
        state = {"done": False}

        def serve(_index: int) -> None:
            if state["done"]:
                return
            state["done"] = True
            self.history.ok(h, self.sms[self.lead].exists([key])[0])
            self._next(cid)

        def timeout() -> None:
            if not state["done"]:
                state["done"] = True
                self.history.fail(h)
                self._next(cid)

        if not self._read_index(serve):
            self.history.fail(h)
            return self._next(cid)
        self.at(self.now + 1.0, timeout)

    def _remove(self, cid: int, key: str, force: bool) -> None:
        h = self.history.invoke(cid, StoreOp("remove", key))
        if not self.lead:
            self.history.fail(h)
            return self._next(cid)
        ld = self.ldr
        plan = ld.plan_remove([key], self.now, force=force)
        if plan.command is None:
            self.history.ok(h, "leased")
            return self._next(cid)
        self._count_exempt([key], not plan.release_at)
        ld.block([key])
        release_at = plan.release_at

        def done(r: Any) -> None:
            ld.unblock([key])
            if r is None:
                self.history.info(h)
            else:
                c = r.codes[0]
                self.history.ok(h, {0: "ok", int(Code.OBJECT_NOT_FOUND): "notfound"}.get(c, "busy"))
                if c == 0:
                    ld.forget([key])
            self._next(cid)

        cmd = plan.command
        if cmd.hold:
            self.holds_pending = release_at
        idx = self.propose(cmd, done)
        if not idx:
            ld.unblock([key])
            self.history.fail(h)
            return self._next(cid)
        if cmd.hold:
            ld.note_hold(idx, release_at)

    def _remove_prefix(self, cid: int, prefix: str, force: bool) -> None:
        """One round of a remove by prefix, as the service does it: scan the leader's table
        (leased keys skipped unless ``force``), plan with the lease rules, block, propose.
        Every key the entry names joins the history as a ``prune``."""
        if not self.lead:
            return self._next(cid)
        sm = self.sms[self.lead]
        ld = self.ldr
        leased = ld.prefix_leased(self.now, force)
        found, skipped, more = sm.prefix_candidates(prefix, sm.keys(), 4, leased)
        cmd, release_at = ld.plan_remove_prefix(prefix, found, skipped, more, self.now, force)
        t0 = self.now
        hs = [self.history.invoke(cid, StoreOp("prune", k), t=t0) for k in cmd.keys]
        ld.block(cmd.keys)

        def done(r: Any) -> None:
            ld.unblock(cmd.keys)
            for h in hs:
                if r is None:
                    self.history.info(h)
                else:
                    self.history.ok(h, None)
            if r is not None:
                self.res.prefix_removes += 1
                ld.forget(cmd.keys)
            self._next(cid)

        idx = self.propose(cmd, done)
        if not idx:
            ld.unblock(cmd.keys)
            for h in hs:
                self.history.fail(h)
            return self._next(cid)
        if cmd.hold:
            ld.note_hold(idx, release_at)

    # -------------------------------------------------------------------- checks
