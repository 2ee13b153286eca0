"""A hand-driven in-memory network of Raft cores for unit tests (etcd-raft's ``network``
helper): messages are delivered only when a test says so, in FIFO order, through filters
(``cut``, ``isolate``, ``drop``, ``ignore``). Storage writes are instantaneous and durable;
crash and disk faults belong to the full simulator (:mod:`kvmesh.replog.sim.cluster`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from ..core.raft import RaftCore
from ..storage.memory import MemoryStorage
from ..types import Entry, EntryKind, RaftConfig, ReadState, Role, Snapshot

__all__ = ["HarnessNode", "Network"]


class HarnessNode:
    """A core plus a MemoryStorage; ``process_ready`` persists and "applies" instantly."""

    def __init__(
        self,
        node_id: int,
        storage: MemoryStorage,
        config: RaftConfig,
        rng: random.Random,
        applied: int | None = None,
    ) -> None:
        self.id = node_id
        self.storage = storage
        self.config = config
        self.rng = rng
        self.core = RaftCore(node_id, storage, config, rng, applied=applied)
        self.applied: list[Entry] = []
        self.read_states: list[ReadState] = []
        self.installed: list[Snapshot] = []
        self.readies = 0

    def process_ready(self) -> list:
        out: list = []
        core = self.core
        while core.has_ready():
            rd = core.ready()
            self.readies += 1
            if rd.snapshot_to_install is not None:
                self.storage.apply_snapshot(rd.snapshot_to_install)
                self.installed.append(rd.snapshot_to_install)
            if rd.entries_to_append:
                self.storage.append(rd.entries_to_append)
            if rd.hard_state is not None:
                self.storage.set_hard_state(rd.hard_state)
            out.extend(rd.send_now)
            out.extend(rd.send_after_persist)
            self.applied.extend(rd.committed_entries)
            self.read_states.extend(rd.read_states)
            core.advance(rd)
        return out

    def applied_data(self) -> list[bytes]:
        """Payloads of applied NORMAL, non-empty entries (what a state machine would see)."""
        return [e.data for e in self.applied if e.kind == EntryKind.NORMAL and e.data]


class Network:
    """Nodes ``ids`` bootstrapped as one cluster (or with the given storages)."""

    def __init__(
        self,
        ids: Iterable[int],
        config: RaftConfig | None = None,
        *,
        voters: Iterable[int] | None = None,
        learners: Iterable[int] = (),
        storages: dict[int, MemoryStorage] | None = None,
        seed: int = 0,
        configs: dict[int, RaftConfig] | None = None,
    ) -> None:
        self.config = config or RaftConfig(election_tick=10, heartbeat_tick=1)
        ids = list(ids)
        voters = list(ids if voters is None else voters)
        self.rng = random.Random(seed)
        self.nodes: dict[int, HarnessNode] = {}
        self.queue: list = []
        self.delivered: list = []
        self._drop: dict[tuple[int, int], float] = {}
        self._ignored: set[type] = set()
        self._filters: list[Callable[[object], bool]] = []
        storages = storages or {}
        configs = configs or {}
        for i in ids:
            st = storages.get(i)
            if st is None:
                st = (
                    MemoryStorage.bootstrap(voters, learners)
                    if i in voters or i in learners
                    else MemoryStorage()
                )
            self.nodes[i] = HarnessNode(
                i, st, configs.get(i, self.config), random.Random(seed * 1000 + i)
            )
        for n in self.nodes.values():
            self.queue.extend(n.process_ready())

    # -- access ---------------------------------------------------------------------------

    def core(self, i: int) -> RaftCore:
        return self.nodes[i].core

    def __getitem__(self, i: int) -> RaftCore:
        return self.nodes[i].core

    def leaders(self) -> list[int]:
        return [i for i, n in self.nodes.items() if n.core.role == Role.LEADER]

    def leader(self) -> int:
        ls = self.leaders()
        if len(ls) != 1:
            raise AssertionError(f"expected exactly one leader, found {ls}")
        return ls[0]

    # -- faults ---------------------------------------------------------------------------

    def cut(self, a: int, b: int) -> None:
        self._drop[(a, b)] = 1.0
        self._drop[(b, a)] = 1.0

    def cut_one_way(self, frm: int, to: int) -> None:
        self._drop[(frm, to)] = 1.0

    def isolate(self, i: int) -> None:
        for j in self.nodes:
            if j != i:
                self.cut(i, j)

    def drop(self, frm: int, to: int, p: float) -> None:
        self._drop[(frm, to)] = p

    def ignore(self, msg_type: type) -> None:
        self._ignored.add(msg_type)

    def add_filter(self, f: Callable[[object], bool]) -> None:
        """``f(msg)`` returning False drops the message."""
        self._filters.append(f)

    def recover(self) -> None:
        self._drop.clear()
        self._ignored.clear()
        self._filters.clear()

    def add_node(self, i: int, config: RaftConfig | None = None) -> None:
        """A new, empty node (to be added with a configuration change)."""
        self.nodes[i] = HarnessNode(i, MemoryStorage(), config or self.config, random.Random(i))
        self.queue.extend(self.nodes[i].process_ready())

    def restart(self, i: int) -> None:
        """Crash and restart node ``i`` from its (fully durable) storage."""
        old = self.nodes[i]
        st = old.storage
        node = HarnessNode(i, st, old.config, random.Random(self.rng.random()), applied=None)
        # Volatile state is gone: the state machine restarts from the snapshot and reapplies.
        self.nodes[i] = node
        self.queue = [m for m in self.queue if m.to != i]
        self.queue.extend(node.process_ready())

    # -- driving --------------------------------------------------------------------------

    def _allowed(self, m) -> bool:
        if type(m) in self._ignored:
            return False
        p = self._drop.get((m.frm, m.to))
        if p is not None and (p >= 1.0 or self.rng.random() < p):
            return False
        return all(f(m) for f in self._filters)

    def flush(self) -> None:
        """Collect pending Readies into the queue without delivering anything."""
        for n in self.nodes.values():
            self.queue.extend(n.process_ready())

    def deliver_once(self) -> list:
        """Deliver the messages queued now (not those they cause); returns them."""
        self.flush()
        batch, self.queue = self.queue, []
        done = []
        for m in batch:
            if m.to not in self.nodes or not self._allowed(m):
                continue
            node = self.nodes[m.to]
            node.core.step(m)
            done.append(m)
            self.queue.extend(node.process_ready())
        self.delivered.extend(done)
        return done

    def stabilize(self, max_rounds: int = 1000) -> list:
        """Deliver until no message is left; returns everything delivered."""
        out = []
        for _ in range(max_rounds):
            self.flush()
            if not self.queue:
                return out
            out.extend(self.deliver_once())
        raise AssertionError("network did not stabilise")

    def tick(self, i: int, n: int = 1) -> None:
        for _ in range(n):
            self.nodes[i].core.tick()
        self.flush()

    def tick_all(self, n: int = 1, stabilize: bool = True) -> None:
        for _ in range(n):
            for node in self.nodes.values():
                node.core.tick()
            if stabilize:
                self.stabilize()
            else:
                self.flush()

    def elect(self, i: int) -> None:
        """Make ``i`` campaign and deliver everything."""
        self.nodes[i].core.campaign()
        self.stabilize()

    def propose(self, i: int, data: bytes) -> int:
        idx = self.nodes[i].core.propose(data)
        self.stabilize()
        return idx
