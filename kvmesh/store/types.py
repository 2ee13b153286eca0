"""Value types shared by the store master core, the service, storage nodes and clients.

These are the contract between ``kvmesh.store.master`` (pure, deterministic) and the drivers
around it (``service.py``, ``node.py``, ``client/``). Everything is a frozen msgspec Struct;
the ones that travel in bulk (replica descriptors, lookups) are ``array_like`` so their
msgpack form is a short array, not a map.

Limits
------
* Keys are non-empty ``str`` of at most :data:`MAX_KEY_BYTES` UTF-8 bytes, without NUL
  (:func:`key_error` says why one is refused).
* Object sizes are ``1 .. MAX_OBJECT_SIZE`` bytes.
* An object is stored as whole copies (:class:`ObjectReplica`); a copy is one or more
  contiguous slices (:class:`ReplicaDesc`), each at most the master's slice limit long.
  Slices of one copy may lie in different segments (even of different nodes); the copies of
  one object never share a node.

Stability: additions only (new optional trailing fields with defaults).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from .errors import InvalidParams

__all__ = [
    "parse_size",
    "MAX_BATCH_KEYS",
    "MAX_KEY_BYTES",
    "MAX_OBJECT_SIZE",
    "MAX_REPLICAS",
    "MAX_SLICES_PER_BATCH",
    "DemoteTask",
    "PromoteTask",
    "ObjectLookup",
    "ObjectReplica",
    "ReplicaDesc",
    "ReplicaRun",
    "ReplicateConfig",
    "SegmentInfo",
    "Strategy",
    "Usage",
    "bad_key",
    "bad_parts",
    "key_error",
    "keys_valid",
]

MAX_KEY_BYTES = 1024
"""Longest key accepted (UTF-8 bytes). SGLang page keys are ~70 bytes."""

MAX_OBJECT_SIZE = 1 << 40
"""Largest object (1 TiB, also the largest segment)."""

MAX_BATCH_KEYS = 65536
"""Most keys in one batch command (one log entry); larger batches are refused whole with
``InvalidParams`` so one request cannot make an unbounded entry."""

MAX_REPLICAS = 16
"""Most copies of one object."""

MAX_SLICES_PER_BATCH = 1 << 18
"""Most slices (copies x slices per copy, summed over the keys) one put batch may ask for:
bounds the work of one log entry; a larger batch is refused whole with ``InvalidParams``."""

Strategy = Literal["local", "random", "most_free"]


class ReplicaDesc(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One contiguous byte range of a copy: ``length`` bytes at ``offset`` of ``segment``,
    a segment published by storage node ``node_id`` whose transfer engine listens at
    ``endpoint``. A reader/writer moves exactly these bytes with the transfer engine."""

    segment: str
    node_id: str
    endpoint: str
    offset: int
    length: int


class ObjectReplica(msgspec.Struct, array_like=True, frozen=True):
    """One full copy of an object: its slices in byte order (lengths sum to the size)."""

    slices: list[ReplicaDesc]


class DemoteTask(msgspec.Struct, array_like=True, frozen=True):
    """One object for a storage node to copy to its disk (the disk tier, docs/store.md):
    from ``src`` (a COMPLETE memory copy) into ``dst`` (its PROCESSING disk copy, on this
    node's disk segment), then end it with the crc32c of the ``size`` bytes it wrote."""

    key: str
    version: int
    size: int
    src: ObjectReplica
    dst: ObjectReplica


class PromoteTask(msgspec.Struct, array_like=True, frozen=True):
    """One disk-only object for a storage node to copy back into memory (promotion on hit,
    docs/store.md): read ``src`` (its COMPLETE disk copy, on this node's disk) into ``dst``
    (memory reserved in reservation ``tag`` on this node), check the bytes against ``crc``,
    then end it with ``PromoteEndReq``."""

    tag: int
    key: str
    version: int
    size: int
    crc: int
    src: ObjectReplica
    dst: ObjectReplica


class ReplicaRun(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The copies of a batch of puts that each got one copy of one slice (what a batch put
    of small objects gets), compactly: ``segs[j]`` is ``(segment, node_id, endpoint)``;
    per key ``where[i]`` indexes ``segs`` (-1: no copy), ``offsets[i]`` and ``lengths[i]``
    place its one slice. Per key three ints instead of a :class:`ReplicaDesc` with three
    strings: the master builds, caches (on every replica) and sends it, and the client
    decodes it, at a fraction of the cost. :meth:`expand` gives the full form."""

    segs: list[tuple[str, str, str]]
    where: list[int]
    offsets: list[int]
    lengths: list[int]

    def fits(self, n: int) -> bool:
        """Whether this describes ``n`` keys with every index in range (a reply from a
        broken peer must not fail later with an IndexError)."""
        w = self.where
        return len(w) == len(self.offsets) == len(self.lengths) == n and (
            not w or (min(w) >= -1 and max(w) < len(self.segs))
        )

    def expand(self) -> list[list[ObjectReplica] | None]:
        """Per key ``[ObjectReplica([ReplicaDesc(...)])]``, or None without a copy."""
        segs = self.segs
        return [
            None if w < 0 else [ObjectReplica([ReplicaDesc(*segs[w], off, ln)])]
            for w, off, ln in zip(self.where, self.offsets, self.lengths)
        ]


class ReplicateConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a put places its copies.

    * ``replica_num``: copies, each on a different storage node (1 .. MAX_REPLICAS).
    * ``preferred_segment``: try this segment first for every slice of the first copy
      (a hint: other segments are used when it is full or absent).
    * ``strategy``: ``"local"`` prefers segments on ``writer_host`` (the writer's host id,
      so same-host readers copy through shared memory), then the most free; ``"random"``
      draws segments from a generator seeded by the log index (spreads load, same result on
      every replica); ``"most_free"`` takes the segment with the most free bytes.
    * ``soft_pin``: evicted only when nothing unpinned is evictable, until the pin's TTL
      passes; ``hard_pin``: never evicted (removed only explicitly).
    """

    replica_num: int = 1
    preferred_segment: str | None = None
    strategy: Strategy = "local"
    writer_host: str | None = None
    soft_pin: bool = False
    hard_pin: bool = False

    def __post_init__(self) -> None:
        # msgspec checks these types when it decodes a config, not when one is built: a
        # wrong-typed field would otherwise travel to the master and fail only there. (The
        # range of replica_num is the master's to judge: MAX_REPLICAS is its limit.)
        why = _config_error(self)
        if why is not None:
            raise InvalidParams(f"ReplicateConfig: {why}")


_STRATEGIES = frozenset(Strategy.__args__)


def _config_error(c: ReplicateConfig) -> str | None:
    """What is wrong with the types of ``c``'s fields (None: nothing). Explicit checks: a
    ``msgspec.convert`` per field costs ~10 us a config, and the master decodes one per put."""
    if type(c.replica_num) is not int:
        return f"replica_num must be an int, got {c.replica_num!r}"
    for f in ("preferred_segment", "writer_host"):
        v = getattr(c, f)
        if v is not None and type(v) is not str:
            return f"{f} must be a str or None, got {v!r}"
    if type(c.strategy) is not str or c.strategy not in _STRATEGIES:
        return f"strategy must be one of {sorted(_STRATEGIES)}, got {c.strategy!r}"
    for f in ("soft_pin", "hard_pin"):
        if type(getattr(c, f)) is not bool:
            return f"{f} must be a bool, got {getattr(c, f)!r}"
    return None


class SegmentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A mounted segment as the master sees it. ``used`` counts allocated bytes (slices
    rounded up to the allocator's alignment), ``objects`` the slices placed in it.
    ``state`` is ``"mounted"`` or ``"draining"`` (graceful unmount in progress: no new
    allocations, existing copies readable until ``drain_deadline``). ``generation`` is the
    log index of the mount (a re-mounted segment of the same name has a new one)."""

    name: str
    node_id: str
    endpoint: str
    host_id: str
    size: int
    used: int
    objects: int
    state: str = "mounted"
    generation: int = 0
    drain_deadline: float = 0.0
    medium: str = "memory"  # or "disk" (docs/store.md, "Disk tier")


class ObjectLookup(msgspec.Struct, array_like=True, frozen=True):
    """Per-key answer of a read-only lookup. ``code`` is 0 or an error code
    (``ObjectNotFound`` for absent or not yet COMPLETE keys); ``version`` is the log index
    of the put that wrote the object (a new put of the same key gets a new version)."""

    code: int
    size: int = 0
    replicas: list[ObjectReplica] = []
    version: int = 0


ROW = 5
"""int64 per slice in a replica table (:class:`LookupTable`, the ``rows`` of
:class:`~kvmesh.store.protocol.ReplicaTableResp`): key index, copy index, segment index,
offset, length."""


class LookupTable(NamedTuple):
    """The master's answer to a lookup in table form (``StoreStateMachine.lookup_table``):
    per key ``codes``/``sizes``/``versions``; ``segments``: (segment, node_id, endpoint) of
    each segment the rows name; ``rows``: int64 numpy array, one row of :data:`ROW` per slice."""

    codes: list[int]
    sizes: list[int]
    versions: list[int]
    segments: list[tuple[str, str, str]]
    rows: Any
    # per key the crc32c of its COMPLETE disk copy (-1: none); empty when no key has one
    crcs: list[int] = []  # noqa: RUF012 (a NamedTuple default, never mutated)


def replica_lists(t: LookupTable) -> list[list[ObjectReplica] | None]:
    """Per key of ``t`` its copies as objects (None for a key not found): the readable
    form of the same answer (``lookup``, :class:`~kvmesh.store.protocol.ReplicasResp`)."""
    names = t.segments
    out: list[list[ObjectReplica] | None] = [None] * len(t.codes)
    rows = t.rows.tolist()
    r = 0
    while r < len(rows):
        i, copies = rows[r][0], []
        while r < len(rows) and rows[r][0] == i:
            copy, cur = rows[r][1], []
            while r < len(rows) and rows[r][0] == i and rows[r][1] == copy:
                _, _, x, off, ln = rows[r]
                seg, node, ep = names[x]
                cur.append(ReplicaDesc(seg, node, ep, off, ln))
                r += 1
            copies.append(ObjectReplica(cur))
        out[i] = copies
    return out


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Pool totals over mounted (and draining) segments."""

    capacity: int
    used: int
    objects: int
    complete: int
    processing: int
    segments: int
    held_bytes: int = 0  # freed by a forced remove but still held for live leases
    reserved_bytes: int = 0  # reserved for writers' one-round-trip puts, not yet used

    @property
    def ratio(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


def bad_key(keys: list[Any]) -> str | None:
    """Why the first invalid key of ``keys`` is invalid (None if all are valid). The whole batch
    is tried at once first (:func:`keys_valid`); key by key (:func:`key_error`, with a cheap
    accept for plain ASCII keys) only when that declines."""
    if keys_valid(keys):
        return None
    for k in keys:
        if type(k) is str and 0 < len(k) <= MAX_KEY_BYTES and k.isascii() and "\0" not in k:
            continue
        why = key_error(k)
        if why is not None:
            return why
    return None


def bad_parts(prefix: Any, keys: list[Any], suffixes: list[Any]) -> str | None:
    """:func:`bad_key` for the names ``prefix + key + suffix`` (every key, every suffix),
    decided without building them: each key is a valid key on its own (so no name is
    empty), prefix and suffixes are ``str`` without NUL that encode as UTF-8 (so a name has
    NUL or an unencodable code point only if a part has), and the longest prefix + key +
    suffix fits :data:`MAX_KEY_BYTES`. At least one suffix (``""`` names the bare key)."""
    if not suffixes:
        return "no suffixes"
    lens = []
    for part in (prefix, *suffixes):
        if type(part) is not str:
            return "prefix and suffixes must be strings"
        if "\0" in part:
            return "key contains NUL"
        try:
            lens.append(len(part.encode("utf-8")))
        except UnicodeEncodeError:
            return "key is not valid UTF-8 (lone surrogate)"
    if not keys:
        return None
    room = MAX_KEY_BYTES - lens[0] - max(lens[1:])
    if room > 0 and type(keys) is list and len(keys) > 1 and set(map(type, keys)) == {str}:
        # The usual batch (ASCII page keys): the lengths in msgspec's C loop, as keys_valid.
        try:
            _convert(keys, _key_chars(room))
            joined = "".join(keys)
            if "\0" not in joined and joined.isascii():
                return None
        except msgspec.ValidationError:
            pass  # some key is empty or too long: key by key below names which
    longest = _longest_valid(keys)
    if longest is None or longest > room:
        why = bad_key(keys)  # key by key: the first bad one, or the exact longest below
        if why is not None:
            return why
        longest = max(len(k.encode("utf-8")) for k in keys)
    n = lens[0] + longest + max(lens[1:])
    if n > MAX_KEY_BYTES:
        return f"key is {n} bytes, limit {MAX_KEY_BYTES}"
    return None


def key_error(key: object) -> str | None:
    """Why ``key`` is not a valid object key, or None if it is."""
    if not isinstance(key, str):
        return "key must be a str"
    if not key:
        return "key is empty"
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "key is not valid UTF-8 (lone surrogate)"
    if n > MAX_KEY_BYTES:
        return f"key is {n} bytes, limit {MAX_KEY_BYTES}"
    if "\0" in key:
        return "key contains NUL"
    return None


def keys_valid(keys: list[Any]) -> bool:
    """True when every key passes :func:`key_error`, decided for the whole batch at once with
    C-level checks (no Python call per key). False means "check key by key" (some key may be
    invalid, or the batch is not plain ``str`` keys), never that a given key is invalid."""
    if type(keys) is list and len(keys) > 1:
        # The usual batch (plain ASCII keys), with the per-key length tests in msgspec's C
        # loop instead of max(map(len)) and a scan for "": a third of the check's cost.
        if set(map(type, keys)) != {str}:
            return False
        try:
            _convert(keys, _KEY_CHARS)  # 1..MAX_KEY_BYTES characters each
        except msgspec.ValidationError:
            return False  # some key is empty or longer than any valid key
        joined = "".join(keys)
        if "\0" in joined:
            return False
        if joined.isascii():  # one byte per character
            return True
    longest = _longest_valid(keys)
    return longest is not None and longest <= MAX_KEY_BYTES


_KEY_CHARS = list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]]
_ROOM_CHARS: dict[int, Any] = {}  # bad_parts' key types by room left (few distinct values)


def _key_chars(room: int) -> Any:
    t = _ROOM_CHARS.get(room)
    if t is None:
        t = list[Annotated[str, msgspec.Meta(min_length=1, max_length=room)]]
        if len(_ROOM_CHARS) < 256:  # a hostile peer's many prefixes cost a type each, once
            _ROOM_CHARS[room] = t
    return t


_convert = msgspec.convert


def _longest_valid(keys: list[Any]) -> int | None:
    """UTF-8 bytes of the longest key when every key is a non-empty ``str`` without NUL that
    encodes (C-level checks for the whole batch; for a non-ASCII batch a bound of 4 bytes per
    code point); None: check key by key (see :func:`keys_valid`)."""
    if len(keys) == 1:  # a single get: the same checks on the one key, without the set-up
        k = keys[0]
        if type(k) is not str or not k or "\0" in k:
            return None
        if k.isascii():
            return len(k)
        if len(k) * 4 > MAX_KEY_BYTES:
            return None
        try:
            k.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return len(k) * 4
    if set(map(type, keys)) != {str}:  # str subclasses (and empty batches) take the slow path
        return None
    if "" in keys:
        return None
    joined = "".join(keys)
    if "\0" in joined:
        return None
    longest = max(map(len, keys))
    if joined.isascii():  # one byte per character
        return longest
    if longest * 4 > MAX_KEY_BYTES:  # UTF-8 takes at most 4 bytes per code point
        return None
    try:
        joined.encode("utf-8")  # a lone surrogate anywhere fails here, as in key_error
    except UnicodeEncodeError:
        return None
    return longest * 4


_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    # "4g", "4gib" and Mooncake's "4gb" all mean 4 * 2**30.
    _UNITS.update({_p: 1 << (10 * _i), f"{_p}ib": 1 << (10 * _i), f"{_p}b": 1 << (10 * _i)})


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"1g"``, ``"4gb"``, ``"4096"`` -> bytes (binary units); ValueError else."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    try:
        if unit in _UNITS and num and float(num) >= 0:
            return int(float(num) * _UNITS[unit])
    except (ValueError, OverflowError):
        pass
    raise ValueError(f"bad size {text!r} (use e.g. 256MiB, 1GiB, 4gb or bytes)")
