"""Mooncake-Store-compatible surface: ``MooncakeDistributedStore`` with Mooncake's method
names, argument order and integer results, on top of :class:`~kvmesh.store.client.StoreClient`.

Code written for Mooncake (SGLang's and LMCache's Mooncake backends) runs on kvmesh by
swapping the import::

    from kvmesh.store.compat import MooncakeDistributedStore, ReplicateConfig

Results follow Mooncake: ``0`` for success, bytes read for reads, ``1``/``0`` for existence,
and negative :mod:`kvmesh.store.errors` codes (Mooncake's values: -704 not found, -705 exists,
-706 has lease, -707 lease expired, -10 buffer too small, ...) -- never an exception for a
store condition. ``get`` returns ``b""`` on any error, like Mooncake. The differences are
listed in docs/store.md ("Mooncake compatibility").
"""

from __future__ import annotations

import logging
from typing import Any

from . import errors as E
from .client import StoreClient
from .types import ReplicateConfig as _Config

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "literal_prefix"]

log = logging.getLogger(__name__)


class ReplicateConfig:
    """Mooncake's mutable ``ReplicateConfig`` (attributes set after construction)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []

    def _to_kvmesh(self, writer_host: str | None) -> _Config:
        pref = self.preferred_segment or (
            self.preferred_segments[0] if self.preferred_segments else None
        )
        return _Config(
            replica_num=int(self.replica_num),
            preferred_segment=pref or None,
            writer_host=writer_host,
            soft_pin=bool(self.with_soft_pin),
            hard_pin=bool(self.with_hard_pin),
        )

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin})"
        )


def _code(r: Any) -> int:
    """Mooncake's int for one result of a kvmesh batch (0 / value / negative code)."""
    return r.code if isinstance(r, E.StoreError) else 0


def _guarded(fail: Any) -> Any:
    """Turn a whole-call failure (no master reachable, wrong token) into Mooncake's shape:
    ``fail(code, args)`` builds the return value (a code, ``b""``, or a list of codes)."""

    def wrap(fn: Any) -> Any:
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except E.StoreError as e:
                log.warning("kvmesh compat %s failed: %s", fn.__name__, e)
                return fail(e.code, args)

        inner.__name__ = fn.__name__
        inner.__doc__ = fn.__doc__
        return inner

    return wrap


def _one(code: int, args: Any) -> int:
    return code


def _empty(code: int, args: Any) -> bytes:
    return b""


def _per_key(code: int, args: Any) -> list[int]:
    return [code] * len(args[0]) if args else []


def _empties(code: int, args: Any) -> list[bytes]:
    return [b""] * len(args[0]) if args else []


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


_SETUP_FIELDS = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
)


class MooncakeDistributedStore:
    """The Mooncake client API. Create, ``setup(...)``, use, ``close()``."""

    def __init__(self) -> None:
        self._c: StoreClient | None = None

    # ------------------------------------------------------------------ lifecycle

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size=..., local_buffer_size=...,
        protocol="tcp", rdma_devices="", master_server_addr=..., engine=None, **extra)`` or
        ``setup(config_dict)`` with the same names (``master_server_address`` and
        ``device_name`` accepted too). ``master_server_addr``: the kvmesh master addresses
        (comma-separated); empty or ``"embedded"``: an in-process store. ``local_hostname``,
        ``metadata_server``, ``protocol``, ``rdma_devices``, ``engine`` and
        ``local_buffer_size`` are accepted and ignored: the kvmesh transfer engine finds
        peers and transports itself. Returns 0, or a negative code."""
        if args and isinstance(args[0], dict):
            cfg = dict(args[0])
            cfg.update(kwargs)
        else:
            cfg = dict(zip(_SETUP_FIELDS, args))
            if len(args) > len(_SETUP_FIELDS):
                cfg["engine"] = args[len(_SETUP_FIELDS)]
            cfg.update(kwargs)
        master = cfg.get("master_server_addr", cfg.get("master_server_address", ""))
        segment = int(cfg.get("global_segment_size", 0) or 0)
        if self._c is not None:
            return int(E.Code.INVALID_PARAMS)  # set up twice
        try:
            if not master or master == "embedded":
                self._c = StoreClient(None, segment_size=segment or None)
            else:
                self._c = StoreClient(master, segment_size=segment)
        except E.StoreError as e:
            log.warning("kvmesh compat setup failed: %s", e)
            return e.code
        except (OSError, ValueError) as e:
            log.warning("kvmesh compat setup failed: %s", e)
            return int(E.Code.INVALID_PARAMS)
        return 0

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's "standalone storage" client: no segment of its own."""
        return self.setup({"master_server_addr": server_address, "global_segment_size": 0})

    def close(self) -> int:
        if self._c is not None:
            self._c.close()
            self._c = None
        return 0

    def __del__(self) -> None:
        # Mooncake's store is closed by its destructor, and callers rely on it (SGLang's
        # MooncakeStore.close() is a no-op): without this, a dropped store would leave its
        # buffers registered in the process-wide engine after their memory was freed.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to report to
            pass

    @property
    def client(self) -> StoreClient:
        """The underlying :class:`StoreClient` (kvmesh extension)."""
        if self._c is None:
            raise RuntimeError("MooncakeDistributedStore.setup() was not called")
        return self._c

    def _cfg(self, config: ReplicateConfig | None) -> _Config | None:
        if config is None:
            return None
        return config._to_kvmesh(self.client.engine.host_id)

    # ------------------------------------------------------------------ buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self.client.register_buffer(int(buffer_ptr), int(size))
        except E.StoreError as e:
            return e.code
        except Exception as e:  # noqa: BLE001 - Mooncake reports registration failures as codes
            log.warning("register_buffer failed: %s", e)
            return int(E.Code.INVALID_PARAMS)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self.client.unregister_buffer(int(buffer_ptr))
        except E.StoreError as e:
            return e.code
        except Exception as e:  # noqa: BLE001
            log.warning("unregister_buffer failed: %s", e)
            return int(E.Code.INVALID_PARAMS)
        return 0

    # ------------------------------------------------------------------ bytes

    @_guarded(_one)
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return _code(self.client.put([key], [value], config=self._cfg(config))[0])

    @_guarded(_one)
    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return _code(self.client.upsert([key], [value], config=self._cfg(config))[0])

    @_guarded(_one)
    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        res = self.client.put(list(keys), list(values), config=self._cfg(config))
        return next((c for c in res.codes if c), 0)

    @_guarded(_empty)
    def get(self, key: str) -> bytes:
        r = self.client.get([key])[0]
        return r if isinstance(r, bytes) else b""

    @_guarded(_empties)
    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [r if isinstance(r, bytes) else b"" for r in self.client.get(list(keys))]

    # ------------------------------------------------------------------ zero copy

    @_guarded(_one)
    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    @_guarded(_one)
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    @_guarded(_per_key)
    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [int(E.Code.INVALID_PARAMS)] * len(keys)
        res = self.client.put_from(
            list(keys), [int(p) for p in buffer_ptrs], 0, list(sizes), config=self._cfg(config)
        )
        return res.codes

    @_guarded(_per_key)
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [int(E.Code.INVALID_PARAMS)] * len(keys)
        res = self.client.get_into(list(keys), [int(p) for p in buffer_ptrs], 0, list(sizes))
        return [r if isinstance(r, int) else r.code for r in res]

    @_guarded(_per_key)
    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            return [int(E.Code.INVALID_PARAMS)] * len(keys)
        res = self.client.put_from_multi(
            list(keys),
            [[int(p) for p in ptrs] for ptrs in all_buffer_ptrs],
            [list(s) for s in all_sizes],
            config=self._cfg(config),
        )
        return res.codes

    @_guarded(_per_key)
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]], *_: Any
    ) -> list[int]:
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            return [int(E.Code.INVALID_PARAMS)] * len(keys)
        res = self.client.get_into_multi(
            list(keys),
            [[int(p) for p in ptrs] for ptrs in all_buffer_ptrs],
            [list(s) for s in all_sizes],
        )
        return [r if isinstance(r, int) else r.code for r in res]

    # ------------------------------------------------------------------ metadata

    @_guarded(_one)
    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    @_guarded(_per_key)
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        res = self.client.exists(list(keys))
        return [(1 if r else 0) if isinstance(r, bool) else r.code for r in res]

    @_guarded(_one)
    def get_size(self, key: str) -> int:
        r = self.client.get_size([key])[0]
        return r if isinstance(r, int) else r.code

    @_guarded(_one)
    def remove(self, key: str, force: bool = False) -> int:
        return _code(self.client.remove([key], force=force)[0])

    @_guarded(_one)
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Mooncake's remove by regex, for literal prefixes only: ``^abc``, ``^abc.*`` or
        ``^abc.*$`` (metacharacters in ``abc`` escaped with a backslash) remove the objects
        whose key starts with ``abc`` and return how many. Any other pattern answers
        ``InvalidParams`` (-600): the master never evaluates a client's regex (one crafted
        pattern could hold it for minutes, ReDoS). :meth:`remove_by_prefix` is the direct
        form."""
        prefix = literal_prefix(regex_pattern)
        if prefix is None:
            return int(E.Code.INVALID_PARAMS)
        return int(self.client.remove_prefix(prefix, force=force))

    @_guarded(_one)
    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        """kvmesh's own form (not in Mooncake): remove the objects whose key starts with
        ``prefix``; how many, or a negative code."""
        return int(self.client.remove_prefix(prefix, force=force))

    @_guarded(_one)
    def remove_all(self, force: bool = False) -> int:
        try:
            return self.client.remove_all(force=force)
        except E.StoreError as e:
            return e.code
