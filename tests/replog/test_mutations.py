"""Mutation suite: plant each bug class the proof machinery once missed (issue 7) and show
that the simulator or the tests catch it within the CI budget.

A mutant is built from the *current* source of the function it breaks (so it follows the
code; if the code moves, the patch no longer applies and the test fails loudly) and
monkeypatched in for one test. Each test first checks that the same seeds pass without
the mutant (the catch is the bug's doing, not the seed's), then that the mutant is caught
and by what.

========================================  =========================================  =========
planted bug                               caught by                                  seeds
========================================  =========================================  =========
(a) driver sends append acks before its   invariants vote-durability /               CI seed 0
    fsync (shared Ready path, node.py)    persist-before-ack
(b) install a snapshot older than the     invariant commit-monotonic (or the         5-11
    commit index                          storage's refusal), stale_snapshot
(c) install any snapshot unconditionally  same                                       2-7
(d) commit an older-term entry by         invariant commit-current-term, figure8     0-3
    counting replicas (Figure 8)          schedule
(e) no vote suppression while a leader    invariant lease-overlap, vote_suppression  0, 6, 24
    is alive                              schedule (lease reads)
(f) quorum-durability invariant asking    test_sim.py::test_commit_durability_*      unit test
    quorum_size(len(voters) - 1)
(g) snapshot records the configuration    test_node.py::test_snapshot_records_*,     unit test
    before its batch (defect 5)           invariant snapshot-configuration
========================================  =========================================  =========
"""

from __future__ import annotations

import inspect
import textwrap

import msgspec
import pytest

from kvmesh.replog.core.log import RaftLog
from kvmesh.replog.core.raft import RaftCore
from kvmesh.replog.readypath import ReadyPath
from kvmesh.replog.sim.cluster import SimConfig, Simulator
from kvmesh.replog.sim.invariants import Invariants


def mutant(func, patches: list[tuple[str, str]]):
    """``func`` rebuilt from its source with each ``(old, new)`` replacement applied (both
    written as in the dedented source: a method's body is indented by 4)."""
    src = textwrap.dedent(inspect.getsource(func))
    for old, new in patches:
        assert src.count(old) == 1, f"mutation site not found in {func.__qualname__}: {old!r}"
        src = src.replace(old, new)
    ns: dict = {}
    exec(compile(src, inspect.getsourcefile(func) or "<mutant>", "exec"), func.__globals__, ns)
    return ns[func.__name__]


def run(seed: int, **over):
    cfg = msgspec.structs.replace(SimConfig.generate(seed, "ci"), **over)
    return Simulator(cfg).run()


def first_caught(seeds, **over):
    """(seed, result) of the first seed whose run fails, else (None, None)."""
    for s in seeds:
        r = run(s, **over)
        if not r.ok:
            return s, r
    return None, None


# Planted bugs: (class, attribute, old, new) source patches.
_SYNC = "    if need_sync:\n        yield SYNC\n"
_SEND_AFTER = "    if rd.send_after_persist:\n        host.send(rd.send_after_persist, True)\n"
MUTANTS = {
    "acks_before_fsync": (
        ReadyPath,
        "run",
        _SYNC + _SEND_AFTER,
        _SEND_AFTER + _SYNC,
    ),
    "stale_snapshot_below_commit": (
        RaftCore,
        "_restore",
        "    if meta.index <= log.committed:\n        return False\n",
        "",
    ),
    "any_snapshot": (
        RaftCore,
        "_restore",
        "    if meta.index <= log.committed:\n        return False\n",
        "    if False:\n        return False\n",
    ),
    "figure8": (
        RaftLog,
        "maybe_commit",
        "if index > self.committed and self.zero_term(index) == term:",
        "if index > self.committed:",
    ),
    "no_vote_suppression": (
        RaftCore,
        "_in_lease",
        "    if not self.cfg.check_quorum",
        "    return False\n    if not self.cfg.check_quorum",
    ),
    "snapshot_conf_before_batch": (
        ReadyPath,
        "snapshot_point",
        "return self.applied, self.applied_conf",
        "return self.applied, self.core.conf_state",
    ),
}
# (c) also ignores that it already has the entries a snapshot covers: both checks go.
MUTANTS_EXTRA = {
    "any_snapshot": [("    if log.match_term(meta.index, meta.term):", "    if False:")],
}


def plant_mutant(monkeypatch, name: str) -> None:
    cls, attr, old, new = MUTANTS[name]
    fn = mutant(getattr(cls, attr), [(old, new), *MUTANTS_EXTRA.get(name, [])])
    monkeypatch.setattr(cls, attr, fn)


def check_caught(monkeypatch, name: str, seeds, violations: tuple[str, ...], **over) -> int:
    """The seeds pass as they are, and one of them catches the mutant ``name`` with one
    of ``violations``; returns the catching seed."""
    bad = [s for s in seeds if not run(s, **over).ok]
    assert not bad, f"seeds {bad} fail without the mutant"
    plant_mutant(monkeypatch, name)
    seed, r = first_caught(seeds, **over)
    assert r is not None, f"mutant {name} survived seeds {list(seeds)}"
    assert r.violation in violations, (seed, r.violation, r.detail[:500])
    return seed


def test_a_acks_before_fsync_in_the_driver_path(monkeypatch):
    """The driver (the shared Ready path that node.py runs) sends append acks and votes
    before its fsync: the simulator runs that very path, so its durable-state oracles see
    acks for entries that are not durable yet."""
    check_caught(
        monkeypatch, "acks_before_fsync", [0, 1], ("persist-before-ack", "vote-durability")
    )


def test_a_the_node_runs_the_same_path(monkeypatch, tmp_path):
    """The path planted above is the one the asyncio driver runs (no copy of the Ready loop
    in node.py): a real replica's Readies all go through ReadyPath.run."""
    import asyncio

    from kvmesh.replog.kvsm import KvPut, encode_command

    from .test_node import Cluster

    calls = []
    orig = ReadyPath.run

    def spy(self, rd):
        calls.append(rd)
        return orig(self, rd)

    monkeypatch.setattr(ReadyPath, "run", spy)

    async def main():
        async with Cluster(tmp_path, n=1, durability="disk") as c:
            leader = await c.leader()
            n0 = leader.metrics["readies"]
            await leader.propose(encode_command(KvPut("k", b"v")))
            return leader.metrics["readies"] - n0

    readies = asyncio.run(asyncio.wait_for(main(), 60))
    assert readies > 0 and len(calls) >= readies


def test_b_snapshot_older_than_commit_index(monkeypatch):
    """The stale_snapshot schedule delivers delayed duplicate InstallSnapshots; installing
    one at or below the commit index rewinds the follower (commit-monotonic), or its
    storage refuses a snapshot older than its own (the replica stops: StorageError)."""
    check_caught(
        monkeypatch,
        "stale_snapshot_below_commit",
        range(5, 12),
        ("exception:StorageError", "commit-monotonic", "commit-bounds"),
        faults=("stale_snapshot",),
    )


def test_c_any_snapshot_installed(monkeypatch):
    check_caught(
        monkeypatch,
        "any_snapshot",
        range(2, 8),
        ("commit-monotonic", "commit-bounds", "exception:StorageError", "persist-before-ack"),
        faults=("stale_snapshot",),
    )


def test_d_figure8_commit_by_counting(monkeypatch):
    check_caught(monkeypatch, "figure8", range(0, 4), ("commit-current-term",), faults=("figure8",))


def test_e_no_vote_suppression(monkeypatch):
    """Lease-read seeds (0, 6 and 24 are LEASE_BASED) with the vote_suppression schedule."""
    check_caught(
        monkeypatch,
        "no_vote_suppression",
        [0, 6, 24],
        ("lease-overlap", "linearizability"),
        faults=("vote_suppression",),
    )


def test_f_quorum_durability_invariant_with_four_voters(monkeypatch):
    """The invariant that once asked quorum_size(len(voters) - 1) copies: its unit test
    fails against that version."""
    from kvmesh.replog.core.progress import quorum_size

    from .test_sim import test_commit_durability_needs_a_majority_of_four_voters as unit

    unit()
    monkeypatch.setattr(
        Invariants, "quorum", staticmethod(lambda voters: quorum_size(max(1, len(voters) - 1)))
    )
    with pytest.raises(pytest.fail.Exception):
        unit()


def test_g_snapshot_records_configuration_before_its_batch(monkeypatch):
    """Defect 5 planted in the shared path: the simulator's snapshot-configuration oracle
    (snapshots between apply slices) catches it; so does
    test_node.py::test_snapshot_records_the_configuration_at_its_index."""
    check_caught(
        monkeypatch,
        "snapshot_conf_before_batch",
        range(2, 5),
        ("snapshot-configuration",),
        faults=("membership",),
        apply_slice=2,
        snapshot_every=5,
    )
