"""Data-driven transcripts of the store master core (etcd ``datadriven`` style).

Each file in ``testdata/`` is a sequence of blocks::

    # comment lines
    command key=value flag ...
    ----
    expected output (no blank lines)

A block ends at a blank line. Mutating commands print the result, then the object table, the
segments (with their free extents, so coalescing is visible) and held extents; every state is
also checked with :func:`kvmesh.store.master.invariants.check` and a snapshot round trip.

Rewrite the expected outputs after an intended change with ``KVMESH_REWRITE=1 pytest
tests/store/test_master_transcripts.py`` and review the diff.

Commands (times default to the transcript clock, moved with ``tick``):
  config slice=N align=N quarantine=S   fresh machine (first block)
  mount node= seg= host= size= [ep=] [max=]   max: the leader's segment cap (apply judges it)
  unmount node= seg= [grace=]
  expire nodes=a,b
  put-start keys=a,b sizes=1,2 [replicas=] [strategy=] [host=] [prefer=] [soft] [hard] [ttl=]
  upsert    (same arguments)
  put-end keys= [versions=]         versions default to "last" (the last put's of each key);
                                    "none" sends none (refused)
  put-revoke keys= [versions=]
  remove keys= [force]              through the leader policy (leases -> ObjectHasLease / hold)
  remove-all [force]                skips leased keys
  remove-prefix prefix= [force] [limit=]  one round: the leader's scan, then its entry
  release                           Release of the holds that are due
  reclaim timeout=
  evict keys= [soft]                raw Evict entry (apply's re-check)
  evict-auto [need=] [hwm=] [ratio=]  the leader's victim choice, then its Evict entry
  pin keys= [hard] [ttl=] / unpin keys=
  lease keys= [ttl=]                grant read leases / new-leader keys= means blanket period
  new-leader [ttl=]                 fresh leader soft state (everything leased for ttl)
  touch keys=                       access order for eviction
  lookup keys= [host=]              read-only query
  exists keys=                      read-only exists + get_size
  tick t=                           advance the transcript clock
  raw <cmd>                         mutating command without printing the tables
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from kvmesh.store.errors import code_name
from kvmesh.store.master import invariants
from kvmesh.store.master.commands import (
    Evict,
    ExpireNodes,
    Mount,
    Pin,
    PutEnd,
    PutRevoke,
    PutStart,
    Reclaim,
    RemoveAll,
    Unmount,
    Unpin,
    Upsert,
    encode_command,
)
from kvmesh.store.master.eviction import choose_victims
from kvmesh.store.master.leases import AccessStamps, LeaseTable
from kvmesh.store.master.policy import (
    HoldTracker,
    plan_remove,
    plan_remove_prefix,
    plan_upsert,
)
from kvmesh.store.master.state import MasterConfig, StoreStateMachine
from kvmesh.store.types import ReplicateConfig

DATA = Path(__file__).parent / "testdata"
REWRITE = os.environ.get("KVMESH_REWRITE") == "1"


def _codes(codes: list[int]) -> str:
    return "[" + ", ".join("ok" if c == 0 else code_name(c) for c in codes) + "]"


def _list(v: str | None) -> list[str]:
    return v.split(",") if v else []


class Driver:
    def __init__(self) -> None:
        self.sm = StoreStateMachine()
        self.index = 0
        self.now = 0.0
        self.leases = LeaseTable()
        self.stats = AccessStamps(self.sm)
        self.holds = HoldTracker(5.0)
        self.last_versions: dict[str, int] = {}

    # -- helpers ---------------------------------------------------------------------

    def apply(self, cmd) -> object:
        self.index += 1
        res = self.sm.apply(self.index, encode_command(cmd))
        errs = invariants.check(self.sm)
        assert not errs, "\n".join(errs)
        clone = StoreStateMachine()
        clone.restore(self.sm.snapshot())
        assert clone.digest() == self.sm.digest(), "snapshot round trip changed the state"
        assert not invariants.check(clone)
        return res

    def tables(self) -> list[str]:
        sm = self.sm
        out = ["objects:"]
        for key in sm.keys():  # noqa: SIM118 - state machine, not a dict
            o = sm.objects[key]
            pin = {0: "-", 1: f"soft<{o.pin_until:g}", 2: "hard"}[o.pin]
            state = sm.state_of(key).name
            copies = " ".join(
                "[" + " ".join(f"{seg}@{off}+{ln}" for seg, off, ln in copy) + "]"
                for copy in sm.placement(key)
            )
            out.append(f"  {key} v{o.version} {state} size={o.size} pin={pin} {copies}")
        out.append("segments:")
        for s in sm.segs.values():
            free = " ".join(f"[{a},{b})" for a, b in s.alloc.free_extents()) or "-"
            extra = f" until={s.deadline:g}" if s.state == "draining" else ""
            out.append(
                f"  {s.name} node={s.node_id} host={s.host_id} {s.state}{extra}"
                f" used={s.alloc.used}/{s.alloc.size} slices={s.slices} free={free}"
            )
        if sm.held:
            out.append("held:")
            for tag, ext in sm.held.items():
                names = {s.id: s.name for s in sm.segs.values()}
                out.append(
                    f"  {tag}: " + " ".join(f"{names[sid]}@{off}+{ln}" for sid, off, ln in ext)
                )
        return out

    def config(self, a: dict[str, str]) -> ReplicateConfig:
        return ReplicateConfig(
            replica_num=int(a.get("replicas", 1)),
            preferred_segment=a.get("prefer"),
            strategy=a.get("strategy", "local"),  # type: ignore[arg-type]
            writer_host=a.get("host"),
            soft_pin="soft" in a,
            hard_pin="hard" in a,
        )

    def versions(self, a: dict[str, str], keys: list[str], default: str = "last") -> list[int]:
        v = a.get("versions", default)
        if v == "none":
            return []
        if v == "last":
            return [self.last_versions.get(k, 0) for k in keys]
        return [int(x) for x in _list(v)]

    # -- commands --------------------------------------------------------------------

    def run(self, cmd: str, a: dict[str, str]) -> list[str]:
        now = float(a.get("now", self.now))
        quiet = False
        if cmd == "raw":
            quiet = True
            cmd = a.pop("_sub")
        out: list[str]
        if cmd == "config":
            self.__init__()
            self.sm = StoreStateMachine(
                MasterConfig(
                    slice_limit=int(a.get("slice", 16 << 20)),
                    align=int(a.get("align", 64)),
                    remount_quarantine=float(a.get("quarantine", 60.0)),
                )
            )
            self.stats = AccessStamps(self.sm)  # the access order lives in sm's table
            return ["ok"]
        if cmd == "tick":
            self.now += float(a["t"])
            return [f"now={self.now:g}"]
        if cmd == "new-leader":
            self.leases = LeaseTable(start=self.now, grace=float(a.get("ttl", 5.0)))
            self.stats = AccessStamps(self.sm)
            self.stats.reset(self.sm.keys())
            self.holds = HoldTracker(5.0)
            return [f"blanket lease until {self.leases.blanket_until:g}"]
        if cmd == "lease":
            keys = _list(a["keys"])
            until = self.leases.grant(keys, now, float(a.get("ttl", 5.0)))
            self.stats.touch(keys)
            return [
                f"{k} until={u:g}" if u else f"{k} refused (blocked)" for k, u in zip(keys, until)
            ]
        if cmd == "touch":
            self.stats.touch(_list(a["keys"]))
            return ["ok"]
        if cmd == "exists":
            keys = _list(a["keys"])
            sizes = self.sm.get_size(keys)
            return [
                f"{k}: {'yes' if e else 'no'}" + (f" size={z}" if e else "")
                for k, e, z in zip(keys, self.sm.exists(keys), sizes)
            ]
        if cmd == "lookup":
            out = []
            for k, r in zip(_list(a["keys"]), self.sm.lookup(_list(a["keys"]), host=a.get("host"))):
                if r.code:
                    out.append(f"{k}: {code_name(r.code)}")
                    continue
                copies = " ".join(
                    "[" + " ".join(f"{d.segment}@{d.offset}+{d.length}" for d in c.slices) + "]"
                    for c in r.replicas
                )
                out.append(f"{k}: v{r.version} size={r.size} {copies}")
            return out
        if cmd == "mount":
            res = self.apply(
                Mount(
                    a["node"],
                    a["seg"],
                    a.get("ep", a["node"] + ":1"),
                    a.get("host", "h"),
                    int(a["size"]),
                    now,
                    int(a.get("max", 0)),
                )
            )
            out = [f"result: {_codes(res.codes)}"]
        elif cmd == "unmount":
            res = self.apply(Unmount(a["node"], a["seg"], now, float(a.get("grace", 0))))
            out = [f"result: {_codes(res.codes)} lost={res.lost}"]
        elif cmd == "expire":
            res = self.apply(ExpireNodes(_list(a["nodes"]), now))
            out = [f"result: {_codes(res.codes)} lost={res.lost}"]
        elif cmd in ("put-start", "upsert"):
            keys = _list(a["keys"])
            sizes = [int(x) for x in _list(a["sizes"])]
            ttl = float(a.get("ttl", 1800))
            if cmd == "put-start":
                res = self.apply(PutStart(keys, sizes, self.config(a), now, ttl))
                codes = res.codes
            else:
                up = Upsert(keys, sizes, self.config(a), now, ttl)
                plan = plan_upsert(self.leases, [self.sm.state_of(k) != 0 for k in keys], up, now)
                codes = list(plan.codes)
                if plan.command is not None:
                    res = self.apply(plan.command)
                    it = iter(zip(res.codes, res.versions))
                    sent = iter(plan.command.keys)
                    for i, c in enumerate(codes):
                        if c == 0:
                            codes[i], v = next(it)
                            k = next(sent)
                            if codes[i] == 0:
                                self.last_versions[k] = v
            if cmd == "put-start":
                for k, c, v in zip(keys, res.codes, res.versions):
                    if c == 0:
                        self.last_versions[k] = v
            self.stats.touch(k for k, c in zip(keys, codes) if c == 0)
            out = [f"result: {_codes(codes)}"]
        elif cmd == "put-end":
            keys = _list(a["keys"])
            res = self.apply(PutEnd(keys, self.versions(a, keys)))
            out = [f"result: {_codes(res.codes)}"]
        elif cmd == "put-revoke":
            keys = _list(a["keys"])
            res = self.apply(PutRevoke(keys, self.versions(a, keys)))
            out = [f"result: {_codes(res.codes)}"]
        elif cmd == "remove":
            keys = _list(a["keys"])
            plan = plan_remove(self.leases, keys, now, force="force" in a)
            codes = list(plan.codes)
            if plan.command is not None:
                self.leases.block(plan.command.keys)
                res = self.apply(plan.command)
                self.leases.unblock(plan.command.keys)
                if plan.command.hold:
                    self.holds.note(self.index, plan.release_at)
                it = iter(res.codes)
                codes = [next(it) if c == 0 else c for c in codes]
            out = [f"result: {_codes(codes)}"]
            if plan.command is not None and plan.command.hold:
                out.append(f"held until {plan.release_at:g}")
        elif cmd == "remove-all":
            skip = (
                self.leases.all_leased(now)
                if now >= self.leases.blanket_until
                else list(self.sm.keys())
            )
            res = self.apply(RemoveAll(skip, force="force" in a))
            out = [f"result: removed={res.removed}"]
        elif cmd == "remove-prefix":
            force = "force" in a
            leased = None if force else (lambda k: self.leases.leased(k, now))
            found, skipped, more = self.sm.prefix_candidates(
                a["prefix"], self.sm.keys(), int(a.get("limit", 8192)), leased
            )
            rp, release_at = plan_remove_prefix(
                a["prefix"], found, skipped, more, self.leases, now, force
            )
            self.leases.block(rp.keys)
            res = self.apply(rp)
            self.leases.unblock(rp.keys)
            if rp.hold:
                self.holds.note(self.index, release_at)
            out = [f"entry: keys={rp.keys} hold={rp.hold}"]
            out.append(f"result: removed={res.removed} skipped={res.skipped} more={res.more}")
        elif cmd == "release":
            rel = self.holds.due(self.sm.held_tags(), self.leases, now)
            if rel is None:
                return ["nothing due"]
            res = self.apply(rel)
            self.holds.forget(rel.tags)
            out = [f"release {rel.tags}: {_codes(res.codes)}"]
        elif cmd == "reclaim":
            res = self.apply(Reclaim(now, float(a["timeout"])))
            out = [f"result: reclaimed={res.keys} unmounted={res.unmounted} lost={res.lost}"]
        elif cmd == "evict":
            keys = _list(a["keys"])
            res = self.apply(Evict(keys, self.versions(a, keys, "none"), now, "soft" in a))
            out = [f"result: {_codes(res.codes)} freed={res.freed}"]
        elif cmd == "evict-auto":
            plan = choose_victims(
                self.sm, self.leases, self.stats, now,
                high_watermark=float(a.get("hwm", 0.9)), evict_ratio=float(a.get("ratio", 0.05)),
                need=int(a.get("need", 0)),
            )  # fmt: skip
            head = (
                f"victims={plan.keys} bytes={plan.bytes} allow_soft={plan.allow_soft}"
                f" skipped_leased={plan.skipped_leased} skipped_pinned={plan.skipped_pinned}"
            )
            if not plan.keys:
                return [head]
            res = self.apply(Evict(plan.keys, plan.versions, now, plan.allow_soft))
            self.stats.forget(k for k, c in zip(plan.keys, res.codes) if c == 0)
            out = [head, f"result: {_codes(res.codes)} freed={res.freed}"]
        elif cmd == "pin":
            res = self.apply(Pin(_list(a["keys"]), "hard" in a, now, float(a.get("ttl", 1800))))
            out = [f"result: {_codes(res.codes)}"]
        elif cmd == "unpin":
            res = self.apply(Unpin(_list(a["keys"])))
            out = [f"result: {_codes(res.codes)}"]
        else:
            raise ValueError(f"unknown transcript command {cmd!r}")
        return out if quiet else out + self.tables()


def _parse_args(words: list[str]) -> dict[str, str]:
    a: dict[str, str] = {}
    for w in words:
        k, eq, v = w.partition("=")
        a[k] = v if eq else ""
    return a


def run_file(path: Path) -> tuple[str, str]:
    """(actual text, expected text) of one transcript."""
    text = path.read_text()
    lines = text.splitlines()
    out: list[str] = []
    d = Driver()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.startswith("#"):
            out.append(line)
            i += 1
            continue
        cmd_line = line
        out.append(cmd_line)
        i += 1
        if i >= len(lines) or lines[i] != "----":
            raise ValueError(f"{path.name}:{i}: expected ---- after {cmd_line!r}")
        out.append("----")
        i += 1
        while i < len(lines) and lines[i].strip():
            i += 1
        words = cmd_line.split()
        args = _parse_args(words[1:])
        if words[0] == "raw":
            args = _parse_args(words[2:])
            args["_sub"] = words[1]
        try:
            result = d.run(words[0], args)
        except (msgspec.ValidationError, KeyError, ValueError) as e:
            result = [f"error: {type(e).__name__}: {e}"]
        assert all(r.strip() for r in result), f"blank line in output of {cmd_line!r}"
        out.extend(result)
    actual = "\n".join(out) + "\n"
    return actual, text


FILES = sorted(DATA.glob("*.txt"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_transcript(path: Path) -> None:
    actual, expected = run_file(path)
    if REWRITE:
        if actual != expected:
            path.write_text(actual)
        return
    assert actual == expected, (
        f"{path.name} differs; rerun with KVMESH_REWRITE=1 and review the diff"
    )


def test_transcripts_exist() -> None:
    assert len(FILES) >= 6
