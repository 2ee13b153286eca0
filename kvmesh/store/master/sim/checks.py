"""The store simulator's checks: state invariants on every replica, read leases in force,
replica digests, the liveness judge's two promises, and the final audit."""

from __future__ import annotations

from ..invariants import check as check_state
from ..invariants import extents
from ..objects import TIER_DEMOTING
from ..state import StoreStateMachine
from .clients import tag_of
from .config import SimViolation
from .model import StoreOp

__all__ = ["Checks"]


class Checks:
    """The checks (a part of :class:`~.cluster.StoreSim`)."""

    def _check_liveness(self, sm: StoreStateMachine, expiring: list[str]) -> None:
        """The liveness judge's two promises: never expire a node that heartbeats (every
        serving node does, whenever there is a leader), and expire a dead one within TTL +
        one stage per earlier bounded round (two nodes at most die together here) + slack
        for ticks and the commit, counted from its death or the last time the leader's
        view was reset or it could not commit, whichever is later."""
        for n in expiring:
            if self._serving(n):
                raise SimViolation(f"the leader expires storage node {n}, which heartbeats")
        bound = self.cfg.node_ttl + 2 * self.cfg.node_stage + 1.0
        for n, t in self.dead_since.items():
            seg = f"seg-{n}"
            sid = sm.by_name.get(seg)
            if sid is None:
                continue
            # A Mount the node proposed before it died can commit after its death (or after
            # its expiry): the judge then first hears of it, so its TTL runs from there.
            seen = self._mount_seen.get(seg)
            if seen is None or seen[0] != sid:
                seen = self._mount_seen[seg] = (sid, self.now)
            if self.now - max(t, self.calm_since, seen[1]) > bound:
                raise SimViolation(
                    f"storage node {n} died at {t:.2f} and is still mounted at {self.now:.2f}"
                )

    def _check_owned(
        self, key: str, version: int, where: list[tuple[str, int]], what: str, since: int = 0
    ) -> None:
        """Every ``(segment, offset)`` is allocated to ``key`` at ``version`` (or held) on
        every replica that has applied at least the version's entry (and ``since``: the
        entry the copy was found at)."""
        for i in self.ids:
            sm = self.sms[i]
            if sm.applied < max(version, since):
                continue
            names = {s.name: sid for sid, s in sm.segs.items()}
            ext = None
            for seg, off in where:
                sid = names.get(seg)
                if sid is None:
                    continue  # segment dropped: its node is gone, reads fail there
                if ext is None:
                    ext = extents(sm)
                owners = [o for a, b, o in ext.get(sid, []) if a <= off < b]
                ok = bool(owners) and all(
                    o.startswith("held:") or (o == key and sm.version_of(key) == version)
                    for o in owners
                )
                if not ok:
                    raise SimViolation(
                        f"{what}: {seg}@{off} of {key!r} v{version} is now {owners or 'free'}"
                        f" on replica {i} (index {sm.applied})"
                    )

    def _check(self) -> None:
        for i in self.ids:
            errs = check_state(self.sms[i])
            if errs:
                raise SimViolation(
                    f"replica {i} at index {self.sms[i].applied}: " + "; ".join(errs[:3])
                )
        if self.cfg.disk_size and self.lead:
            self._check_disk(self.sms[self.lead])
        for key, version, where in self.demote_srcs:
            self._check_demote_src(key, version, where)
        for rd in self.reads:
            if self.now <= rd.until:
                self._check_owned(
                    rd.key, rd.version, [(s, o) for s, o, _ in rd.slices], "lease", rd.seen
                )
        if self.steps % 25 == 0:
            by_index: dict[int, tuple[int, int]] = {}
            for i in self.ids:
                sm = self.sms[i]
                d = sm.digest()
                prev = by_index.setdefault(sm.applied, (i, d))
                if prev[1] != d:
                    raise SimViolation(f"replicas {prev[0]} and {i} differ at index {sm.applied}")

    def _check_demote_src(self, key: str, version: int, where: list[tuple[str, int]]) -> None:
        """While a node copies an object to disk (its disk copy PROCESSING at that version
        on a replica), the memory copy it reads is still the object's there: memory is
        freed only after the disk copy is COMPLETE. (Removed, evicted or re-put objects
        end their demotion: nobody trusts those bytes.)"""
        for i in self.ids:
            sm = self.sms[i]
            if sm.version_of(key) != version or sm.tier_of(key) != TIER_DEMOTING:
                continue
            names = {s.name: sid for sid, s in sm.segs.items()}
            ext = extents(sm)
            for seg, off in where:
                sid = names.get(seg)
                if sid is None:
                    continue
                owners = [o for a, b, o in ext.get(sid, []) if a <= off < b]
                if owners != [key]:
                    raise SimViolation(
                        f"demotion source {seg}@{off} of {key!r} v{version} is now "
                        f"{owners or 'free'} on replica {i} (index {sm.applied}) while its "
                        "disk copy is PROCESSING"
                    )

    def _check_disk(self, sm: StoreStateMachine) -> None:
        """The disk tier: every COMPLETE disk copy on a serving node holds exactly its
        object's bytes (its node wrote them before DemoteEnd, from a memory copy that was
        still the object's)."""
        for key in sm.demoted_keys():
            o = sm.objects[key]
            for j, (seg, off) in enumerate(sm.disk_copy(key)):
                if not self._serving(seg[4:]) or self.seg_incarn.get(seg) != self.incarn[seg[4:]]:
                    break
                if self.mem.get((seg, off)) != tag_of(key, o.version, j):
                    raise SimViolation(
                        f"disk copy of {key!r} v{o.version} holds foreign bytes at {seg}@{off}"
                    )

    # -------------------------------------------------------------------- main loop

    def _final_audit(self) -> None:
        """Heal, let the leader settle, then read every key through the leader: each
        visible object's copies on serving nodes hold exactly its bytes, and the answers
        join the history (so an acknowledged put that vanished is not linearizable)."""
        self.net.recover()
        for _ in range(300):
            self.now += self.cfg.step
            self.steps += 1
            if self.steps % self.cfg.tick_every == 0:
                for node in self.net.nodes.values():
                    node.core.tick()
            self.net.deliver_once()
            self._apply_all()
            lead = self.leader()
            if lead != self.lead or (lead and self.net.nodes[lead].core.term != self.lead_term):
                self._leader_change(lead)
            for idx, p in list(self.proposals.items()):
                if self.now > p.deadline and not p.done:
                    p.done = True
                    del self.proposals[idx]
                    p.cb(None)
            if self.lead and not self.proposals:
                sm = self.sms[self.lead]
                hn = self.net.nodes[self.lead]
                if sm.applied >= hn.core.log.committed:
                    break
        if not self.lead:
            return
        self._check()
        sm = self.sms[self.lead]
        for key in self.keys:
            lk = sm.lookup([key])[0]
            h = self.history.invoke("audit", StoreOp("get", key))
            if lk.code:
                self.history.ok(h, None)
                continue
            if not lk.replicas:
                # every acknowledged put is readable from some tier until it is removed or
                # dropped from the last one: a found object must have a copy to read
                raise SimViolation(f"audit: {key!r} v{lk.version} is found with no copy to read")
            for copy in lk.replicas:
                if not all(self._serving(d.segment[4:]) for d in copy.slices):
                    continue
                for j, d in enumerate(copy.slices):
                    if self.mem.get((d.segment, d.offset)) != tag_of(key, lk.version, j):
                        raise SimViolation(
                            f"audit: {key!r} v{lk.version} has foreign bytes at "
                            f"{d.segment}@{d.offset}"
                        )
                self.res.reads_checked += 1
            self.history.ok(h, self.tokens.get((key, lk.version)))
