"""SGLang HiCache L3 storage on kvmesh: :class:`KvmeshHiCacheStorage`.

Loaded by SGLang's ``dynamic`` storage backend (docs/sglang.md, "HiCache L3 storage on kvmesh")::

    --enable-hierarchical-cache --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name":"kvmesh","module_path":"kvmesh_sglang.hicache",
      "class_name":"KvmeshHiCacheStorage","interface_v1":1,"master":"10.0.0.1:7700"}'

SGLang constructs it as ``cls(storage_config, {})`` in every scheduler process (one per
TP/PP rank), then hands it the host KV pool (``register_mem_pool_host``). The host pool's
buffers are registered with the process-wide transfer engine once; pages then move between
the pool and the store's segments without a copy in between (``get_page_buffer_meta`` gives
each page's addresses). Only public kvmesh APIs are used: :class:`kvmesh.StoreClient` and
:func:`kvmesh.transfer.get_engine`.

Object names keep apart everything a page hash does not say (docs/sglang.md, "What it does
with SGLang's calls"):
``{namespace}/{model}/{layout}/{dtype}/ps{page_size}/{hash}/{shard}/{component}``, where the
shard is ``tp{rank}of{size}`` for MHA (K and V are separate objects, so ranks never share)
and ``mla`` for rank-replicated MLA KV (one object, shared by the ranks), each followed by
``pp{rank}of{size}`` and ``cp{rank}of{size}`` when those are used (an MLA model's
rank-private sidecar objects: ``mlatp{rank}of{size}``). Namespace and model are
percent-quoted (no model name is ``-``, a model named ``-`` is ``%2D``), layout and dtype
when they hold ``/`` or ``%``: no two configurations produce the same name
(tests/plugins/test_hicache_names.py).

Failure rule: a call never raises into SGLang's prefetch/backup threads; a page that cannot
be read or written is a miss (``False``, or the end of the prefix count). A read counts only
if it filled the page's exact byte count before its lease ended (the store answers
LeaseExpired otherwise), so a page is either the stored bytes or a miss.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvmesh import StoreClient
from kvmesh.store import errors as store_errors
from kvmesh.store import parse_size
from kvmesh.transfer import get_engine

try:  # Both supported SGLang versions have these; without SGLang the module still imports.
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError:  # pragma: no cover - exercised only where SGLang is absent
    HiCacheStorage = object  # type: ignore[assignment,misc]
    HiCacheStorageConfig = HiCacheStorageExtraInfo = PoolTransfer = Any  # type: ignore[misc]
    PoolHitPolicy = PoolName = PoolTransferResult = None  # type: ignore[assignment,misc]

__all__ = ["KvmeshHiCacheConfig", "KvmeshHiCacheStorage", "load_config", "ENV_PREFIX"]

log = logging.getLogger("kvmesh.sglang.hicache")

ENV_PREFIX = "KVMESH_HICACHE_"
ENV_CONFIG_FILE = ENV_PREFIX + "CONFIG"

# Extra-config keys that belong to SGLang (or its dynamic loader), not to kvmesh: they stay
# in storage_config.extra_config and are ignored here (docs/sglang.md, "Configuration").
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max", "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})  # fmt: skip


class KvmeshHiCacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the backend needs to reach the store (docs/sglang.md, HiCache "Configuration").

    ``master``: store master addresses (``"h1:7700,h2:7700"``); empty or ``"embedded"``: an
    in-process single-host store (this process only). ``segment_size``: bytes this process
    contributes to the store pool (default: the store's, i.e. 0 with a master, 256 MiB
    embedded); ``token``: the cluster's shared secret (default ``KVMESH_TOKEN``);
    ``namespace``: keeps deployments apart; ``replica_num``: copies per page;
    ``timeout_s``: how long one metadata call keeps retrying (also the attach probe);
    ``transfer_timeout_s``: bound of one batch's data movement; ``down_backoff_s``: after the
    store was unreachable, calls answer "miss" at once for this long instead of waiting.
    """

    master: str = ""
    segment_size: int | None = None
    token: str | None = None
    namespace: str = "default"
    replica_num: int = 1
    timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    down_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("namespace must not be empty")
        if self.segment_size is not None and self.segment_size < 0:
            raise ValueError(f"segment_size must be >= 0, got {self.segment_size}")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be >= 1, got {self.replica_num}")
        for f in ("timeout_s", "transfer_timeout_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0")
        if self.down_backoff_s < 0:
            raise ValueError("down_backoff_s must be >= 0")

    @property
    def embedded(self) -> bool:
        return self.master.strip() in ("", "embedded")


_FIELDS = KvmeshHiCacheConfig.__struct_fields__


def _size(v: Any) -> Any:
    """``"256MiB"``/``"1g"``/``"1024"`` and Mooncake's ``"4gb"``/``"512mb"`` -> bytes; other
    types pass through to the config's own validation."""
    return parse_size(v) if isinstance(v, str) else v


def load_config(extra_config: dict | None = None, env: dict | None = None) -> KvmeshHiCacheConfig:
    """Merge, per field, from lowest to highest priority: defaults, ``KVMESH_HICACHE_*``
    environment variables, the JSON file named by ``config_file`` in the extra-config (or by
    ``KVMESH_HICACHE_CONFIG``), and the extra-config itself. Raises ``ValueError`` naming
    the bad field and where it came from."""
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in _FIELDS:
        v = env.get(ENV_PREFIX + f.upper())
        if v is not None and v != "":
            merged[f], sources[f] = v, ENV_PREFIX + f.upper()
    path = extra.pop("config_file", None) or env.get(ENV_CONFIG_FILE)
    if path:
        try:
            with open(path, "rb") as fh:
                data = json.loads(fh.read())
        except (OSError, ValueError) as e:
            raise ValueError(f"kvmesh HiCache config file {path!r}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kvmesh HiCache config file {path!r}: not a JSON object")
        bad = sorted(set(data) - set(_FIELDS))
        if bad:
            raise ValueError(f"kvmesh HiCache config file {path!r}: unknown keys {bad}")
        for k, v in data.items():
            merged[k], sources[k] = v, path
    unknown = sorted(k for k in extra if k not in _FIELDS and k not in SGLANG_KEYS)
    if unknown:
        raise ValueError(
            f"kvmesh HiCache extra-config: unknown keys {unknown} "
            f"(kvmesh keys: {list(_FIELDS)} and config_file)"
        )
    for k in _FIELDS:
        if k in extra:
            merged[k], sources[k] = extra[k], "extra-config"
    try:
        if "segment_size" in merged:
            merged["segment_size"] = _size(merged["segment_size"])
        # Environment values are strings: let msgspec coerce them ("1" -> 1).
        return msgspec.convert(merged, KvmeshHiCacheConfig, strict=False)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        where = ", ".join(f"{k} from {s}" for k, s in sorted(sources.items()))
        raise ValueError(
            f"kvmesh HiCache config is invalid: {e} (given: {where or 'defaults'})"
        ) from None


# --------------------------------------------------------------------------------- naming


def _quote(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _model_part(model: Any) -> str:
    """The model's name segment, one per model: ``-`` for no name (None), the percent-quoted
    name otherwise (``""`` is an empty segment), except that a model literally named ``-``
    is ``%2D``: quoting never writes that, and never a ``/``, so the segment is injective
    (None, ``""`` and ``"-"`` all used to be ``-``: two such deployments read each other's
    pages)."""
    if model is None:
        return "-"
    if not isinstance(model, str):
        raise ValueError(f"kvmesh HiCache: model_name must be a str or None, got {model!r}")
    q = _quote(model)
    return "%2D" if q == "-" else q


def _segment(s: str) -> str:
    """``s`` as one name segment: as it is without ``/`` and ``%`` (every layout and dtype
    SGLang has: their names stay), else percent-quoted, which always writes a ``%``:
    injective either way, never a ``/``."""
    return s if "/" not in s and "%" not in s else _quote(s)


def _dtype_name(dtype: Any) -> str:
    return _segment(str(dtype).removeprefix("torch."))


def _rank(cfg: Any, what: str, rank: str, size: str) -> tuple[int, int]:
    """``cfg``'s (rank, size) of one parallelism, checked: a name made of a rank outside its
    group, or of a non-int, would not say which shard it is."""
    r, n = getattr(cfg, rank, 0), getattr(cfg, size, 1)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (r, n)) or not (0 <= r < n):
        raise ValueError(f"kvmesh HiCache: {what} rank {r!r} of size {n!r} is not a rank")
    return int(r), int(n)


class _Shards(msgspec.Struct, frozen=True):
    """This rank's object-name parts (see the module docstring)."""

    prefix: str  # "{ns}/{model}/{layout}/{dtype}/ps{page}/"
    rank: str  # "tp{r}of{n}[/pp..][/cp..]": rank-private objects
    shared: str  # "mla[/pp..][/cp|dcp..]" for rank-replicated KV, else == rank


def _namespace_prefix(namespace: str, model: Any) -> str:
    """``{namespace}/{model}/``: every name of one deployment starts with it, and with no
    other deployment's (both segments are quoted: no ``/`` inside)."""
    return f"{_quote(namespace)}/{_model_part(model)}/"


def _shards(cfg: Any, namespace: str, layout: str, dtype: Any, page_size: int) -> _Shards:
    # Injective over configurations (tests/plugins/test_hicache_names.py): the five prefix
    # segments are quoted (no "/" inside); the shard's first segment alone starts with
    # "tp" or "mla", so the shard part cannot be confused with the end of a page hash.
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"kvmesh HiCache: page size {page_size!r} is not a positive int")
    prefix = (
        f"{_namespace_prefix(namespace, getattr(cfg, 'model_name', None))}"
        f"{_segment(str(layout))}/{_dtype_name(dtype)}/ps{page_size}/"
    )
    tp, tp_n = _rank(cfg, "TP", "tp_rank", "tp_size")
    pp, pp_n = _rank(cfg, "PP", "pp_rank", "pp_size")
    cp, cp_n = _rank(cfg, "CP", "attn_cp_rank", "attn_cp_size")
    tail = ""
    if pp_n > 1:
        tail += f"/pp{pp}of{pp_n}"
    if cp_n > 1:
        tail += f"/cp{cp}of{cp_n}"
    rank = f"tp{tp}of{tp_n}{tail}"
    if getattr(cfg, "is_mla_model", False):
        # An MLA model's rank-private objects (its Mamba and MHA-shaped sidecar pools) are
        # named apart from an MHA model's: is_mla_model is a field like any other.
        rank = f"mla{rank}"
        dcp = ""
        d, d_n = _rank(cfg, "DCP", "dcp_rank", "dcp_size")
        if d_n > 1:
            # Equivalent MLA shards of different DCP groups share objects; the topology
            # and logical page size must match (as in SGLang's own backends).
            dcp = f"/dcp{d}of{d_n}tp{tp_n}"
        return _Shards(prefix, rank, f"mla{tail}{dcp}")
    return _Shards(prefix, rank, rank)


class _Plan(msgspec.Struct):
    """One call's objects: names and, per object, its address and length (``multi``: lists of
    addresses and lengths whose bytes the object holds in order); ``totals``: bytes each."""

    names: list[str] | None  # None: named by ``parts`` (see object_names)
    ptrs: Any  # one range per object: an int64 column (or a list); multi: lists per object
    sizes: Any
    totals: list[int]
    multi: bool
    per_page: int  # objects per page (MHA: 2, MLA: 1)
    # Resolved form (a get from a pool whose page table knows its registered regions):
    # ``ptrs`` are offsets into ``regions[reg]`` (columns as for the raw form), not addresses.
    regions: Any = None
    reg: Any = None
    # (_Names, page keys, components) when ``names`` is None: a resolved get sends the store
    # the parts (one prefix, the keys, a suffix per component) and the master joins them,
    # so the plan builds no names (a 256-page get of 4 KiB pages 1.006-1.013x as fast,
    # measured old/new interleaved in one run of bench/hicache.py's same-host-4k case)
    parts: Any = None

    def object_names(self) -> list[str]:
        """The objects' names, in order (built here for a plan named by parts)."""
        if self.names is None:
            obj, keys, comps = self.parts
            return obj.names(keys, comps)
        return self.names

    @staticmethod
    def join(plans: Sequence[_Plan]) -> _Plan:
        multi = any(p.multi for p in plans)

        def lists(p: _Plan, xs: Any) -> list[Any]:
            xs = xs.tolist() if hasattr(xs, "tolist") else xs  # a plan's numpy columns
            return xs if p.multi or not multi else [[x] for x in xs]

        return _Plan(
            [n for p in plans for n in p.object_names()],
            [x for p in plans for x in lists(p, p.ptrs)],
            [x for p in plans for x in lists(p, p.sizes)],
            [x for p in plans for x in p.totals],
            multi,
            1,
        )


def _is_mha(pool: Any) -> bool:
    # MHA host pools keep K and V apart (get_hybrid_pool_buffer() == [k, v]); their page
    # meta alternates K and V pointers (page_first: [k, v]; layer_first: [k0, v0, k1, ...]).
    return (
        hasattr(pool, "v_buffer")
        and hasattr(pool, "head_num")
        and not hasattr(pool, "kv_lora_rank")
    )


# Host pools whose get_page_buffer_meta is, per page, ``base[j] + first_slot * stride[j]``
# with fixed sizes (the SGLang code of both versions; docs/sglang.md, "Page addresses"):
# class name -> layouts. Anything else (subclasses, split-KV and DCP layouts, sidecar pools)
# asks SGLang.
_AFFINE = {
    "MHATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "MLATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct"),
}


class _PageTable:
    """``pool.get_page_buffer_meta`` as a table, measured once per pool (at registration):
    page ``i``'s pointers are ``base + first_slot[i] * stride`` and its sizes ``sizes``.
    A batch's addresses are then one numpy expression instead of SGLang's Python loop over
    pages x layers (layer_first: 64 pointers per MHA page). Used only for the pool classes
    and layouts of :data:`_AFFINE`, and only when SGLang's own answers for probe pages
    across the pool (one at a time and together in one call) equal the table's exactly."""

    __slots__ = ("base", "stride", "sizes", "pages", "page_size", "regions", "_cols")

    def __init__(
        self, base: Any, stride: Any, sizes: list[int], pages: int = 0, page_size: int = 1
    ) -> None:
        self.base, self.stride, self.sizes = base, stride, sizes
        self.pages, self.page_size = pages, page_size
        self.regions: list[Any] | None = None  # set by resolve()
        self._cols: dict[Any, Any] = {}

    def resolve(self, regions: Sequence[Any]) -> None:
        """Find, once, the registered region holding each buffer's pages of the whole pool
        (``regions``: the backend's registrations), so that a get names its pages as region
        offsets and the client looks no address up per call. A buffer outside every region
        leaves the table unresolved (gets then pass raw addresses)."""
        last = (self.pages - 1) * self.page_size
        reg, off = [], []
        for b, st, z in zip(self.base.tolist(), self.stride.tolist(), self.sizes):
            hi = max(b, b + st * last) + z
            lo = min(b, b + st * last)
            hit = next(
                (i for i, r in enumerate(regions) if r.ptr <= lo and hi <= r.ptr + r.size), None
            )
            if hit is None:
                return
            reg.append(hit)
            off.append(b - regions[hit].ptr)
        self.regions = list(regions)
        self._cols = {"reg": np.array(reg, np.int64), "off": np.array(off, np.int64)}

    @staticmethod
    def measure(pool: Any, page_size: int) -> _PageTable | None:
        import torch

        layouts = _AFFINE.get(type(pool).__name__, ())
        if getattr(pool, "layout", None) not in layouts or getattr(pool, "dcp_size", 1) > 1:
            return None
        try:
            if int(pool.page_size) != page_size:
                return None
            pages = int(pool.size) // page_size
            if pages < 2:
                return None

            def meta(starts: list[int]) -> tuple[list[int], list[int]]:
                idx = torch.tensor(
                    [p * page_size + j for p in starts for j in range(page_size)],
                    dtype=torch.int64,
                )
                ptrs, sizes = pool.get_page_buffer_meta(idx)
                return [int(x) for x in ptrs], [int(x) for x in sizes]

            p0, s0 = meta([0])
            p1, s1 = meta([1])
            if not p0 or len(p0) != len(s0) or p1 is None or s1 != s0:
                return None
            base = np.array(p0, np.int64)
            step = np.array(p1, np.int64) - base
            if (step % page_size).any():
                return None
            table = _PageTable(base, step // page_size, s0, pages, page_size)
            probes = sorted({0, 1, 2 % pages, pages // 2, pages - 1})
            mixed = [pages - 1, 0, pages // 2, 1]
            for starts in [[p] for p in probes] + [mixed]:
                ptrs, sizes = meta(starts)
                want, _ = table.meta([p * page_size for p in starts])
                if ptrs != want.reshape(-1).tolist() or sizes != s0 * len(starts):
                    return None
            return table
        except Exception:  # noqa: BLE001 - not measurable: SGLang's meta is asked instead
            return None

    def meta(self, first: Any) -> tuple[Any, list[int]]:
        """Pointers ``[page, j]`` (int64) for the pages starting at slots ``first``."""
        f = np.asarray(first, dtype=np.int64).reshape(-1, 1)
        return self.base + f * self.stride, self.sizes

    def objects(self, step: int) -> Any:
        """The buffers arranged per object, ``step`` objects a page (MHA: K then V; MLA:
        one), computed once per arrangement: region offsets and strides per page in object
        order (flat; Python ints for one range a page), sizes and region indexes as
        ``(step, ranges)`` arrays and as what the client may broadcast (one value, or one row
        for every object; None: neither), and the objects' byte totals. None: the table is
        unresolved, or its buffers do not split into ``step`` objects."""
        hit = self._cols.get(step)
        if hit is None and self.regions is not None and len(self.sizes) % step == 0:

            def arrange(v: Any) -> Any:  # [buffer] -> [object, range]: K even, V odd
                return np.asarray(v, np.int64).reshape(-1, step).T.copy()

            def wide(a: Any) -> Any:
                return int(a[0, 0]) if (a == a[0, 0]).all() else a[0] if step == 1 else None

            z, reg = arrange(self.sizes), arrange(self._cols["reg"])
            off, stride = arrange(self._cols["off"]).reshape(-1), arrange(self.stride).reshape(-1)
            if len(off) == 1:
                off, stride = int(off[0]), int(stride[0])
            hit = self._cols[step] = (off, stride, z, reg, wide(z), wide(reg), z.sum(1).tolist())
        return hit


def _plan(
    pool: Any,
    keys: Sequence[str],
    host_indices: Any,
    obj: _Names,
    mha: bool,
    table: _PageTable | None = None,
    page_size: int = 0,
    resolved: bool = False,
    slots: Any = None,
) -> _Plan:
    """Object names and addresses for ``keys`` whose slots are ``host_indices`` in ``pool``
    (from ``table`` when the pool has one: the same numbers as SGLang's meta). ``resolved``:
    region offsets instead of addresses where the table knows its regions (a get's form);
    ``slots``: ``host_indices`` as numpy (:func:`_slots`) when the caller has it."""
    n = len(keys)
    comps = ("k", "v") if mha else ("kv",)
    if slots is None and table is not None:
        slots = _slots(host_indices)  # one torch call: each costs more than a numpy op
    if table is not None and n and len(slots) == n * page_size:
        first = slots[::page_size]
        cols = table.objects(len(comps)) if resolved else None
        if cols is not None:
            return _resolved(table, (obj, keys, comps), first, cols)
        names = obj.names(keys, comps)
        grid, sz = table.meta(first)  # [page, buffer]
        per = grid.shape[1]
        if per == len(comps):  # one range per object, in name order: numpy columns as they are
            one = len(set(sz)) == 1  # K and V (or the one KV range) of equal size
            sizes = np.full(n * per, sz[0], np.int64) if one else np.tile(np.array(sz), n)
            return _Plan(names, grid.reshape(-1), sizes, sz * n, False, len(comps))
        if per % len(comps) == 0:
            step = len(comps)
            # [page, buffer] -> [page, comp, range]: MHA K takes the even buffers, V the odd.
            objs = grid.reshape(n, per // step, step).transpose(0, 2, 1).reshape(n * step, -1)
            osz = np.array([sz[c::step] for c in range(step)], np.int64)
            # Columns to the client as they are: (objects, ranges) addresses and sizes.
            return _Plan(
                names,
                objs,
                np.tile(osz, (n, 1)),
                osz.sum(axis=1).tolist() * n,
                True,
                step,
            )
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if n == 0 or len(ptrs) % n or len(ptrs) != len(sizes):
        raise ValueError(f"{len(ptrs)} page buffers for {n} keys")
    per = len(ptrs) // n
    if mha and per % 2:
        raise ValueError(f"MHA page meta with {per} buffers per page (expected K/V pairs)")
    names = obj.names(keys, comps)
    if per == len(comps):
        # One contiguous range per object (page_first layouts): the meta is already in
        # name order (MHA: k, v per page).
        return _Plan(names, list(ptrs), list(sizes), list(sizes), False, len(comps))
    # Several ranges per object (layer_first): MHA K takes the even pointers, V the odd.
    step = len(comps)
    mp, ms = [], []
    for i in range(n):
        b = i * per
        for c in range(step):
            mp.append(ptrs[b + c : b + per : step])
            ms.append(sizes[b + c : b + per : step])
    return _Plan(names, mp, ms, [sum(x) for x in ms], True, len(comps))


def _resolved(table: _PageTable, parts: Any, first: Any, cols: Any) -> _Plan:
    """:func:`_plan` in region offsets: one multiply-add per page (Python-int factors for
    one range a page); region indexes and sizes as one value or one row where they allow."""
    off0, stride, z, reg, z1, reg1, tot = cols
    step, r = z.shape
    n = len(first)
    if type(off0) is int:  # each numpy op costs ~5 us after a get has cooled the caches
        off = first * stride + off0 if off0 else first * stride
    else:  # [page, object x range] -> [object, range] rows
        off = (first.reshape(-1, 1) * stride + off0).reshape(n * step, r)
        if r == 1:
            off = off.reshape(-1)
    if z1 is None or reg1 is None:  # the objects of a page differ: their rows, page by page
        shape = -1 if r == 1 else (n * step, r)
        z1 = np.tile(z, (n, 1)).reshape(shape) if z1 is None else z1
        reg1 = np.tile(reg, (n, 1)).reshape(shape) if reg1 is None else reg1
    return _Plan(None, off, z1, tot * n, r > 1, step, table.regions, reg1, parts)


class _Slots:
    """A CPU int64 tensor's slots as numpy sees them through the array interface (read-only,
    valid while the tensor lives: a plan's own call)."""

    __slots__ = ("__array_interface__",)


_TORCH_INT64: Any = None


def _slots(host_indices: Any) -> Any:
    """The host slots as numpy. A contiguous CPU int64 tensor (SGLang's host indices) is
    viewed through four attribute reads: ``Tensor.numpy()`` costs ~50 us once a get has
    cooled the caches, a tenth of a 256-page batch of 4 KiB (bench/hicache.py). Others: the
    tensor's own conversion (copied to the host first when it lives elsewhere)."""
    global _TORCH_INT64
    if not hasattr(host_indices, "numpy"):
        return np.asarray(host_indices, np.int64)  # a list: never list * int in a plan
    if _TORCH_INT64 is None:
        import torch

        _TORCH_INT64 = torch.int64
    t = host_indices
    if t.dtype is _TORCH_INT64 and t.is_cpu and t.is_contiguous():
        v = _Slots()
        v.__array_interface__ = {
            "data": (t.data_ptr(), True),
            "shape": (t.numel(),),
            "typestr": _NATIVE_I8,
            "version": 3,
        }
        return np.asarray(v)
    try:
        return t.numpy()  # refused for device or autograd tensors
    except (TypeError, RuntimeError):
        return t.detach().cpu().numpy()


_NATIVE_I8 = "<i8" if sys.byteorder == "little" else ">i8"


def _pool_names(
    sh: _Shards, mla_model: bool, pool: str = "kv", pool_mha: bool | None = None
) -> _Names:
    """The names of one pool's objects (``pool``: SGLang's pool name, ``"kv"`` the main KV
    pool; ``pool_mha``: whether the pool keeps K and V apart, default: as the model).
    Rank-replicated pools of an MLA model -- its KV and the sidecar pools that are not
    MHA-shaped -- are shared by the ranks; Mamba state is TP-sharded whatever the
    attention is; the rest is rank-private."""
    if pool_mha is None:
        pool_mha = not mla_model
    shared = mla_model and pool != "mamba" and not pool_mha
    return _Names(sh.prefix, sh.shared if shared else sh.rank, "" if pool == "kv" else pool)


class _Names:
    """Object names of one shard (and pool): ``{prefix}{hash}/{shard}{/pool}/{component}``."""

    __slots__ = ("pre", "mid")

    def __init__(self, prefix: str, shard: str, pool_tag: str = "") -> None:
        self.pre = prefix
        self.mid = f"/{shard}/{pool_tag}/" if pool_tag else f"/{shard}/"

    def __call__(self, key: str, comp: str) -> str:
        return f"{self.pre}{key}{self.mid}{comp}"

    def suffixes(self, comps: Sequence[str]) -> list[str]:
        """One per component: the object of page ``key`` is ``pre + key + suffix``."""
        return [self.mid + c for c in comps]

    def names(self, keys: Sequence[str], comps: Sequence[str]) -> list[str]:
        # Two pieces per name (the suffix joined once): a third of a 256-page plan's cost.
        pre = self.pre
        sufs = self.suffixes(comps)
        if len(sufs) == 1:
            suf = sufs[0]
            return [f"{pre}{k}{suf}" for k in keys]
        out: list[str] = [""] * (len(keys) * len(sufs))
        for c, suf in enumerate(sufs):
            out[c :: len(sufs)] = [f"{pre}{k}{suf}" for k in keys]
        return out


# ------------------------------------------------------------------------------- failures


def _guard(default: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Never raise into SGLang's storage threads: log, count, answer ``default(self, *args)``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def answer(self: KvmeshHiCacheStorage, args: Any, kwargs: Any) -> Any:
            try:
                return default(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - arguments too bad to shape a reply
                return None

        def inner(self: KvmeshHiCacheStorage, *args: Any, **kwargs: Any) -> Any:
            if time.monotonic() < self._down_until:
                # Fast miss; it must not push the window further, or a busy caller would
                # never give the store another try.
                self._counters.add(errors=1)
                return answer(self, args, kwargs)
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the whole point: SGLang's thread survives
                if isinstance(e, store_errors.StoreUnavailable):
                    # Answer misses at once for a while instead of every caller waiting out
                    # the RPC deadline while the master is down or restarting.
                    self._down_until = max(
                        self._down_until, time.monotonic() + self.config.down_backoff_s
                    )
                self._failed(fn.__name__, e)
                return answer(self, args, kwargs)

        return inner

    return wrap


def _all_false(self: Any, keys: Sequence[str], *a: Any, **k: Any) -> list[bool]:
    return [False] * len(keys)


def _v2_false(self: Any, transfers: Sequence[Any], *a: Any, **k: Any) -> dict[str, list[bool]]:
    return {
        str(t.name.value if hasattr(t.name, "value") else t.name): [False] * len(t.keys or [])
        for t in transfers
    }


def _whole(res: Sequence[Any]) -> Sequence[Any]:
    """Raise when the whole batch failed for want of a master (the store answers that per key),
    so that the guard backs off; otherwise the per-key results."""
    if res and all(isinstance(r, store_errors.StoreUnavailable) for r in res):
        raise res[0]
    return res


def block_group_pages(found: Sequence[bool], block_pages: int, group_pages: int, span: int) -> int:
    """SGLang 0.5.23's ``PoolHitPolicy.BLOCK_GROUPS`` verdict for one pool (its docstring in
    ``sglang/srt/mem_cache/hicache_storage.py``: "whole key groups at block boundaries from
    the span start ... The pool reports the pages its leading complete groups cover as its
    own verdict; it never gates the KV hit"; ``PoolTransfer.block_pages``: FULL pages per
    block, ``group_pages``: keys per group).

    ``found``: per key of the pool's transfer, whether its objects all exist. Group ``g`` is
    keys ``[g * group_pages, (g + 1) * group_pages)`` and covers the span's pages
    ``[g * block_pages, (g + 1) * block_pages)``; the leading groups whose every key exists
    count, a trailing partial group never does. The result is capped at the ``span`` pages
    of the call. Geometry that is not positive covers nothing."""
    if block_pages <= 0 or group_pages <= 0:
        return 0
    groups = 0
    for g in range(len(found) // group_pages):
        if not all(found[g * group_pages : (g + 1) * group_pages]):
            break
        groups += 1
    return min(groups * block_pages, span)


def _pool_result(kv: int, hits: dict[str, int], restorable: list[int]) -> Any:
    try:  # 0.5.23: the set of usable prefix lengths
        return PoolTransferResult(kv, hits, restorable)
    except TypeError:  # 0.5.14
        return PoolTransferResult(kv, hits)


_FOLD = 256  # v1 batches queued by _Counters.io before they are folded in


class _Counters:
    """Hits, misses, bytes and latencies since the last ``get_stats`` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> dict[str, Any]:
        with self._lock:
            if hasattr(self, "_io"):
                self._fold()
            self._io: list[tuple[str, int, int, int, float]] = []
            old = getattr(self, "_v", None)
            self._v: dict[str, Any] = {
                "get_pages": 0, "get_hits": 0, "get_misses": 0, "get_bytes": 0,
                "set_pages": 0, "set_written": 0, "set_existing": 0, "set_failed": 0,
                "set_bytes": 0, "exists_calls": 0, "errors": 0,
                "get_seconds": [], "set_seconds": [], "exists_seconds": [],
                "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                "backup_bandwidth": [],
            }  # fmt: skip
        return old or {}

    def add(self, **kv: Any) -> None:
        with self._lock:
            for k, v in kv.items():
                if isinstance(self._v[k], list):
                    if len(self._v[k]) < 10000:  # bounded if nobody collects
                        self._v[k].append(v)
                else:
                    self._v[k] += v

    def io(self, kind: str, pages: int, done: int, nbytes: int, dt: float) -> None:
        """One v1 batch (``kind``: ``"get"`` or ``"set"``): one tuple appended under the lock,
        folded into the counters every :data:`_FOLD` batches and on every read of them. The
        dict updates per batch cost a 4 KiB-page get ~1 % of its time after the RPC has
        cooled the caches (bench/hicache.py)."""
        with self._lock:
            q = self._io
            q.append((kind, pages, done, nbytes, dt))
            if len(q) >= _FOLD:
                self._fold()

    def _fold(self) -> None:
        """Apply the batches :meth:`io` queued (the lock held)."""
        v, q = self._v, self._io
        for kind, pages, done, nbytes, dt in q:
            if kind == "get":
                v["get_pages"] += pages
                v["get_hits"] += done
                v["get_misses"] += pages - done
                v["get_bytes"] += nbytes
                lists = ("get_seconds", "prefetch_pgs", "prefetch_bandwidth")
            else:
                v["set_pages"] += pages
                v["set_written"] += done
                v["set_failed"] += pages - done
                v["set_bytes"] += nbytes
                lists = ("set_seconds", "backup_pgs", "backup_bandwidth")
            for k, x in zip(lists, (dt, pages, nbytes / dt / 1e9 if dt > 0 else 0.0)):
                if len(v[k]) < 10000:  # bounded if nobody collects
                    v[k].append(x)
        q.clear()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self._fold()
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self._v.items()}


# -------------------------------------------------------------------------------- backend


class KvmeshHiCacheStorage(HiCacheStorage):  # type: ignore[misc,valid-type]
    """SGLang's L3 KV page store on kvmesh (see the module docstring).

    ``kwargs`` is SGLang's empty dict (dynamic backends are built as ``cls(config, {})``);
    a :class:`kvmesh.StoreClient` may be passed as ``kwargs["client"]`` (tests, embedding).
    """

    def __init__(self, storage_config: Any = None, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.storage_config = storage_config
        self.config = load_config(extra)
        self.registered_pools: dict[Any, Any] = {}
        self.mem_pool_host: Any = None
        self._reg_lock = threading.Lock()
        self._registered: dict[tuple[int, int], Any] = {}  # span -> engine region
        self._counters = _Counters()
        self._log_lock = threading.Lock()
        self._last_log: dict[str, float] = {}
        self._closed = False
        self._down_until = 0.0
        self._shards: _Shards | None = None
        self._parts: tuple[str, list[str]] | None = None  # batch_exists name parts
        self._kv_names: _Names | None = None  # the main pool's, from its registration on
        # id(pool) -> (pool, its page table or None, its page size): measured once per pool;
        # the pool is held so that its id cannot name another pool later.
        self._tables: dict[int, tuple[Any, _PageTable | None, int]] = {}
        self._mha = not bool(getattr(storage_config, "is_mla_model", False))
        given = kwargs.get("client") if isinstance(kwargs, dict) else None
        self._own_client = given is None
        self.client: StoreClient = given or self._connect()

    def _connect(self) -> StoreClient:
        c = self.config
        where = "an embedded single-host store" if c.embedded else f"the store at {c.master}"
        try:
            client = StoreClient(
                None if c.embedded else c.master,
                segment_size=c.segment_size,
                replica_num=c.replica_num,
                token=c.token,
                engine=get_engine(),  # the process-wide engine, shared with the PD plugin
                timeout=c.timeout_s,
                transfer_timeout=c.transfer_timeout_s,
            )
        except Exception as e:
            raise RuntimeError(f"kvmesh HiCache: cannot attach to {where}: {e}") from e
        try:
            # Fail the attach now rather than on the first prefetch: one metadata RPC.
            probe = client.exists([f"{_quote(c.namespace)}/.attach-probe"])[0]
            if isinstance(probe, Exception):
                raise probe
        except Exception as e:
            client.close()
            raise RuntimeError(
                f"kvmesh HiCache: {where} did not answer ({e}); check 'master', 'token' "
                f"(or {ENV_PREFIX}MASTER / KVMESH_TOKEN) and that the master runs"
            ) from e
        return client

    # ------------------------------------------------------------------ helpers

    def _failed(self, what: str, e: BaseException) -> None:
        self._counters.add(errors=1)
        now = time.monotonic()
        with self._log_lock:  # at most one line per call kind every 10 s
            if now - self._last_log.get(what, -1e9) < 10.0:
                return
            self._last_log[what] = now
        log.warning("kvmesh HiCache %s failed (pages count as misses): %s", what, e)

    def _names(self) -> _Shards:
        if self._shards is None:
            raise RuntimeError("register_mem_pool_host() was not called")
        return self._shards

    def _obj(self, pool: str = "kv", pool_mha: bool | None = None) -> _Names:
        if pool == "kv" and pool_mha is None:  # the v1 calls' names: made once per pool
            kv = self._kv_names
            if kv is None:
                kv = self._kv_names = _pool_names(self._names(), not self._mha)
            return kv
        return _pool_names(self._names(), not self._mha, pool, pool_mha)

    def _register(self, tensors: Sequence[Any]) -> None:
        for t in tensors:
            if t is None:
                continue
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            span = (int(t.data_ptr()), int(nbytes))
            with self._reg_lock:
                if span in self._registered:
                    continue
                self._registered[span] = self.client.register_buffer(span[0], span[1])

    @staticmethod
    def _buffers(pool: Any) -> list[Any]:
        get = getattr(pool, "get_hybrid_pool_buffer", None)
        bufs = list(get()) if get is not None else []
        return bufs or [getattr(pool, "kv_buffer", None)]

    def _table(self, pool: Any) -> tuple[_PageTable | None, int]:
        """``pool``'s page table (None: SGLang's meta is asked per call) and page size."""
        hit = self._tables.get(id(pool))
        if hit is None or hit[0] is not pool:
            ps = self._page_size(pool)
            # Idempotent: two threads measuring at once store equal tables.
            table = _PageTable.measure(pool, ps)
            if table is not None:
                with self._reg_lock:
                    regions = list(self._registered.values())
                table.resolve(regions)
            hit = self._tables[id(pool)] = (pool, table, ps)
        return hit[1], hit[2]

    def _page_size(self, pool: Any) -> int:
        cfg = self.storage_config
        if pool is self.mem_pool_host and getattr(cfg, "dcp_size", 1) > 1:
            return int(cfg.logical_page_size)
        return int(getattr(pool, "page_size", 1) or 1)

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        self._shards = _shards(
            self.storage_config,
            self.config.namespace,
            str(getattr(pool, "layout", "?")),
            getattr(pool, "dtype", "?"),
            self._page_size(pool),
        )
        self._mha = not bool(getattr(self.storage_config, "is_mla_model", False))
        self._parts = None
        self._kv_names = None
        if getattr(pool, "kv_buffer", None) is None:
            return  # a logical anchor (DeepSeek-V4): the sidecar pools carry the bytes
        # Registered once: afterwards every page moves straight between this memory and
        # the store's segments.
        self._register(self._buffers(pool))
        self._tables.pop(id(pool), None)  # its page size may differ as the main pool (DCP)
        self._table(pool)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if _pool_key(host_pool_name) == "kv":
            return  # the anchor, registered by register_mem_pool_host
        self._register(self._buffers(host_pool))

    def on_host_pools_registered(self) -> None:
        """0.5.23: nothing to finish (pools are registered as they arrive)."""

    # ------------------------------------------------------------------ v1 (zero copy)

    def _get_plan(self, plan: _Plan) -> list[bool]:
        """Read every object of ``plan`` in one store batch; per object: complete or not."""
        if plan.regions is not None:  # a resolved plan: named by parts (_resolved)
            obj, keys, comps = plan.parts
            res = self.client.get_into_regions(
                keys, plan.regions, plan.reg, plan.ptrs, plan.sizes,
                prefix=obj.pre, suffixes=obj.suffixes(comps),
            )  # fmt: skip
        elif plan.multi:
            res = self.client.get_into_multi(plan.names, plan.ptrs, plan.sizes)
        else:
            res = self.client.get_into_raw(plan.names, plan.ptrs, plan.sizes)
        totals = plan.totals
        if res == totals:  # every object read whole (the usual batch): one C-level compare
            return [True] * len(totals)
        _whole(res)  # after the compare: no whole-batch failure in the usual batch
        # Exactly the page's bytes, or a miss (a shorter object is not this page).
        return [type(r) is int and r == t for r, t in zip(res, totals)]

    def _set_plan(self, plan: _Plan) -> list[bool]:
        """Write every object of ``plan`` in one store batch (write-once: an existing
        object is a success and is not rewritten); per object: stored or not."""
        if plan.multi:
            # Many ranges per object (layer_first): resolving them costs the client far more
            # than one existence query, so existing objects are left out first.
            there = _whole(self.client.exists(plan.names))
            todo = [i for i, r in enumerate(there) if r is not True]
            res: list[Any] = [store_errors.ObjectExists("stored before")] * len(plan.names)
            if len(todo) == len(plan.names):  # nothing stored before: the columns as they are
                part = self.client.put_from_multi(plan.names, plan.ptrs, plan.sizes)
            elif todo:
                pick = _rows(todo)
                part = self.client.put_from_multi(
                    [plan.names[i] for i in todo], pick(plan.ptrs), pick(plan.sizes)
                )
            if todo:
                for i, r in zip(todo, _whole(part)):
                    res[i] = r
        else:
            # One range per object: the put itself answers ObjectExists (one RPC).
            res = _whole(self.client.put_from_raw(plan.names, plan.ptrs, plan.sizes))
        if res.count(None) == len(res):  # every object written (the usual batch)
            return [True] * len(res)
        ok = []
        existing = 0
        for r in res:
            if isinstance(r, store_errors.ObjectExists):
                existing += 1
                ok.append(True)
            else:
                ok.append(r is None)
        self._counters.add(set_existing=existing)
        return ok

    @staticmethod
    def _per_page(ok: list[bool], per: int) -> list[bool]:
        if per == 1:
            return ok
        if False not in ok:  # every object done (the usual batch): nothing per page
            return [True] * (len(ok) // per)
        return [all(ok[i : i + per]) for i in range(0, len(ok), per)]

    @_guard(_all_false)
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        ok, hits, nbytes, dt = self._run_v1(keys, host_indices, self._get_plan, True)
        if dt is not None:
            self._counters.io("get", len(keys), hits, nbytes, dt)
        return ok

    @_guard(_all_false)
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        ok, good, nbytes, dt = self._run_v1(keys, host_indices, self._set_plan, False)
        if dt is not None:
            self._counters.io("set", len(keys), good, nbytes, dt)
        return ok

    def _run_v1(
        self, keys: list[str], host_indices: Any, run: Callable[[Any], Any], resolved: bool
    ) -> tuple[list[bool], int, int, float | None]:
        """One v1 batch: plan the pages (``resolved``: in region offsets, a get's form),
        ``run`` the plan as one store batch. Returns the per-page results, how many
        succeeded, their bytes and the elapsed seconds (``None`` when nothing ran: no keys,
        or a logical-anchor pool without KV bytes)."""
        if not keys:
            return [], 0, 0, None
        pool = self.mem_pool_host
        if getattr(pool, "kv_buffer", None) is None:
            # logical anchor: no KV bytes of its own
            return [True] * len(keys), len(keys), 0, None
        t0 = time.perf_counter()
        table, ps = self._table(pool)
        slots = _slots(host_indices)
        self._check_indices(keys, slots, ps)
        plan = _plan(pool, keys, host_indices, self._obj(), self._mha, table, ps, resolved, slots)
        ok = self._per_page(run(plan), plan.per_page)
        hits = ok.count(True)
        return ok, hits, sum(plan.totals[: plan.per_page]) * hits, time.perf_counter() - t0

    @staticmethod
    def _check_indices(keys: Sequence[str], host_indices: Any, page_size: int) -> None:
        if host_indices is None or len(host_indices) != len(keys) * page_size:
            got = None if host_indices is None else len(host_indices)
            raise ValueError(f"{len(keys)} keys need {len(keys) * page_size} slots, got {got}")

    def _exist_flags(self, names: list[str]) -> list[bool]:
        return [r is True for r in _whole(self.client.exists(names))]

    @_guard(lambda self, keys, *a, **k: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every component exists (one metadata RPC)."""
        if not keys:
            return 0
        t0 = time.perf_counter()
        # The names are {pre}{key}{mid}{comp}: the store gets the parts (one prefix, the page
        # keys, one suffix per component), not 2 x 256 full names, and the master answers
        # the count itself (the first missing object ends the prefix; an object the store
        # could not check counts as missing).
        pre, sufs = self._exists_parts()
        n = self.client.count_leading(keys, prefix=pre, suffixes=sufs)
        self._counters.add(exists_calls=1, exists_seconds=time.perf_counter() - t0)
        return n

    def _exists_parts(self) -> tuple[str, list[str]]:
        """``batch_exists``'s name parts: the prefix and one suffix per component (computed
        once per registered pool)."""
        parts = self._parts
        if parts is None:
            obj = self._obj()
            comps = ("k", "v") if self._mha else ("kv",)
            parts = self._parts = (obj.pre, obj.suffixes(comps))
        return parts

    # ------------------------------------------------------------------ generic (copying)

    def _flat(self, key: str) -> str:
        # Flat pages (get_data_page(flat=True)) are laid out differently from the v1
        # objects: their own component name keeps the two apart.
        return self._obj()(key, "flat")

    @_guard(lambda self, key, *a, **k: False)
    def exists(self, key: str) -> bool:
        return self._exist_flags([self._flat(key)])[0]

    @_guard(lambda self, key, *a, **k: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        r = self._generic_get([key], [target_location], [target_sizes])
        return r[0]

    @_guard(lambda self, keys, *a, **k: [None] * len(keys))
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        n = len(keys)
        return self._generic_get(
            keys, list(target_locations or [None] * n), list(target_sizes or [None] * n)
        )

    def _generic_get(self, keys: list[str], targets: list[Any], sizes: list[Any]) -> list[Any]:
        """Fill each flat page tensor (SGLang's dummy pages) from one batched read."""
        if not keys:
            return []
        out: list[Any] = [None] * len(keys)
        data = _whole(self.client.get([self._flat(k) for k in keys]))
        hits = 0
        for i, (r, t) in enumerate(zip(data, targets)):
            if not isinstance(r, bytes) or t is None:
                continue
            nbytes = t.numel() * t.element_size()
            if len(r) != nbytes or not t.is_contiguous():
                continue  # not this page's shape: a miss, never a partial fill
            t.view(-1).view(__import__("torch").uint8).numpy()[:] = np.frombuffer(r, np.uint8)
            out[i] = t
            hits += 1
        self._counters.add(get_pages=len(keys), get_hits=hits, get_misses=len(keys) - hits)
        return out

    @_guard(lambda self, key, *a, **k: False)
    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self._generic_set([key], [value])[0]

    @_guard(lambda self, keys, *a, **k: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not keys or values is None or len(values) != len(keys):
            return False
        return all(self._generic_set(list(keys), list(values)))

    def _generic_set(self, keys: list[str], values: list[Any]) -> list[bool]:
        if any(v is None for v in values):
            raise ValueError("the generic set needs a value tensor per key")
        import torch

        blobs = [v.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy() for v in values]
        res = _whole(self.client.put([self._flat(k) for k in keys], blobs))
        ok = [r is None or isinstance(r, store_errors.ObjectExists) for r in res]
        self._counters.add(set_pages=len(keys), set_written=sum(ok), set_failed=len(keys) - sum(ok))
        return ok

    # ------------------------------------------------------------------ v2 (sidecar pools)

    def _v2_plans(self, transfers: Sequence[Any]) -> list[tuple[str, _Plan]]:
        plans = []
        for t in transfers:
            name = _pool_key(t.name)
            pool = self.registered_pools.get(t.name, self.registered_pools.get(name))
            if name == "kv" and pool is None:
                pool = self.mem_pool_host
            if pool is None:
                raise ValueError(f"pool {name!r} was not registered (register_mem_host_pool_v2)")
            keys = list(t.keys or [])
            if not keys:
                plans.append((name, _Plan([], [], [], [], False, 1)))
                continue
            self._check_indices(keys, t.host_indices, self._page_size(pool))
            mha = _is_mha(pool)
            obj = self._obj(name, mha)
            plans.append((name, _plan(pool, keys, t.host_indices, obj, mha, *self._table(pool))))
        return plans

    @_guard(_v2_false)
    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._v2_io(transfers, self._get_plan)

    @_guard(_v2_false)
    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._v2_io(transfers, self._set_plan)

    def _v2_io(self, transfers: Sequence[Any], run: Callable[[_Plan], list[bool]]) -> dict:
        plans = self._v2_plans(transfers)
        # One store batch for every pool of the call.
        allp = _Plan.join([p for _, p in plans])
        ok = run(allp) if allp.names else []
        out: dict[str, list[bool]] = {}
        pos = 0
        for name, p in plans:
            seg = ok[pos : pos + len(p.names)]
            pos += len(p.names)
            out[name] = self._per_page(seg, p.per_page)
        return out

    @_guard(lambda self, keys, *a, **k: _pool_result(0, {}, []))
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """KV prefix intersected with every sidecar pool's verdict (ALL_PAGES: a prefix;
        TRAILING_PAGES: each end point whose window is complete), in one metadata RPC.
        BLOCK_GROUPS pools (0.5.23) are checked in the same RPC on their own keys and report
        the pages their leading complete groups cover, without gating the KV hit
        (:func:`block_group_pages`)."""
        anchor = getattr(self.mem_pool_host, "kv_buffer", None) is not None
        obj = self._obj()
        comps = ("k", "v") if self._mha else ("kv",)
        names = obj.names(keys, comps) if anchor else []
        side = []
        for t in pool_transfers or []:
            name = _pool_key(t.name)
            pool = self.registered_pools.get(t.name, self.registered_pools.get(name))
            if pool is None:
                raise ValueError(f"pool {name!r} was not registered")
            mha = _is_mha(pool)
            o = self._obj(name, mha)
            pc = ("k", "v") if mha else ("kv",)
            policy = getattr(t.hit_policy, "value", t.hit_policy)
            if policy not in ("all_pages", "trailing_pages", "block_groups"):
                raise ValueError(f"kvmesh HiCache does not support hit policy {policy!r}")
            start = len(names)
            # A block-group pool's objects are named by its own keys (as batch_set_v2 wrote
            # them); the other pools' by the KV page keys.
            names.extend(o.names(list(t.keys or []) if policy == "block_groups" else keys, pc))
            side.append((t, name, policy, len(pc), start))
        flags = self._exist_flags(names) if names else []
        per = len(comps)
        kv = len(keys)  # a logical anchor has no KV objects: the sidecars decide
        if anchor:
            kv = next(
                (i for i in range(len(keys)) if not all(flags[i * per : (i + 1) * per])), len(keys)
            )
        hits: dict[str, int] = {"kv": kv} if kv else {}
        restorable = list(range(1, kv + 1))
        for t, name, policy, per, start in side:
            if policy == "block_groups":
                n = len(t.keys or [])
                found = [all(flags[start + i * per : start + (i + 1) * per]) for i in range(n)]
                b = block_group_pages(found, t.block_pages, t.group_pages, len(keys))
                if b:
                    hits[name] = b
                continue
            if not restorable:
                continue
            page = [all(flags[start + i * per : start + (i + 1) * per]) for i in range(kv)]
            if policy == "all_pages":
                b = next((i for i in range(kv) if not page[i]), kv)
                ok = set(range(1, b + 1))
            else:  # trailing_pages
                w = max(1, len(t.keys) if t.keys else 1)
                ok = {p for p in range(1, kv + 1) if all(page[max(0, p - w) : p])}
                b = max(ok, default=0)
            if b:
                hits[name] = b
            restorable = [p for p in restorable if p in ok]
        return _pool_result(restorable[-1] if restorable else 0, hits, restorable)

    # ------------------------------------------------------------------ admin

    @_guard(lambda self, *a, **k: None)
    def clear(self) -> None:
        """Remove this deployment's pages (SGLang's HTTP clear endpoint): every object
        under ``{namespace}/{model}/`` -- all layouts, dtypes, page sizes and ranks of this
        model in this namespace -- and nothing of another namespace or model sharing the
        store. Pages being read are removed too (their readers get a miss)."""
        prefix = _namespace_prefix(
            self.config.namespace, getattr(self.storage_config, "model_name", None)
        )
        n = self.client.remove_prefix(prefix, force=True)
        log.info("kvmesh HiCache: cleared %d objects under %r", n, prefix)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (page counts and GB/s since the last call), plus the
        kvmesh counters as its ``kvmesh`` attribute; ``None`` without SGLang."""
        snap = self._counters.reset()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        m = StorageMetrics()
        m.prefetch_pgs.extend(snap.get("prefetch_pgs", []))
        m.backup_pgs.extend(snap.get("backup_pgs", []))
        m.prefetch_bandwidth.extend(snap.get("prefetch_bandwidth", []))
        m.backup_bandwidth.extend(snap.get("backup_bandwidth", []))
        m.kvmesh = snap  # type: ignore[attr-defined]
        return m

    def stats(self) -> dict[str, Any]:
        """The counters since the last :meth:`get_stats`, without resetting them."""
        return self._counters.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The engine is process-wide and outlives this backend: a registration left behind
        # would point at the host pool's memory after SGLang frees it (and overlap whatever
        # is allocated there next).
        self._tables.clear()
        with self._reg_lock:
            regions, self._registered = list(self._registered.values()), {}
        for region in regions:
            try:
                self.client.unregister_buffer(region)
            except Exception as e:  # noqa: BLE001
                log.warning("kvmesh HiCache: unregistering a host pool buffer failed: %s", e)
        if self._own_client:
            try:
                self.client.close()
            except Exception as e:  # noqa: BLE001
                log.warning("kvmesh HiCache: close failed: %s", e)


def _rows(idx: list[int]) -> Callable[[Any], Any]:
    """Rows ``idx`` of a plan's column (a numpy array, or a list per object)."""

    def pick(col: Any) -> Any:
        return col[idx] if hasattr(col, "shape") else [col[i] for i in idx]

    return pick


def _pool_key(name: Any) -> str:
    return str(getattr(name, "value", name))
