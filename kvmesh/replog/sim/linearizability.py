"""Porcupine-style linearizability checker (Wing & Gong / Lowe search with P-compositionality).

A history is a list of :class:`Operation` (call time, return time, input, output). A model
says how a sequential object behaves (:class:`Model`: ``init``/``step``/``partition``). The
checker splits the history into independent partitions (per key for a KV store: Herlihy &
Wing's locality makes each key checkable on its own), then searches each partition
depth-first for a total order that respects real time and the model.

Outcome semantics, mirroring Jepsen/Porcupine:

* an operation that completed (``ok``) must be linearized between its call and return;
* an operation whose outcome is unknown (client timeout, crash, lost reply) is *pending*:
  its return time is +inf and its output :data:`UNKNOWN`. It may take effect at any point
  after its call, or never;
* an operation that failed *definitely* (the server proved it did not happen) is dropped.

Use :class:`History` to record a run and :func:`check` to verify it::

    h = History(clock=sim.now)
    op = h.invoke(client=3, input=KvOp.put("k", 1))
    h.ok(op, None)
    result = check(KvModel(), h.operations(), timeout_s=5.0)
    assert result.ok, result.report()
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

__all__ = [
    "UNKNOWN",
    "Operation",
    "History",
    "Model",
    "KvOp",
    "KvModel",
    "PartitionResult",
    "CheckResult",
    "check",
    "check_operations",
    "lost_acknowledged_writes",
]

Outcome = Literal["ok", "illegal", "unknown"]


class _Unknown:
    """Output of an operation whose outcome is not known (sentinel, distinct from ``None``)."""

    _instance: _Unknown | None = None

    def __new__(cls) -> _Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNKNOWN"

    def __reduce__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()


@dataclass(frozen=True, slots=True)
class Operation:
    """One client operation: ``input`` invoked at ``call``, answered ``output`` at ``ret``.

    ``ret == math.inf`` (with ``output is UNKNOWN``) marks a pending operation that may or
    may not have taken effect.
    """

    client: Hashable
    input: Any
    call: float
    output: Any
    ret: float

    @property
    def pending(self) -> bool:
        return self.ret == math.inf


class _Slot:
    __slots__ = ("client", "input", "call", "output", "ret", "state")

    def __init__(self, client: Hashable, input: Any, call: float) -> None:
        self.client = client
        self.input = input
        self.call = call
        self.output: Any = UNKNOWN
        self.ret = math.inf
        self.state = "open"  # open | ok | fail | info


class History:
    """Records invoke/complete events from concurrent clients.

    ``clock`` provides timestamps; pass the simulator's virtual clock in simulations. The
    default, ``time.monotonic``, is system-wide on Linux, so histories recorded by several
    processes of one host can be merged.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._slots: list[_Slot] = []

    def invoke(self, client: Hashable, input: Any, t: float | None = None) -> int:
        """Record the call of an operation; returns a handle for :meth:`ok`/:meth:`fail`/
        :meth:`info`."""
        self._slots.append(_Slot(client, input, self._clock() if t is None else t))
        return len(self._slots) - 1

    def _close(self, handle: int, state: str) -> _Slot:
        slot = self._slots[handle]
        if slot.state != "open":
            raise ValueError(f"operation {handle} already completed as {slot.state!r}")
        slot.state = state
        return slot

    def ok(self, handle: int, output: Any, t: float | None = None) -> None:
        """The operation completed and returned ``output``."""
        slot = self._close(handle, "ok")
        slot.output = output
        slot.ret = self._clock() if t is None else t
        if slot.ret < slot.call:
            raise ValueError(
                f"operation {handle} returns at {slot.ret} before its call at {slot.call}"
            )

    def fail(self, handle: int, t: float | None = None) -> None:
        """The operation definitely did not take effect (it is dropped from the history)."""
        self._close(handle, "fail")

    def info(self, handle: int, t: float | None = None) -> None:
        """The outcome is unknown (timeout, lost reply): the operation may or may not have
        happened."""
        self._close(handle, "info")

    def __len__(self) -> int:
        return len(self._slots)

    def operations(self) -> list[Operation]:
        """The checkable history. Operations never completed count as pending (unknown)."""
        out = []
        for s in self._slots:
            if s.state == "fail":
                continue
            if s.state == "ok":
                out.append(Operation(s.client, s.input, s.call, s.output, s.ret))
            else:
                out.append(Operation(s.client, s.input, s.call, UNKNOWN, math.inf))
        return out

    def merge(self, other: History) -> None:
        """Append another recorder's events (e.g. one History per client task)."""
        self._slots.extend(other._slots)


S = TypeVar("S")


class Model(Protocol[S]):
    """A sequential specification. States must be hashable and treated as immutable."""

    def init(self) -> S: ...

    def step(self, state: S, input: Any, output: Any) -> tuple[bool, S]:
        """Apply ``input`` to ``state``; ``ok`` is whether ``output`` is what the object would
        answer. ``output`` may be :data:`UNKNOWN` (pending op): then ok must be True whenever
        the operation can take effect."""
        ...

    def partition(self, ops: Sequence[Operation]) -> list[list[Operation]]:
        """Split into independently checkable sub-histories (return ``[list(ops)]`` if none)."""
        ...

    def partition_name(self, ops: Sequence[Operation]) -> str: ...

    def is_read_only(self, input: Any) -> bool:
        """True if ``input`` never changes the state (pending reads are then dropped)."""
        ...

    def describe_operation(self, input: Any, output: Any) -> str: ...

    def describe_state(self, state: S) -> str: ...


# --------------------------------------------------------------------------------------
# KV model


class KvOp(NamedTuple):
    """Input of :class:`KvModel`. Build with the classmethods.

    Outputs expected by the model: ``get`` -> value or ``None`` if absent; ``put`` -> ``None``;
    ``delete`` -> ``True`` if the key existed; ``cas`` -> ``True`` if it swapped;
    ``append`` -> new length of the key's list (the value of an appended key is a tuple;
    appending to a key holding a scalar has no effect and is accepted only as pending).
    """

    op: str
    key: Hashable
    value: Any = None
    expected: Any = None

    @classmethod
    def get(cls, key: Hashable) -> KvOp:
        return cls("get", key)

    @classmethod
    def put(cls, key: Hashable, value: Hashable) -> KvOp:
        return cls("put", key, value)

    @classmethod
    def delete(cls, key: Hashable) -> KvOp:
        return cls("delete", key)

    @classmethod
    def cas(cls, key: Hashable, expected: Hashable, new: Hashable) -> KvOp:
        return cls("cas", key, new, expected)

    @classmethod
    def append(cls, key: Hashable, value: Hashable) -> KvOp:
        return cls("append", key, value)


class KvModel:
    """Linearizable key-value register map, partitioned per key (state: the key's value)."""

    def init(self) -> Any:
        return None

    def step(self, state: Any, input: KvOp, output: Any) -> tuple[bool, Any]:
        op = input.op
        unknown = output is UNKNOWN
        if op == "get":
            return (unknown or output == state), state
        if op == "put":
            return (unknown or output is None), input.value
        if op == "delete":
            return (unknown or output == (state is not None)), None
        if op == "cas":
            swapped = state == input.expected
            return (unknown or output == swapped), (input.value if swapped else state)
        if op == "append":
            if state is not None and not isinstance(state, tuple):
                # Appending to a scalar is a type error in the KV machine: no effect.
                return unknown, state
            new = (state or ()) + (input.value,)
            return (unknown or output == len(new)), new
        raise ValueError(f"KvModel: unknown operation {op!r}")

    def partition(self, ops: Sequence[Operation]) -> list[list[Operation]]:
        by_key: dict[Hashable, list[Operation]] = {}
        for o in ops:
            by_key.setdefault(o.input.key, []).append(o)
        return list(by_key.values())

    def partition_name(self, ops: Sequence[Operation]) -> str:
        return f"key={ops[0].input.key!r}" if ops else "empty"

    def is_read_only(self, input: KvOp) -> bool:
        return input.op == "get"

    def describe_operation(self, input: KvOp, output: Any) -> str:
        args = {
            "get": f"{input.key!r}",
            "put": f"{input.key!r}, {input.value!r}",
            "delete": f"{input.key!r}",
            "cas": f"{input.key!r}, {input.expected!r} -> {input.value!r}",
            "append": f"{input.key!r}, {input.value!r}",
        }.get(input.op, repr(input))
        return f"{input.op}({args}) -> {output!r}"

    def describe_state(self, state: Any) -> str:
        return repr(state)


# --------------------------------------------------------------------------------------
# Search


@dataclass
class PartitionResult:
    """Result of one partition. For illegal ones, ``longest`` is the longest partial
    linearization found (operations in order, with the state after each) and ``blocked``
    the operations whose return was reached without any way to linearize them."""

    name: str
    outcome: Outcome
    ops: list[Operation]
    longest: list[tuple[Operation, Any]] = field(default_factory=list)
    blocked: list[Operation] = field(default_factory=list)
    steps: int = 0


@dataclass
class CheckResult:
    """Overall outcome: ``illegal`` if any partition is illegal, else ``unknown`` if any ran
    out of budget, else ``ok``."""

    outcome: Outcome
    partitions: list[PartitionResult]
    model: Any
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def illegal(self) -> list[PartitionResult]:
        return [p for p in self.partitions if p.outcome == "illegal"]

    def report(self, max_ops: int = 60) -> str:
        """Human-readable text; details every illegal partition."""
        counts = {
            k: sum(p.outcome == k for p in self.partitions) for k in ("ok", "illegal", "unknown")
        }
        lines = [
            f"linearizability: {self.outcome.upper()} ({len(self.partitions)} partitions: "
            f"{counts['ok']} ok, {counts['illegal']} illegal, {counts['unknown']} unknown; "
            f"{self.elapsed_s:.3f}s)"
        ]
        m = self.model
        for p in self.partitions:
            if p.outcome == "unknown":
                lines.append(
                    f"  partition {p.name}: UNKNOWN "
                    f"(budget exhausted after {p.steps} steps, {len(p.ops)} ops)"
                )
            if p.outcome != "illegal":
                continue
            lines.append(f"  partition {p.name}: ILLEGAL ({len(p.ops)} ops)")
            lines.append("    history (by call time):")
            for o in sorted(p.ops, key=lambda o: (o.call, o.ret))[:max_ops]:
                ret = "pending" if o.pending else f"{o.ret:.6f}"
                lines.append(
                    f"      [{o.call:.6f} .. {ret}] "
                    f"client {o.client}: {m.describe_operation(o.input, o.output)}"
                )
            if len(p.ops) > max_ops:
                lines.append(f"      ... {len(p.ops) - max_ops} more")
            lines.append(
                f"    longest linearizable prefix ({len(p.longest)} ops), state after each:"
            )
            lines.append(f"      init: {m.describe_state(m.init())}")
            for o, st in p.longest[-max_ops:]:
                lines.append(
                    f"      client {o.client}: "
                    f"{m.describe_operation(o.input, o.output)}  => {m.describe_state(st)}"
                )
            for o in p.blocked:
                lines.append(
                    f"    cannot linearize next: client {o.client}: "
                    f"{m.describe_operation(o.input, o.output)} "
                    f"[{o.call:.6f} .. {o.ret:.6f}] "
                    "(no order of the concurrent operations explains it)"
                )
        return "\n".join(lines)


def _check_partition(
    model: Any, ops: list[Operation], deadline: float, max_steps: int | None
) -> PartitionResult:
    name = model.partition_name(ops)
    # A pending op that cannot change state is invisible whether or not it happened.
    ops = [o for o in ops if not (o.pending and model.is_read_only(o.input))]
    n = len(ops)
    if n == 0:
        return PartitionResult(name, "ok", ops)

    # Event list: node 0 is the head sentinel; op i has call node 2i+1 and return node 2i+2.
    # Ties order calls before returns, so operations touching at one instant are concurrent.
    events = []
    for i, o in enumerate(ops):
        events.append((o.call, 0, i))
        events.append((o.ret, 1, i))
    events.sort()
    size = 2 * n + 1
    nxt = [-1] * size
    prv = [-1] * size
    prev_node = 0
    for _, kind, i in events:
        node = 2 * i + 1 + kind
        nxt[prev_node] = node
        prv[node] = prev_node
        prev_node = node

    pending = [o.pending for o in ops]
    remaining = sum(1 for p in pending if not p)  # definite ops still to linearize
    inputs = [o.input for o in ops]
    outputs = [o.output for o in ops]
    step = model.step

    state = model.init()
    bits = 0
    cache: set[tuple[int, Any]] = set()
    stack: list[tuple[int, Any]] = []  # (op index, state before it)
    best: list[tuple[int, Any]] = []
    best_blocked: list[int] = []
    steps = 0
    node = nxt[0]

    def lift(i: int) -> None:
        c, r = 2 * i + 1, 2 * i + 2
        nxt[prv[c]] = nxt[c]
        if nxt[c] != -1:
            prv[nxt[c]] = prv[c]
        nxt[prv[r]] = nxt[r]
        if nxt[r] != -1:
            prv[nxt[r]] = prv[r]

    def unlift(i: int) -> None:
        c, r = 2 * i + 1, 2 * i + 2
        # Reinsert in reverse order of removal: the removed nodes kept their neighbours.
        nxt[prv[r]] = r
        if nxt[r] != -1:
            prv[nxt[r]] = r
        nxt[prv[c]] = c
        if nxt[c] != -1:
            prv[nxt[c]] = c

    while remaining:
        steps += 1
        if steps & 1023 == 0 and (
            time.monotonic() > deadline or (max_steps is not None and steps > max_steps)
        ):
            return PartitionResult(name, "unknown", ops, steps=steps)
        if node == -1:
            raise AssertionError("linearizability search ran off the event list")  # unreachable
        if node & 1:  # call node
            i = (node - 1) >> 1
            ok, new_state = step(state, inputs[i], outputs[i])
            if ok:
                new_bits = bits | (1 << i)
                key = (new_bits, new_state)
                if key not in cache:
                    cache.add(key)
                    stack.append((i, state))
                    state = new_state
                    bits = new_bits
                    lift(i)
                    if not pending[i]:
                        remaining -= 1
                    node = nxt[0]
                    continue
            node = nxt[node]
        else:  # return node: its op must precede everything after, so backtrack
            if len(stack) > len(best) or not best_blocked:
                # Record the deepest dead end: the partial order and who could not follow it.
                best = _replay(stack, state)
                best_blocked = [(node - 2) >> 1]
            if not stack:
                return PartitionResult(
                    name,
                    "illegal",
                    ops,
                    longest=[(ops[i], st) for i, st in best],
                    blocked=[ops[i] for i in best_blocked],
                    steps=steps,
                )
            i, state = stack.pop()
            bits &= ~(1 << i)
            unlift(i)
            if not pending[i]:
                remaining += 1
            node = nxt[2 * i + 1]
    return PartitionResult(name, "ok", ops, steps=steps)


def _replay(stack: list[tuple[int, Any]], state: Any) -> list[tuple[int, Any]]:
    """(op, state after op) for each stack entry; the state after the last one is ``state``."""
    out = []
    for k, (i, _before) in enumerate(stack):
        after = stack[k + 1][1] if k + 1 < len(stack) else state
        out.append((i, after))
    return out


def check_operations(
    model: Any,
    ops: Iterable[Operation],
    timeout_s: float | None = 10.0,
    max_steps_per_partition: int | None = None,
) -> CheckResult:
    """Check ``ops`` against ``model``.

    ``timeout_s`` is a budget *per partition*; a partition that exhausts it (or
    ``max_steps_per_partition`` search steps) is reported ``unknown`` rather than hanging.
    """
    ops = list(ops)
    for o in ops:
        if o.ret < o.call:
            raise ValueError(f"operation {o!r} returns before its call")
    t0 = time.monotonic()
    parts = model.partition(ops) if ops else []
    results = []
    for part in parts:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
        results.append(_check_partition(model, list(part), deadline, max_steps_per_partition))
    if any(r.outcome == "illegal" for r in results):
        outcome: Outcome = "illegal"
    elif any(r.outcome == "unknown" for r in results):
        outcome = "unknown"
    else:
        outcome = "ok"
    return CheckResult(outcome, results, model, time.monotonic() - t0)


def check(
    model: Any,
    history: History | Iterable[Operation],
    timeout_s: float | None = 10.0,
    max_steps_per_partition: int | None = None,
) -> CheckResult:
    """Check a :class:`History` or a list of :class:`Operation`; see :func:`check_operations`."""
    ops = history.operations() if isinstance(history, History) else history
    return check_operations(model, ops, timeout_s, max_steps_per_partition)


def lost_acknowledged_writes(ops: Iterable[Operation], final: dict[Hashable, Any]) -> list[str]:
    """Cheap, search-free check (Jepsen's set workload) for KV histories of unique-valued puts.

    For every key whose last acknowledged write (the ``put``/``delete`` with the latest
    return) *precedes* every other write to that key in real time, the final value must be
    that write's. Keys with later concurrent or pending writes are skipped (their final
    value is legitimately ambiguous). Returns a description per violation.
    """
    by_key: dict[Hashable, list[Operation]] = {}
    for o in ops:
        if o.input.op in ("put", "delete"):
            by_key.setdefault(o.input.key, []).append(o)
    problems = []
    for key, writes in by_key.items():
        acked = [o for o in writes if not o.pending]
        if not acked:
            continue
        last = max(acked, key=lambda o: o.ret)
        if any(o is not last and o.ret >= last.call for o in writes):
            continue  # another write may be ordered after it: the full checker covers this key
        want = last.input.value if last.input.op == "put" else None
        got = final.get(key)
        if got != want:
            problems.append(
                f"key {key!r}: last acknowledged {last.input.op} (client {last.client}) "
                f"wants {want!r}, final read {got!r}"
            )
    return problems
