"""The sharded tensor methods of ``MooncakeDistributedStore`` (a mixin of :mod:`.store`):
the TP forms (``*_with_tp``, one object per rank named ``key_tp_<rank>``) and the
parallelism forms (``ParallelAxis`` / ``TensorParallelism`` / ``ReadTarget``), over the plain
tensor forms of :mod:`.tensor_methods`."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from . import tensors as T
from ._common import (
    _each,
    _each_none,
    _guard,
    _int,
    _ints,
    _key,
    _keys,
    _none,
    _one,
    _Unsupported,
)
from .constants import (
    INVALID_PARAMS,
    NOT_SUPPORTED,
)
from .types import ReadTarget, ReplicateConfig, TensorParallelism

__all__ = ["ShardedTensorMethods"]


class ShardedTensorMethods:
    """Needs from the class: the helpers of :class:`~.tensor_methods.TensorMethods` and
    ``_cfg``, ``_live``, ``_put_ptrs``, ``_get_ptrs``, ``_registered``."""

    # ------------------------------------------------------------------ TP forms

    def _tp_objs(self, tensor: Any, tp_size: int, split_dim: int) -> list[bytes] | None:
        objs = []
        for rank in range(tp_size):
            got = T.shard(tensor, rank, tp_size, split_dim) if hasattr(tensor, "dim") else None
            if got is None:
                return None
            part, h = got
            objs.append(T.encode(h) + bytes(T.tensor_bytes(part)))
        return objs

    def _put_tp(
        self, key: str, tensor: Any, config: Any, tp_size: int, split_dim: int, upsert: bool = False
    ) -> int:
        """Every shard ``key_tp_<r>`` (``r < tp_size``) of the tensor (``tp_rank`` is not
        used on write, as in Mooncake): 0, or the first shard's failure."""
        if tp_size <= 1:
            return self._put_objs([key], self._tensor_objs([tensor]), config, upsert)[0]
        objs = self._tp_objs(tensor, tp_size, split_dim)
        if objs is None:
            return INVALID_PARAMS
        keys = [f"{key}_tp_{r}" for r in range(tp_size)]
        return next((c for c in self._put_objs(keys, list(objs), config, upsert) if c), 0)

    @_guard(_one)
    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self._put_tp(_key(key), tensor, None, _int(tp_size), _int(split_dim))

    @_guard(_one)
    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: Any,
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        return self._put_tp(_key(key), tensor, config, _int(tp_size), _int(split_dim))

    def _batch_tp(
        self, keys: Any, tensors: Any, config: Any, tp_size: int, split_dim: int
    ) -> list[int]:
        ks = _keys(keys)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(ks):
            return [INVALID_PARAMS] * len(ks)
        return [self._put_tp(k, t, config, tp_size, split_dim) for k, t in zip(ks, tensors)]

    @_guard(_each)
    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        return self._batch_tp(base_keys, tensors_list, None, _int(tp_size), _int(split_dim))

    @_guard(_each)
    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list,
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        return self._batch_tp(base_keys, tensors_list, config, _int(tp_size), _int(split_dim))

    def _tp_from(self, key: str, ptr: int, size: int, tp_size: int, split_dim: int) -> int:
        if ptr == 0 or size < T.HEADER_SIZE:
            return INVALID_PARAMS
        if tp_size <= 1:
            return self._from_objs([key], [ptr], [size], False)[0]
        buf = ctypes.string_at(ptr, size)
        h = T.decode(buf)
        if h is None:
            return INVALID_PARAMS
        return self._put_tp(key, T.tensor_from(buf, h), None, tp_size, split_dim)

    @_guard(_one)
    def put_tensor_with_tp_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        return self._tp_from(
            _key(key), _int(buffer_ptr), _int(size), _int(tp_size), _int(split_dim)
        )

    @_guard(_each)
    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        ks, ps, zs = _keys(base_keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
        if not (len(ks) == len(ps) == len(zs)):
            return [INVALID_PARAMS] * len(ks)
        return [
            self._tp_from(k, p, z, _int(tp_size), _int(split_dim)) for k, p, z in zip(ks, ps, zs)
        ]

    @staticmethod
    def _tp_key(key: str, tp_rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"

    @_guard(_none)
    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """This rank's shard (``key_tp_<tp_rank>``), or None."""
        return self._tensors([self._tp_key(_key(key), _int(tp_rank), _int(tp_size))])[0]

    @_guard(_each_none)
    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list:
        r, n = _int(tp_rank), _int(tp_size)
        return self._tensors([self._tp_key(k, r, n) for k in _keys(base_keys)])

    @_guard(_none)
    def get_tensor_with_tp_into(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> Any:
        k = self._tp_key(_key(key), _int(tp_rank), _int(tp_size))
        return self._tensor_into([k], [_int(buffer_ptr)], [_int(size)])[0]

    @_guard(_each_none)
    def batch_get_tensor_with_tp_into(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> list:
        r, n = _int(tp_rank), _int(tp_size)
        keys = [self._tp_key(k, r, n) for k in _keys(base_keys)]
        return self._tensor_into(keys, _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"))

    # ------------------------------------------------------------------ parallelism forms

    @staticmethod
    def _tp_axis(parallelism: Any) -> tuple[int, int, int] | None:
        """(rank, size, split_dim) of a parallelism with at most one sharding axis, a TP one;
        None: no sharding. kvmesh supports that layout only (others: -1012)."""
        if parallelism is None:
            return None
        if not isinstance(parallelism, TensorParallelism):
            raise TypeError("parallelism must be a TensorParallelism")
        sharded = [a for a in parallelism.axes if a.size > 1 and a.split_dim is not None]
        if not sharded:
            return None
        if len(sharded) > 1 or sharded[0].kind != "tp":
            raise _Unsupported
        a = sharded[0]
        return a.rank, a.size, a.split_dim

    def _put_par(self, key: str, tensor: Any, parallelism: Any, config: Any, upsert: bool) -> int:
        try:
            ax = self._tp_axis(parallelism)
        except _Unsupported:
            return NOT_SUPPORTED
        if ax is None:
            return self._put_objs([key], self._tensor_objs([tensor]), config, upsert)[0]
        rank, size, split = ax
        got = T.shard(tensor, rank, size, split) if hasattr(tensor, "dim") else None
        if got is None:
            return INVALID_PARAMS
        part, h = got
        return self._put_objs([key], [T.encode(h) + bytes(T.tensor_bytes(part))], config, upsert)[0]

    @_guard(_one)
    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: Any = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        """Store this rank's shard of ``tensor`` under ``key`` (a SHARD header names the TP
        axis); without a sharding axis the whole tensor. Layouts with more than one sharded
        axis, or a non-TP one, and ``writer_partition`` answer -1012 on kvmesh."""
        if writer_partition is not None:
            return NOT_SUPPORTED
        return self._put_par(_key(key), tensor, parallelism, config, False)

    @_guard(_one)
    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: Any = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        if writer_partition is not None:
            return NOT_SUPPORTED
        return self._put_par(_key(key), tensor, parallelism, config, True)

    def _par_from(
        self, key: str, ptr: int, size: int, parallelism: Any, config: Any, upsert: bool
    ) -> int:
        if ptr == 0 or size < T.HEADER_SIZE:
            return INVALID_PARAMS
        buf = ctypes.string_at(ptr, size)
        h = T.decode(buf)
        if h is None:
            return INVALID_PARAMS
        return self._put_par(key, T.tensor_from(buf, h), parallelism, config, upsert)

    @_guard(_one)
    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        if writer_partition is not None:
            return NOT_SUPPORTED
        return self._par_from(_key(key), _int(buffer_ptr), _int(size), parallelism, config, False)

    @_guard(_one)
    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        if writer_partition is not None:
            return NOT_SUPPORTED
        return self._par_from(_key(key), _int(buffer_ptr), _int(size), parallelism, config, True)

    def _batch_par(
        self,
        keys: Any,
        items: Any,
        parallelisms: Any,
        config: Any,
        writer: Any,
        upsert: bool,
        one: Callable,
    ) -> list[int]:
        ks = _keys(keys)
        if writer is not None:
            return [NOT_SUPPORTED] * len(ks)
        pars = parallelisms if isinstance(parallelisms, (list, tuple)) else [parallelisms] * len(ks)
        if not isinstance(items, (list, tuple)) or len(items) != len(ks) or len(pars) != len(ks):
            return [INVALID_PARAMS] * len(ks)
        return [one(k, x, p) for k, x, p in zip(ks, items, pars)]

    @_guard(_each)
    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list,
        parallelisms: Any = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        return self._batch_par(
            keys,
            tensors_list,
            parallelisms,
            config,
            writer_partitions,
            False,
            lambda k, t, p: self._put_par(k, t, p, config, False),
        )

    @_guard(_each)
    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list,
        parallelisms: Any = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        return self._batch_par(
            keys,
            tensors_list,
            parallelisms,
            config,
            writer_partitions,
            True,
            lambda k, t, p: self._put_par(k, t, p, config, True),
        )

    @_guard(_each)
    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: Any = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        ps, zs = _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
        if len(ps) != len(zs):
            return [INVALID_PARAMS] * len(_keys(keys))
        return self._batch_par(
            keys,
            list(zip(ps, zs)),
            parallelisms,
            config,
            writer_partitions,
            False,
            lambda k, pz, p: self._par_from(k, pz[0], pz[1], p, config, False),
        )

    @_guard(_each)
    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: Any = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        ps, zs = _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
        if len(ps) != len(zs):
            return [INVALID_PARAMS] * len(_keys(keys))
        return self._batch_par(
            keys,
            list(zip(ps, zs)),
            parallelisms,
            config,
            writer_partitions,
            True,
            lambda k, pz, p: self._par_from(k, pz[0], pz[1], p, config, True),
        )

    def _get_par(self, keys: list[str], targets: Any) -> list[Any]:
        objs = self._get_values_unstaged(keys)
        tlist = targets if isinstance(targets, (list, tuple)) else [targets] * len(keys)
        out = []
        for v, target in zip(objs, tlist):
            h = T.decode(v) if isinstance(v, bytes) else None
            if h is None:
                out.append(None)
                continue
            t = T.tensor_from(v, h)
            out.append(self._shape_for(t, h, target))
        return out

    def _shape_for(self, t: Any, h: T.Header, target: Any) -> Any:
        if target is None:
            return t
        if not isinstance(target, ReadTarget):
            raise TypeError("target must be a ReadTarget")
        if target.mode == "as_stored":
            return t
        if target.mode == "full":
            return t if h.layout_kind == T.FULL else None
        if h.layout_kind != T.FULL:
            return t
        try:
            ax = self._tp_axis(target.parallelism)
        except _Unsupported:
            return None
        if ax is None:
            return t
        got = T.shard(t, *ax)
        return None if got is None else got[0]

    @_guard(_none)
    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        return self._get_par([_key(key)], target)[0]

    @_guard(_each_none)
    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: Any = None) -> list:
        ks = _keys(keys)
        if isinstance(targets, (list, tuple)) and len(targets) != len(ks):
            return [None] * len(ks)
        return self._get_par(ks, targets)

    def _par_into(
        self, keys: list[str], ptrs: list[int], sizes: list[int], targets: Any
    ) -> list[Any]:
        ts = self._get_par(keys, targets)
        out = []
        for t, p, n in zip(ts, ptrs, sizes):
            nbytes = None if t is None else t.numel() * t.element_size()
            if t is None or nbytes > n or not self._registered(p, max(1, nbytes)):
                out.append(None)
                continue
            if nbytes:
                ctypes.memmove(p, bytes(T.tensor_bytes(t)), nbytes)
            view = (ctypes.c_char * max(1, nbytes)).from_address(p)
            h = T.Header(
                T.dtype_code(t.dtype), tuple(t.shape), tuple(t.shape), T.FULL, (), 0, nbytes
            )
            out.append(T.tensor_from(view, h, copy=False))
        return out

    @_guard(_none)
    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: Any = None
    ) -> Any:
        """The tensor :meth:`get_tensor_with_parallelism` gives, its bytes (no header)
        written at ``buffer_ptr`` (registered, ``size`` bytes) and viewed there."""
        return self._par_into([_key(key)], [_int(buffer_ptr)], [_int(size)], target)[0]

    @_guard(_each_none)
    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: Any = None
    ) -> list:
        ks, ps, zs = _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
        if not (len(ks) == len(ps) == len(zs)):
            return [None] * len(ks)
        return self._par_into(ks, ps, zs, targets)
