"""The sequential model the store simulator's histories are checked against."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ....replog import (
    UNKNOWN,
    Operation,
)

__all__ = ["StoreModel", "StoreOp"]


class StoreOp(NamedTuple):
    """``op`` in put/hide/get/exists/remove/drop; ``value`` is the put's unique token."""

    op: str
    key: str
    value: Hashable = None


class StoreModel:
    """Per-key register with Mooncake put semantics (state: the visible token or None).

    Outputs: put ``ok`` (only if absent) / ``exists`` (only if present) / ``busy`` (another put
    in flight: no effect, any state); ``hide`` (an upsert's start: the old value becomes
    invisible until the upsert's ``put`` completes) ``ok`` / ``busy`` / ``leased``; get:
    the token or None; exists: bool; remove ``ok`` (present) / ``notfound`` (absent) /
    ``leased`` / ``busy``; drop (eviction or loss of the last copy) ``ok`` only if present;
    prune (a key a remove-by-prefix entry named: removed if COMPLETE, else already absent
    or being put) always legal, leaves the key absent.
    """

    def init(self) -> Any:
        return None

    def step(self, state: Any, inp: StoreOp, out: Any) -> tuple[bool, Any]:
        op = inp.op
        unknown = out is UNKNOWN
        if op == "put":
            if unknown:
                return True, (inp.value if state is None else state)
            if out == "ok":
                return state is None, inp.value
            if out == "exists":
                return state is not None, state
            return out == "busy", state
        if op == "hide":  # the first half of an upsert: the key turns PROCESSING
            if unknown or out == "ok":
                return True, None
            return out in ("busy", "leased"), state
        if op == "get":
            return unknown or out == state, state
        if op == "exists":
            return unknown or out == (state is not None), state
        if op == "remove":
            if unknown:
                return True, None
            if out == "ok":
                return state is not None, None
            if out == "notfound":
                return state is None, state
            return out in ("leased", "busy"), state
        if op == "drop":
            return unknown or state is not None, None
        if op == "prune":
            return True, None
        raise ValueError(op)

    def partition(self, ops: Sequence[Operation]) -> list[list[Operation]]:
        by: dict[str, list[Operation]] = {}
        for o in ops:
            by.setdefault(o.input.key, []).append(o)
        return list(by.values())

    def partition_name(self, ops: Sequence[Operation]) -> str:
        return f"key={ops[0].input.key!r}" if ops else "empty"

    def is_read_only(self, inp: StoreOp) -> bool:
        return inp.op in ("get", "exists")

    def describe_operation(self, inp: StoreOp, out: Any) -> str:
        return (
            f"{inp.op}({inp.key!r}{'' if inp.value is None else ', ' + repr(inp.value)}) -> {out!r}"
        )

    def describe_state(self, state: Any) -> str:
        return repr(state)


# ======================================================================================
