"""The simulator's replicated state machine: the production exactly-once session wrapper
around the example KV machine, instrumented so that a command reaching the KV machine
twice is caught (every write in the simulator carries a value unique to its
``(client_id, seq)``)."""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from ..kvsm import KvCas, KvPut, KvStateMachine, decode_command
from ..session import SessionStateMachine

__all__ = ["ApplyLedger", "SimKv", "make_state_machine", "state_digest"]


class ApplyLedger:
    """Cluster-wide record of which log index applied each unique write value."""

    __slots__ = ("where", "violations")

    def __init__(self) -> None:
        self.where: dict[bytes, int] = {}
        self.violations: list[str] = []

    def record(self, node: int, index: int, value: bytes) -> None:
        prev = self.where.setdefault(value, index)
        if prev != index:
            self.violations.append(
                f"exactly-once violated: value {value!r} applied at index {prev} "
                f"and again at {index} (node {node})"
            )


class SimKv(KvStateMachine):
    """KvStateMachine that reports every applied write to an :class:`ApplyLedger`."""

    def __init__(self, node: int, ledger: ApplyLedger) -> None:
        super().__init__()
        self.node = node
        self.ledger = ledger

    def apply(self, index: int, data: bytes) -> Any:
        cmd = decode_command(data)
        t = type(cmd)
        if t is KvPut or t is KvCas:
            self.ledger.record(self.node, index, cmd.value)
        return super().apply(index, data)


def make_state_machine(node: int, ledger: ApplyLedger) -> SessionStateMachine:
    return SessionStateMachine(SimKv(node, ledger))


_enc = msgspec.msgpack.Encoder()


def state_digest(sm: SessionStateMachine) -> int:
    """Checksum of the whole replicated state (KV data with revisions, and sessions)."""
    kv: SimKv = sm.inner  # type: ignore[assignment]
    # In LRU order (part of the state: it decides which session a full table ends next).
    sessions = [
        (cid, s.floor, s.evicted, s.last, sorted(s.results.items()))
        for cid, s in sm.sessions.items()
    ]
    return zlib.crc32(_enc.encode([sessions, sm.limits]), kv.digest())
