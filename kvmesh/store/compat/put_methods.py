"""The put and upsert methods of ``MooncakeDistributedStore`` (a mixin of :mod:`.store`):
every put form (bytes, parts, pointers, multi-buffers, an existing key answering 0) and the
put sessions (reserve, write by ranges, publish or revoke)."""

from __future__ import annotations

import ctypes
from typing import Any

from .. import errors as E
from ._common import (
    T_MAX_SESSION,
    _config,
    _each,
    _guard,
    _int,
    _ints,
    _key,
    _keys,
    _nested,
    _one,
    _put_code,
    _res,
)
from .constants import (
    INVALID_PARAMS,
    OBJECT_EXISTS,
    OBJECT_NOT_FOUND,
    code,
)
from .types import (
    ReplicateConfig,
)

__all__ = ["PutMethods"]


class PutMethods:
    """Needs from the class: ``_cfg``, ``_live``, ``_staged``, ``_registered``, ``_lock``,
    ``_put_sessions``."""

    # ================================================================== put / upsert

    def _put_values(
        self, keys: list[str], values: list[Any], config: Any, upsert: bool
    ) -> list[int]:
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        views = []
        for v in values:
            try:
                views.append(memoryview(v).cast("B"))
            except TypeError:
                what = type(v).__name__
                raise TypeError(f"a value must support the buffer protocol, got {what}") from None
        out = [self._staged(len(v)) for v in views]
        todo = [i for i, r in enumerate(out) if r == 0]
        if not todo:
            return out
        op = self._live().upsert if upsert else self._live().put
        res = op([keys[i] for i in todo], [views[i] for i in todo], config=cfg)
        for i, r in zip(todo, res):
            out[i] = _res(r) if upsert else _put_code(r)
        return out

    @_guard(_one)
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([_key(key)], [value], config, False)[0]

    @_guard(_one)
    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([_key(key)], [value], config, True)[0]

    @_guard(_one)
    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """0, or the first key's failure (Mooncake answers one code for the batch)."""
        ks = _keys(keys)
        if len(ks) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._put_values(ks, list(values), config, False) if c), 0)

    @_guard(_one)
    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        ks = _keys(keys)
        if len(ks) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._put_values(ks, list(values), config, True) if c), 0)

    def _parts(self, key: str, parts: tuple, config: Any, upsert: bool) -> int:
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError:
            raise TypeError("put_parts: every part must support the buffer protocol") from None
        if not views:
            return INVALID_PARAMS
        return self._put_values([_key(key)], [b"".join(views)], config, upsert)[0]

    @_guard(_one)
    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """The parts concatenated, as one object."""
        return self._parts(key, parts, config, False)

    @_guard(_one)
    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._parts(key, parts, config, True)

    def _put_ptrs(
        self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any, upsert: bool
    ) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        c = self._live()
        op = c.upsert_from if upsert else c.put_from
        res = op(keys, ptrs, 0, sizes, config=cfg)
        return [_res(r) if upsert else _put_code(r) for r in res]

    @_guard(_one)
    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_ptrs([_key(key)], [_int(buffer_ptr)], [_int(size)], config, False)[0]

    @_guard(_one)
    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_ptrs([_key(key)], [_int(buffer_ptr)], [_int(size)], config, True)[0]

    @_guard(_each)
    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._put_ptrs(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"), config, False
        )

    @_guard(_each)
    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._put_ptrs(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"), config, True
        )

    def _put_multi(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        config: Any,
        upsert: bool,
    ) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)) or any(
            len(p) != len(z) for p, z in zip(ptrs, sizes)
        ):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        res = self._live().put_from_multi(keys, ptrs, sizes, config=cfg, upsert=upsert)
        return [_res(r) if upsert else _put_code(r) for r in res]

    @_guard(_one)
    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """One object: the ``metadata_size`` bytes at ``metadata_buffer_ptr``, then the
        ``size`` bytes at ``buffer_ptr`` (Mooncake's order)."""
        ptrs = [_int(metadata_buffer_ptr), _int(buffer_ptr)]
        sizes = [_int(metadata_size), _int(size)]
        keep = [i for i in range(2) if sizes[i] > 0]
        return self._put_multi(
            [_key(key)], [[ptrs[i] for i in keep]], [[sizes[i] for i in keep]], config, False
        )[0]

    @_guard(_each)
    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Object ``i``: the buffers ``all_buffer_ptrs[i]`` (``all_sizes[i]`` bytes each)
        concatenated, written zero-copy."""
        return self._put_multi(
            _keys(keys),
            _nested(all_buffer_ptrs, "all_buffer_ptrs", 2),
            _nested(all_sizes, "all_sizes", 2),
            config,
            False,
        )

    # ------------------------------------------------------------------ put sessions

    @_guard(_each)
    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Reserve objects of ``sizes`` bytes, written by ranges with
        :meth:`batch_put_from_multi_buffer_ranges` and published by
        :meth:`batch_put_session_end` (unreadable before). kvmesh stages the ranges in this
        process and puts the objects at the end, in one batch."""
        ks, zs = _keys(keys), _ints(sizes, "sizes")
        if len(ks) != len(zs):
            return [INVALID_PARAMS] * len(ks)
        cfg, err = self._cfg(_config(config), len(ks))
        if err:
            return [err] * len(ks)
        exists = self._live().exists(ks)
        out = []
        with self._lock:
            for k, z, e in zip(ks, zs, exists):
                if z <= 0 or z > T_MAX_SESSION or k in self._put_sessions:
                    out.append(INVALID_PARAMS)
                elif e is True:
                    out.append(OBJECT_EXISTS)
                elif isinstance(e, E.StoreError):
                    out.append(code(e.code))
                else:
                    self._put_sessions[k] = (bytearray(z), cfg)
                    out.append(0)
        return out

    @_guard(_each)
    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Into each started object ``keys[i]``: ``all_sizes[i][k]`` bytes from
        ``all_buffer_ptrs[i][k]`` (registered memory) at offset ``all_dst_offsets[i][k]``."""
        ks = _keys(keys)
        ptrs = _nested(all_buffer_ptrs, "all_buffer_ptrs", 2)
        sizes = _nested(all_sizes, "all_sizes", 2)
        offs = _nested(all_dst_offsets, "all_dst_offsets", 2)
        if not (len(ks) == len(ptrs) == len(sizes) == len(offs)):
            return [INVALID_PARAMS] * len(ks)
        out = []
        for k, p, z, o in zip(ks, ptrs, sizes, offs):
            sess = self._put_sessions.get(k)
            if sess is None:
                out.append(OBJECT_NOT_FOUND)
                continue
            buf = sess[0]
            if not (len(p) == len(z) == len(o)) or any(
                n < 0 or d < 0 or d + n > len(buf) or not self._registered(a, n)
                for a, n, d in zip(p, z, o)
            ):
                out.append(INVALID_PARAMS)
                continue
            for a, n, d in zip(p, z, o):
                buf[d : d + n] = ctypes.string_at(a, n)
            out.append(0)
        return out

    @_guard(_each)
    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        ks = _keys(keys)
        with self._lock:
            got = [self._put_sessions.pop(k, None) for k in ks]
        out = [0 if s is not None else OBJECT_NOT_FOUND for s in got]
        todo = [i for i, s in enumerate(got) if s is not None]
        # one batch per distinct config (usually one)
        by_cfg: dict[int, list[int]] = {}
        for i in todo:
            by_cfg.setdefault(id(got[i][1]), []).append(i)  # type: ignore[index]
        for idx in by_cfg.values():
            cfg = got[idx[0]][1]  # type: ignore[index]
            res = self._live().put([ks[i] for i in idx], [got[i][0] for i in idx], config=cfg)  # type: ignore[index]
            for i, r in zip(idx, res):
                out[i] = _put_code(r)
        return out

    @_guard(_each)
    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        ks = _keys(keys)
        with self._lock:
            return [
                0 if self._put_sessions.pop(k, None) is not None else OBJECT_NOT_FOUND for k in ks
            ]
