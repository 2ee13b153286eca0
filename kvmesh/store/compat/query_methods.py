"""The query and remove methods of ``MooncakeDistributedStore`` (a mixin of :mod:`.store`):
existence (lease-free probes too), sizes, replica descriptors, removal by key, prefix,
literal-prefix regex or all, and Mooncake's master tasks (unsupported)."""

from __future__ import annotations

import re

from .. import errors as E
from ._common import (
    _each,
    _empty_dict,
    _empty_list,
    _guard,
    _int,
    _key,
    _keys,
    _one,
    _res,
)
from .constants import (
    INVALID_PARAMS,
    NOT_SUPPORTED,
    code,
)
from .types import (
    Descriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
)

__all__ = ["QueryMethods", "literal_prefix"]

_REGEX_META = frozenset(".^$*+?{}[]\\|()")


def literal_prefix(pattern: str) -> str | None:
    """The literal prefix a regex ``^<literal>[.*][$]`` selects, else None (any other
    pattern: an unanchored one, classes, alternations, quantifiers on the literal)."""
    if type(pattern) is not str or not pattern.startswith("^"):
        return None
    body = pattern[1:]
    for tail in (".*$", ".*", "$"):
        if body.endswith(tail) and not body.endswith("\\" + tail):
            if tail == "$":
                return None  # "^abc$" is one key, not a prefix: use remove()
            body = body[: -len(tail)]
            break
    out = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            if i + 1 >= len(body) or body[i + 1].isalnum() or body[i + 1] == "_":
                return None  # \d, \w, a trailing backslash...: not a literal
            out.append(body[i + 1])
            i += 2
            continue
        if ch in _REGEX_META:
            return None
        out.append(ch)
        i += 1
    return "".join(out) or None


class QueryMethods:
    """Needs from the class: ``_live``, ``_segment_named``."""

    # ================================================================== query and remove

    @_guard(_one)
    def is_exist(self, key: str) -> int:
        """1 exists (COMPLETE), 0 not (exactly 0: LMCache counts any truthy answer as a hit),
        a negative code when the master cannot tell."""
        return self._exist([_key(key)])[0]

    def _exist(self, keys: list[str]) -> list[int]:
        if not keys:
            return []
        res = self._live().exists(keys)
        out = []
        for r in res:
            if isinstance(r, E.StoreError):
                out.append(0 if isinstance(r, E.InvalidKey) else code(r.code))
            else:
                out.append(1 if r else 0)
        return out

    @_guard(_each)
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._exist(_keys(keys))

    @_guard(_one)
    def probe_key(self, key: str) -> int:
        """0.3.14's lease-free existence check: kvmesh's exists never grants a lease, so this
        is :meth:`is_exist`."""
        return self._exist([_key(key)])[0]

    @_guard(_each)
    def batch_probe_key(
        self, keys: list[str], policy: str = "none", candidate_size: int = 1
    ) -> list[int]:
        """0.3.14's batch probe (``policy`` / ``candidate_size`` choose replicas to warm in
        Mooncake; kvmesh has nothing to warm and ignores them)."""
        if not isinstance(policy, str):
            raise TypeError("policy must be str")
        _int(candidate_size, "candidate_size")
        return self._exist(_keys(keys))

    @_guard(_one)
    def get_size(self, key: str) -> int:
        r = self._live().get_size([_key(key)])[0]
        return _res(r) if isinstance(r, E.StoreError) else int(r)

    def _descs(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        res = self._live().replicas(keys) if keys else []
        out: dict[str, list[ReplicaDescriptor]] = {}
        for k, reps in zip(keys, res):
            if isinstance(reps, E.StoreError):
                out[k] = []
                continue
            descs = []
            for rep in reps:
                first = rep.slices[0]
                size = sum(s.length for s in rep.slices)
                descs.append(
                    ReplicaDescriptor(
                        MemoryDescriptor(Descriptor(size, first.offset, first.endpoint)),
                        first.segment,
                    )
                )
            out[k] = descs
        return out

    @_guard(_empty_list)
    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's COMPLETE copies (an empty list when it is missing)."""
        k = _key(key)
        return self._descs([k])[k]

    @_guard(_empty_dict)
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        return self._descs(_keys(keys))

    @_guard(_one)
    def remove(self, key: str, force: bool = False) -> int:
        return _res(self._live().remove([_key(key)], force=bool(force))[0])

    @_guard(_each)
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        ks = _keys(keys)
        return [_res(r) for r in self._live().remove(ks, force=bool(force))] if ks else []

    @_guard(_one)
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove the objects whose key matches, for literal-prefix patterns: ``^abc``,
        ``^abc.*`` or ``^abc.*$`` (metacharacters in ``abc`` escaped) remove the keys that
        start with ``abc``; the number removed. Any other pattern (valid or not) answers
        -600: the master never evaluates a client's regex (ReDoS)."""
        if not isinstance(regex_pattern, str):
            raise TypeError("regex_pattern must be str")
        try:
            re.compile(regex_pattern)
        except re.error:
            return INVALID_PARAMS
        prefix = literal_prefix(regex_pattern)
        if prefix is None:
            return INVALID_PARAMS
        return int(self._live().remove_prefix(prefix, force=bool(force)))

    @_guard(_one)
    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        """kvmesh only (not in Mooncake): remove the objects whose key starts with
        ``prefix``; how many, or a negative code."""
        return int(self._live().remove_prefix(_key(prefix), force=bool(force)))

    @_guard(_one)
    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones too with ``force``); how many."""
        return int(self._live().remove_all(force=bool(force)))

    @_guard(_empty_list)
    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Drop the objects' copies (those in ``segment_name`` when given: kvmesh keeps an
        object's copies together, so an object with a copy there goes whole); the keys
        cleared. Leased objects are left, as in Mooncake."""
        ks = _keys(keys)
        if not isinstance(segment_name, str):
            raise TypeError("segment_name must be str")
        if not ks:
            return []
        if segment_name:
            seg = self._segment_named(segment_name)
            res = self._live().replicas(ks)
            ks = [
                k
                for k, r in zip(ks, res)
                if not isinstance(r, E.StoreError)
                and any(s.segment == seg for c in r for s in c.slices)
            ]
            if not ks:
                return []
        res = self._live().remove(ks, force=bool(segment_name))
        return [k for k, r in zip(ks, res) if _res(r) == 0]

    # ------------------------------------------------------------------ tasks (unsupported)

    def create_copy_task(self, key: str, targets: list[str]) -> tuple:
        """Mooncake's master-scheduled replica copy: kvmesh's master never moves bytes.
        ``((0, 0), -1012)``."""
        return ((0, 0), NOT_SUPPORTED)

    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        return ((0, 0), NOT_SUPPORTED)

    def query_task(self, task_id: tuple[int, int]) -> tuple:
        return (None, NOT_SUPPORTED)

    def get_offload_rpc_read_count(self) -> int:
        """Reads Mooncake served from its SSD offload over RPC: kvmesh has none. 0."""
        return 0
