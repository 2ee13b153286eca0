"""Safety invariants checked continuously while a simulation runs.

Numbers are those of the list in docs/replog.md, "Deterministic simulator": 1 election
safety, 2 leader append-only, 3 log matching,
4 leader completeness, 5 state-machine safety, 6 commit monotonicity and bounds (including
"what is reported committed is durable on a quorum"), 7 term/vote durability, 8 snapshot
equivalence, 9 one uncommitted configuration change, 12 exactly-once apply (together with
:class:`~kvmesh.replog.sim.kv.ApplyLedger`). 10/11 (linearizability, lost writes) and 14
(progress once faults heal) are checked at the end of a run by the simulator.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.progress import committed_index, quorum_size
from ..core.raft import RaftCore, next_conf_state
from ..storage.memory import MemoryStorage
from ..types import (
    Append,
    AppendResp,
    ConfState,
    Entry,
    EntryKind,
    LogCompacted,
    LogUnavailable,
    Role,
    StorageError,
    Vote,
    VoteResp,
    decode_conf_change,
)
from .kv import ApplyLedger, make_state_machine, state_digest

__all__ = ["SimViolation", "Invariants"]

_NORMAL = int(EntryKind.NORMAL)
_CONF = int(EntryKind.CONF_CHANGE)


class SimViolation(AssertionError):
    """An invariant failed; ``invariant`` names it."""

    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        self.detail = detail
        super().__init__(f"[{invariant}] {detail}")


def _durable_has(st: MemoryStorage, index: int, term: int) -> bool:
    if st.snapshot().meta.index >= index:
        return True
    try:
        return st.term(index) == term
    except StorageError:
        return False


class Invariants:
    """Global oracles shared by all simulated nodes.

    ``durable_checks`` enables the checks that compare messages and commits against the
    simulated disks' *durable* layers; they are meaningful only when the nodes persist
    before acknowledging (the negative-control modes turn them off so that the client-side
    checks are what catches the damage).
    """

    def __init__(self, durable_checks: bool = True, enabled: bool = True) -> None:
        self.enabled = enabled
        self.durable_checks = durable_checks and enabled
        self.leader_of_term: dict[int, int] = {}
        self.applied: dict[int, Entry] = {}  # index -> entry first applied there
        self.max_applied = 0
        self.granted: dict[tuple[int, int], int] = {}  # (voter, term) -> candidate
        self.leader_tail: dict[int, tuple[int, int]] = {}  # node -> (term, last appended index)
        # Highest commit index whose entries were checked durable on a quorum of the
        # committing configuration (the simulator sets it to the bootstrap prefix).
        self.verified_commit = 0
        self.figure8 = 0
        # Snapshot equivalence: a reference machine replays the applied oracle in order.
        self._ref_ledger = ApplyLedger()
        self.ref_sm = make_state_machine(0, self._ref_ledger)
        self.ref_index = 0
        self.snap_digests: dict[int, int] = {}  # index -> digest claimed by a snapshot
        self.snap_confs: dict[int, ConfState] = {}  # index -> configuration a snapshot recorded
        self.ref_conf = ConfState()
        self.ref_digests: dict[int, int] = {}  # index -> reference digest (for snapshot indices)
        self.snapshots_replayed = 0  # snapshot digests confirmed by replaying the log

    # -- 1, 2: leaders -----------------------------------------------------------------------

    def leader_seen(self, term: int, node: int) -> None:
        if not self.enabled:
            return
        prev = self.leader_of_term.setdefault(term, node)
        if prev != node:
            raise SimViolation("election-safety", f"term {term} has two leaders: {prev} and {node}")

    def leader_appended(self, node: int, term: int, entries: list[Entry]) -> None:
        if not self.enabled:
            return
        first = entries[0].index
        prev = self.leader_tail.get(node)
        if prev is not None and prev[0] == term and first <= prev[1]:
            raise SimViolation(
                "leader-append-only",
                f"leader {node} in term {term} rewrote its log from index {first} "
                f"(had appended up to {prev[1]})",
            )
        self.leader_tail[node] = (term, entries[-1].index)

    # -- 4: leader completeness -------------------------------------------------------------

    def became_leader(self, node: int, core: RaftCore) -> None:
        if not self.enabled:
            return
        self.leader_seen(core.term, node)
        log = core.log
        first = log.first_index()
        for i in range(max(first, 1), self.max_applied + 1):
            e = self.applied.get(i)
            if e is None:
                continue
            t = log.zero_term(i)
            if t != e.term:
                raise SimViolation(
                    "leader-completeness",
                    f"node {node} became leader of term {core.term} without committed entry {i} "
                    f"(term {e.term}); its log has term {t} there (last index {log.last_index()})",
                )

    # -- 7: messages against durable state ---------------------------------------------------

    def message_sent(self, node: int, m, durable: MemoryStorage) -> None:
        if not self.enabled:
            return
        t = type(m)
        if t is Append:
            self.leader_seen(m.term, node)
            return
        if t is VoteResp and not m.reject:
            prev = self.granted.setdefault((node, m.term), m.to)
            if prev != m.to:
                raise SimViolation(
                    "vote-durability", f"node {node} voted for {prev} and {m.to} in term {m.term}"
                )
            if self.durable_checks:
                # Durable: this vote, or a later term (which rules out any other vote in
                # m.term after a restart).
                hs = durable.hard_state
                if hs.term < m.term or (hs.term == m.term and hs.vote != m.to):
                    raise SimViolation(
                        "vote-durability",
                        f"node {node} granted its vote to {m.to} in term {m.term}"
                        f" before persisting it (durable {hs})",
                    )
        elif t is Vote and self.durable_checks:
            hs = durable.hard_state
            if hs.term < m.term or (hs.term == m.term and hs.vote != node):
                raise SimViolation(
                    "vote-durability",
                    f"node {node} campaigned in term {m.term} before persisting (durable {hs})",
                )
        elif (
            t is AppendResp
            and not m.reject
            and self.durable_checks
            and m.index
            and durable.last_index() < m.index
        ):
            raise SimViolation(
                "persist-before-ack",
                f"node {node} acknowledged index {m.index}"
                f" but only {durable.last_index()} is durable",
            )

    # -- 5, 6: apply ---------------------------------------------------------------------------

    @staticmethod
    def quorum(voters: tuple[int, ...]) -> int:
        """Copies a committed entry needs: a majority of the configuration that committed
        it (the committing leader's voters)."""
        return quorum_size(len(voters))

    def commit_seen(
        self,
        node: int,
        voters: tuple[int, ...],
        committed: int,
        term_of: Callable[[int], int],
        durables: dict[int, MemoryStorage],
    ) -> None:
        """6: a commit index is about to be acted on (a Ready carries it: messages, applying).
        Every entry newly committed must be durable on a majority of ``voters``, the
        configuration the node counted (the core counts the configuration as of its applied
        index). Called for every Ready, so no commit advance is communicated unchecked."""
        if not self.durable_checks or committed <= self.verified_commit:
            return
        need = self.quorum(voters)
        for i in range(self.verified_commit + 1, committed + 1):
            try:
                t = term_of(i)
            except StorageError:
                continue  # compacted here: it was applied, so checked when it was committed
            have = sum(1 for v in voters if v in durables and _durable_has(durables[v], i, t))
            if have < need:
                raise SimViolation(
                    "commit-durable-on-quorum",
                    f"node {node} committed index {i} (term {t}) durable on only {have} of voters "
                    f"{voters} (need {need})",
                )
        self.verified_commit = committed

    def leader_commit(self, node: int, core: RaftCore, durables: dict[int, MemoryStorage]) -> None:
        if self.durable_checks and core.log.committed > self.verified_commit:
            self.commit_seen(node, core.voters, core.log.committed, core.log.term, durables)

    def leader_stepped(self, node: int, core: RaftCore, prev_commit: int) -> int:
        """After a leader stepped a message: Figure 8. A leader moves its commit index only
        onto an entry of its own term; and (coverage) count the moments a quorum holds an
        entry above the commit index whose term is older than the leader's."""
        log = core.log
        c = log.committed
        if not self.enabled:
            return c
        if c > prev_commit and log.zero_term(c) != core.term:
            raise SimViolation(
                "commit-current-term",
                f"leader {node} (term {core.term}) committed index {c} of term {log.zero_term(c)} "
                "by counting",
            )
        matches = [
            log.persisted if v == node else core.prs[v].match
            for v in core.voters
            if v == node or v in core.prs
        ]
        ci = committed_index(matches)
        if ci > c and log.zero_term(ci) != core.term:
            self.figure8 += 1
        return c

    def entry_applied(
        self, node: int, e: Entry, voters: tuple[int, ...], durables: dict[int, MemoryStorage]
    ) -> None:
        if not self.enabled:
            return
        # The Ready path applies committed entries while the Ready's fsync runs, on the
        # core's promise that it hands out only entries durable locally (log.py: committed
        # entries up to min(committed, persisted)). Raft's other checks do not notice a
        # break of it (the entry is durable on a quorum), so it is checked here.
        if self.durable_checks and not _durable_has(durables[node], e.index, e.term):
            raise SimViolation(
                "apply-durable-locally",
                f"node {node} applied index {e.index} (term {e.term}) before it was durable "
                "in its own log",
            )
        prev = self.applied.get(e.index)
        if prev is None:
            self.applied[e.index] = e
            if e.index > self.max_applied:
                self.max_applied = e.index
            if self.durable_checks and e.index > self.verified_commit:
                raise SimViolation(
                    "commit-durable-on-quorum",
                    f"node {node} applied index {e.index} (term {e.term}) "
                    "that no checked commit covers "
                    f"(checked up to {self.verified_commit})",
                )
        elif prev.term != e.term or prev.data != e.data or prev.kind != e.kind:
            raise SimViolation(
                "state-machine-safety",
                f"node {node} applied {e!r} at index {e.index}, another node applied {prev!r}",
            )

    def commit_progress(self, node: int, core: RaftCore, prev_commit: int) -> int:
        log = core.log
        c = log.committed
        if not self.enabled:
            return c
        if c < prev_commit:
            raise SimViolation(
                "commit-monotonic", f"node {node} commit went back from {prev_commit} to {c}"
            )
        if log.applied > c:
            raise SimViolation("commit-bounds", f"node {node} applied {log.applied} > commit {c}")
        if c > log.last_index():
            raise SimViolation(
                "commit-bounds", f"node {node} commit {c} > last index {log.last_index()}"
            )
        if c > prev_commit and core.role == Role.LEADER and log.zero_term(c) != core.term:
            # Figure 8: a leader moves its commit index only onto an entry of its own term.
            raise SimViolation(
                "commit-current-term",
                f"leader {node} (term {core.term}) committed index {c} of term {log.zero_term(c)} "
                "by counting",
            )
        return c

    # -- 8: snapshots ------------------------------------------------------------------------

    def snapshot_taken(
        self, node: int, index: int, digest: int, conf: ConfState | None = None
    ) -> None:
        if not self.enabled:
            return
        if conf is not None:
            prev_conf = self.snap_confs.setdefault(index, conf)
            if prev_conf != conf:
                raise SimViolation(
                    "snapshot-configuration",
                    f"node {node} snapshot at {index} records {conf}, another {prev_conf}",
                )
        prev = self.snap_digests.setdefault(index, digest)
        if prev != digest:
            raise SimViolation(
                "snapshot-equivalence",
                f"node {node} snapshot at {index} differs from another node's",
            )
        ref = self.ref_digests.get(index)
        if ref is not None and ref != digest:
            raise SimViolation(
                "snapshot-equivalence", f"node {node} snapshot at {index} differs from log replay"
            )

    def snapshot_restored(self, node: int, index: int, digest: int) -> None:
        if not self.enabled:
            return
        want = self.snap_digests.get(index)
        if want is not None and want != digest:
            raise SimViolation(
                "snapshot-equivalence",
                f"node {node} restored a snapshot at {index} into a different state",
            )

    def advance_reference(self, upto: int) -> None:
        """Replay the applied oracle into the reference machine up to ``upto``. The
        simulator keeps the reference behind every live node (so that snapshots those nodes
        take can be compared with a replay) and lets it catch up at the end of a run."""
        sm = self.ref_sm
        while self.ref_index < upto:
            e = self.applied.get(self.ref_index + 1)
            if e is None:
                return
            self.ref_index += 1
            if e.kind == _NORMAL:
                if e.data:
                    sm.apply(e.index, e.data)
            else:
                self.ref_conf = next_conf_state(self.ref_conf, decode_conf_change(e.data))
            conf = self.snap_confs.get(self.ref_index)
            if conf is not None and conf != self.ref_conf:
                raise SimViolation(
                    "snapshot-configuration",
                    f"snapshot at {self.ref_index} records {conf}; "
                    f"the log's configuration there is {self.ref_conf}",
                )
            want = self.snap_digests.get(self.ref_index)
            if want is not None:
                d = state_digest(sm)
                self.ref_digests[self.ref_index] = d
                self.snapshots_replayed += 1
                if d != want:
                    raise SimViolation(
                        "snapshot-equivalence",
                        f"snapshot at {self.ref_index} differs from replaying the log",
                    )

    # -- 3: log matching (end of run) ----------------------------------------------------------

    @staticmethod
    def check_log_matching(logs: dict[int, dict[int, tuple[int, bytes]]]) -> None:
        """``logs``: node -> {index: (term, data)}. Same (index, term) => same prefix."""
        ids = sorted(logs)
        for a_i, a in enumerate(ids):
            la = logs[a]
            for b in ids[a_i + 1 :]:
                lb = logs[b]
                common = sorted(set(la) & set(lb))
                matched_from = None
                for i in reversed(common):
                    if la[i][0] == lb[i][0]:
                        matched_from = i
                        break
                if matched_from is None:
                    continue
                for i in common:
                    if i > matched_from:
                        break
                    if la[i] != lb[i]:
                        raise SimViolation(
                            "log-matching",
                            f"nodes {a} and {b} agree on (index {matched_from}, "
                            f"term {la[matched_from][0]}) "
                            f"but differ at index {i}: {la[i][0]} vs {lb[i][0]}",
                        )

    @staticmethod
    def log_of(core: RaftCore) -> dict[int, tuple[int, bytes]]:
        log = core.log
        out = {}
        lo = log.first_index()
        try:
            ents = log.entries(lo, log.last_index() + 1)
        except (LogCompacted, LogUnavailable):
            return out
        for e in ents:
            out[e.index] = (e.term, e.data)
        return out

    def check_leader_role(self, node: int, core: RaftCore) -> None:
        if core.role == Role.LEADER:
            self.leader_seen(core.term, node)

    def uncommitted_conf_changes(self, core: RaftCore) -> int:
        log = core.log
        lo, hi = log.committed + 1, log.last_index()
        if lo > hi:
            return 0
        return sum(1 for e in log.entries(lo, hi + 1) if e.kind == _CONF)
