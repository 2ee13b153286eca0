"""The get methods of ``MooncakeDistributedStore`` (a mixin of :mod:`.store`): bytes, buffer
handles, into registered buffers (single, multi-buffer, ranges) and the get sessions, a miss
answered as Mooncake answers it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from .. import errors as E
from ._common import (
    _each,
    _each_empty,
    _each_none,
    _empty,
    _empty_list,
    _guard,
    _int,
    _ints,
    _key,
    _keys,
    _nested,
    _none,
    _one,
    _res,
)
from .constants import (
    BUFFER_OVERFLOW,
    INVALID_PARAMS,
)
from .types import (
    BufferHandle,
)

__all__ = ["GetMethods"]


class GetMethods:
    """Needs from the class: ``_live``, ``_staged``, ``_registered``, ``_lock``,
    ``_put_sessions``, ``_get_sessions``."""

    # ================================================================== get

    def _get_values(self, keys: list[str], into: Any = None) -> list[Any]:
        """Per key the object's bytes (``into(view)`` of them with ``into``, see
        :meth:`StoreClient.get`), or a negative code."""
        if not keys:
            return []
        res = self._live().get(keys, into=into)
        out: list[Any] = []
        for r in res:
            if isinstance(r, (bytes, bytearray)):
                out.append(r if self._staged(len(r)) == 0 else BUFFER_OVERFLOW)
            else:
                out.append(_res(r) or INVALID_PARAMS)
        return out

    @_guard(_empty)
    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` when it is missing or the read fails (Mooncake)."""
        r = self._get_values([_key(key)])[0]
        return r if isinstance(r, bytes) else b""

    @_guard(_each_empty)
    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [r if isinstance(r, bytes) else b"" for r in self._get_values(_keys(keys))]

    @_guard(_none)
    def get_buffer(self, key: str) -> BufferHandle | None:
        """A :class:`BufferHandle` holding the object's bytes; None when it is missing. The
        bytes are copied once, out of the staging buffer into the handle."""
        r = self._get_values([_key(key)], BufferHandle)[0]
        return r if isinstance(r, BufferHandle) else None

    @_guard(_each_none)
    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [
            r if isinstance(r, BufferHandle) else None
            for r in self._get_values(_keys(keys), BufferHandle)
        ]

    def _get_ptrs(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        res = self._live().get_into(keys, ptrs, 0, sizes)
        return [
            r if isinstance(r, int) and not isinstance(r, E.StoreError) else _res(r) for r in res
        ]

    @_guard(_one)
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into the registered buffer, or a negative code (-10: too small)."""
        return self._get_ptrs([_key(key)], [_int(buffer_ptr)], [_int(size)])[0]

    @_guard(_each)
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self._get_ptrs(_keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"))

    @_guard(_each)
    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Object ``i`` filled into the buffers ``all_buffer_ptrs[i]`` in order; bytes read."""
        ks = _keys(keys)
        ptrs = _nested(all_buffer_ptrs, "all_buffer_ptrs", 2)
        sizes = _nested(all_sizes, "all_sizes", 2)
        if not (len(ks) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(ks)
        if not ks:
            return []
        res = self._live().get_into_multi(ks, ptrs, sizes)
        return [
            r if isinstance(r, int) and not isinstance(r, E.StoreError) else _res(r) for r in res
        ]

    def _read_ranges(
        self,
        data: bytes | int,
        ptrs: list[int],
        dst: list[int],
        src: list[int],
        sizes: list[int],
        cap: Callable[[int, int], bool],
    ) -> list[int]:
        """Copy ``sizes[r]`` bytes of one object's ``data`` from ``src[r]`` to ``ptrs[r] +
        dst[r]``, per range its byte count or a negative code."""
        if not (len(dst) == len(src) == len(sizes) == len(ptrs)):
            return [INVALID_PARAMS]
        if isinstance(data, int):
            return [data] * max(1, len(sizes))
        out = []
        for p, d, s, n in zip(ptrs, dst, src, sizes):
            if n < 0 or s < 0 or d < 0 or s + n > len(data):
                out.append(INVALID_PARAMS)
            elif not cap(p + d, n):
                out.append(BUFFER_OVERFLOW)
            else:
                ctypes.memmove(p + d, data[s : s + n], n)
                out.append(n)
        return out

    @_guard(_empty_list)
    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """Per buffer ``b``, per key ``k`` of ``all_keys[b]``, per range: copy
        ``all_sizes[b][k][r]`` bytes of the object from ``all_src_offsets[b][k][r]`` into
        registered buffer ``b`` at ``all_dst_offsets[b][k][r]``; the same nesting of byte
        counts or negative codes comes back (a key whose lists differ in length: one code)."""
        bufs = _ints(buffer_ptrs, "buffer_ptrs")
        keys = (
            [_keys(ks) for ks in all_keys]
            if isinstance(all_keys, (list, tuple))
            else _keys(all_keys)
        )
        dst = _nested(all_dst_offsets, "all_dst_offsets", 3)
        src = _nested(all_src_offsets, "all_src_offsets", 3)
        sizes = _nested(all_sizes, "all_sizes", 3)
        if not (len(bufs) == len(keys) == len(dst) == len(src) == len(sizes)):
            return [[[INVALID_PARAMS]] * len(k) for k in keys]
        wanted = sorted({k for ks in keys for k in ks})
        data = dict(zip(wanted, self._session_or_get(wanted)))
        out = []
        for b, ks, d, s, z in zip(bufs, keys, dst, src, sizes):
            if not (len(ks) == len(d) == len(s) == len(z)):
                out.append([[INVALID_PARAMS]] * len(ks))
                continue
            base = self._region_end(b)

            def fits(a: int, n: int, b: int = b, end: int | None = base) -> bool:
                return end is not None and b <= a and a + n <= end

            out.append(
                [
                    self._read_ranges(data[k], [b] * len(zz), dd, ss, zz, fits)
                    if (dd or ss or zz)
                    else []
                    for k, dd, ss, zz in zip(ks, d, s, z)
                ]
            )
        return out

    def _region_end(self, ptr: int) -> int | None:
        z = self._regs.get(ptr)
        return None if z is None else ptr + z

    def _session_or_get(self, keys: list[str]) -> list[bytes | int]:
        """Objects' bytes, from a get session where one holds them."""
        have = {k: self._get_sessions[k] for k in keys if k in self._get_sessions}
        rest = [k for k in keys if k not in have]
        got = dict(zip(rest, self._get_values_unstaged(rest)))
        return [have[k] if k in have else got[k] for k in keys]

    def _get_values_unstaged(self, keys: list[str]) -> list[bytes | int]:
        if not keys:
            return []
        return [
            r if isinstance(r, bytes) else (_res(r) or INVALID_PARAMS)
            for r in self._live().get(keys)
        ]

    # ------------------------------------------------------------------ get sessions

    @_guard(_each)
    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Look the objects up once (kvmesh: read them once into this process) for ranged
        reads with :meth:`batch_get_into_multi_buffer_ranges`; per key 0 or a code."""
        ks = _keys(keys)
        vals = self._get_values_unstaged(ks)
        out = []
        with self._lock:
            for k, v in zip(ks, vals):
                if isinstance(v, bytes):
                    self._get_sessions[k] = v
                    out.append(0)
                else:
                    out.append(v)
        return out

    @_guard(_each)
    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        """Per key: ``all_sizes[i][k]`` bytes of the object from ``all_src_offsets[i][k]``
        into registered buffer ``all_buffer_ptrs[i][k]``; bytes read in all, or a code."""
        ks = _keys(keys)
        ptrs = _nested(all_buffer_ptrs, "all_buffer_ptrs", 2)
        sizes = _nested(all_sizes, "all_sizes", 2)
        src = _nested(all_src_offsets, "all_src_offsets", 2)
        if not (len(ks) == len(ptrs) == len(sizes) == len(src)):
            return [INVALID_PARAMS] * len(ks)
        data = self._session_or_get(ks)
        out = []
        for d, p, z, s in zip(data, ptrs, sizes, src):
            r = self._read_ranges(d, p, [0] * len(p), s, z, self._registered)
            bad = next((c for c in r if c < 0), 0)
            out.append(bad or sum(r))
        return out

    @_guard(_one)
    def batch_get_session_end(self, keys: list[str]) -> int:
        ks = _keys(keys)
        with self._lock:
            for k in ks:
                self._get_sessions.pop(k, None)
        return 0
