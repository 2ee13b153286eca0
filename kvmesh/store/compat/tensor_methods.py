"""The tensor methods of ``MooncakeDistributedStore`` (a mixin of :mod:`.store`): Mooncake's
tensor object format (:mod:`.tensors`) over the store's byte and pointer paths; the TP and
parallelism forms are :mod:`.tensor_sharded`."""

from __future__ import annotations

import ctypes
from typing import Any

from . import tensors as T
from ._common import (
    _config,
    _each,
    _each_none,
    _guard,
    _int,
    _ints,
    _key,
    _keys,
    _none,
    _one,
    _put_code,
    _res,
)
from .constants import (
    BUFFER_OVERFLOW,
    FILE_NOT_FOUND,
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
)
from .types import ReplicateConfig


class TensorMethods:
    """Needs from the class: ``_cfg``, ``_live``, ``_put_ptrs``, ``_get_ptrs``,
    ``_get_values_unstaged``, ``_registered``."""

    # ================================================================== tensors

    def _tensor_objs(self, tensors: list[Any]) -> list[bytes | int]:
        """Mooncake's tensor objects (header + bytes) for tensors; -600 for one that cannot
        be one (not a tensor, an unsupported dtype, more than 8 dims)."""
        out: list[bytes | int] = []
        for t in tensors:
            h = T.full_header(t) if hasattr(t, "dtype") and hasattr(t, "dim") else None
            out.append(INVALID_PARAMS if h is None else T.encode(h) + bytes(T.tensor_bytes(t)))
        return out

    def _put_objs(
        self, keys: list[str], objs: list[bytes | int], config: Any, upsert: bool
    ) -> list[int]:
        out = [o if isinstance(o, int) else 0 for o in objs]
        todo = [i for i, o in enumerate(objs) if not isinstance(o, int)]
        if todo:
            res = self._put_objs_raw(
                [keys[i] for i in todo], [objs[i] for i in todo], config, upsert
            )
            for i, r in zip(todo, res):
                out[i] = r
        return out

    def _put_objs_raw(
        self, keys: list[str], objs: list[Any], config: Any, upsert: bool
    ) -> list[int]:
        """Tensor puts are zero-copy from the tensor in Mooncake: no local-buffer limit."""
        cfg, err = self._cfg(_config(config), len(keys))
        if err:
            return [err] * len(keys)
        c = self._live()
        res = (c.upsert if upsert else c.put)(keys, objs, config=cfg)
        return [_res(r) if upsert else _put_code(r) for r in res]

    def _tensors(self, keys: list[str]) -> list[Any]:
        out = []
        for v in self._get_values_unstaged(keys) if keys else []:
            h = T.decode(v) if isinstance(v, bytes) else None
            out.append(None if h is None else T.tensor_from(v, h))
        return out

    @_guard(_one)
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a tensor in Mooncake's format (header + bytes), shape and dtype with it."""
        return self._put_objs([_key(key)], self._tensor_objs([tensor]), None, False)[0]

    @_guard(_one)
    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_objs([_key(key)], self._tensor_objs([tensor]), None, True)[0]

    @_guard(_one)
    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """:meth:`put_tensor` with a replication config."""
        return self._put_objs([_key(key)], self._tensor_objs([tensor]), config, False)[0]

    @_guard(_one)
    def upsert_pub_tensor(
        self, key: str, tensor: Any, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_objs([_key(key)], self._tensor_objs([tensor]), config, True)[0]

    def _batch_tensors(self, keys: Any, tensors: Any, config: Any, upsert: bool) -> list[int]:
        ks = _keys(keys)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(ks):
            return [INVALID_PARAMS] * len(ks)
        return self._put_objs(ks, self._tensor_objs(list(tensors)), config, upsert)

    @_guard(_each)
    def batch_put_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._batch_tensors(keys, tensors_list, None, False)

    @_guard(_each)
    def batch_upsert_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._batch_tensors(keys, tensors_list, None, True)

    @_guard(_each)
    def batch_pub_tensor(
        self, keys: list[str], tensors_list: list, config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._batch_tensors(keys, tensors_list, config, False)

    @_guard(_each)
    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list, config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._batch_tensors(keys, tensors_list, config, True)

    @_guard(_none)
    def get_tensor(self, key: str) -> Any:
        """The tensor (dtype and shape as stored), or None."""
        return self._tensors([_key(key)])[0]

    @_guard(_each_none)
    def batch_get_tensor(self, keys: list[str]) -> list:
        return self._tensors(_keys(keys))

    def _from_objs(
        self, keys: list[str], ptrs: list[int], sizes: list[int], upsert: bool, config: Any = None
    ) -> list[int]:
        """``*_tensor_from``: the buffer holds a whole tensor object (header + bytes); it is
        checked, then stored as it is."""
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        ok = []
        out = [0] * len(keys)
        for i, (p, n) in enumerate(zip(ptrs, sizes)):
            if p == 0 or n < T.HEADER_SIZE or T.decode(ctypes.string_at(p, n)) is None:
                out[i] = INVALID_PARAMS
            else:
                ok.append(i)
        if ok:
            res = self._put_ptrs(
                [keys[i] for i in ok], [ptrs[i] for i in ok], [sizes[i] for i in ok], config, upsert
            )
            for i, r in zip(ok, res):
                out[i] = r
        return out

    @_guard(_one)
    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._from_objs([_key(key)], [_int(buffer_ptr)], [_int(size)], False)[0]

    @_guard(_one)
    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._from_objs([_key(key)], [_int(buffer_ptr)], [_int(size)], True)[0]

    @_guard(_each)
    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self._from_objs(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"), False
        )

    @_guard(_each)
    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self._from_objs(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes"), True
        )

    def _tensor_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[Any]:
        """Read whole tensor objects into registered buffers; per key a tensor viewing the
        buffer's data part (no copy), or None."""
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [None] * len(keys)
        got = self._get_ptrs(keys, ptrs, sizes) if keys else []
        out = []
        for p, n in zip(ptrs, got):
            if n < T.HEADER_SIZE:
                out.append(None)
                continue
            view = (ctypes.c_char * n).from_address(p)
            h = T.decode(view)
            out.append(None if h is None else T.tensor_from(view, h, copy=False))
        return out

    @_guard(_none)
    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        return self._tensor_into([_key(key)], [_int(buffer_ptr)], [_int(size)])[0]

    @_guard(_each_none)
    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list:
        return self._tensor_into(
            _keys(keys), _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
        )

    @_guard(_one)
    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Read a tensor object's data into a CUDA (or CPU) tensor of the same size: bytes
        read, or a code (-10: the tensor is too small; -600: not a tensor object)."""
        return self._into_tensors([_key(key)], [tensor])[0]

    @_guard(_each)
    def batch_get_tensor_into_cuda(self, keys: list[str], tensors_list: list) -> list[int]:
        ks = _keys(keys)
        if not isinstance(tensors_list, (list, tuple)) or len(tensors_list) != len(ks):
            return [INVALID_PARAMS] * len(ks)
        return self._into_tensors(ks, list(tensors_list))

    def _into_tensors(self, keys: list[str], dsts: list[Any]) -> list[int]:
        out = []
        for t, dst in zip(self._tensors(keys), dsts):
            if t is None:
                out.append(OBJECT_NOT_FOUND)
            elif (
                not hasattr(dst, "numel")
                or dst.numel() * dst.element_size() < t.numel() * t.element_size()
            ):
                out.append(BUFFER_OVERFLOW)
            else:
                flat = dst.view(-1).view(t.dtype)[: t.numel()]
                flat.copy_(t.reshape(-1))
                out.append(t.numel() * t.element_size())
        return out

    # ------------------------------------------------------------------ safetensors

    @_guard(_one)
    def save_tensor_to_safetensor(self, key: str, file_name: Any = None) -> int:
        """Write the stored tensor to a safetensors file (``file_name``, default the key)
        under the key's name; 0, or -1100 when there is no such tensor."""
        t = self._tensors([_key(key)])[0]
        if t is None:
            return FILE_NOT_FOUND
        from safetensors.torch import save_file

        save_file({key: t.contiguous()}, key if file_name is None else str(file_name))
        return 0

    @_guard(_none)
    def load_tensor_from_safetensor(self, key: Any = None, file_name: str = "") -> Any:
        """Put the file's tensor named ``key`` (else its first) under ``key`` (default: the
        file name); the tensor, or None."""
        if not isinstance(file_name, str):
            raise TypeError("file_name must be str")
        from safetensors.torch import load_file

        loaded = load_file(file_name)
        if not loaded:
            return None
        target = file_name if key is None else _key(key)
        name = target if key is not None and target in loaded else next(iter(loaded))
        t = loaded[name]
        return t if self._put_objs([target], self._tensor_objs([t]), None, False)[0] == 0 else None
