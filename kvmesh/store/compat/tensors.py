"""Mooncake's tensor object format, byte for byte: a ``TensorMetadata`` header, then the
tensor's bytes (``mooncake-integration/integration_utils.h`` in Mooncake's sources).

``TensorMetadata`` (304 bytes, little-endian, naturally aligned so no padding):

* ``TensorObjectHeader`` (40): ``u32 magic`` (0x4d4f4f4e), ``u16 version`` (1), ``u16
  header_size`` (304), ``i32 dtype`` (Mooncake's ``TensorDtype``), ``i32 ndim`` (<= 8), ``u32
  layout_kind`` (0 full, 1 shard), ``u32 reserved_flags``, ``u64 data_offset`` (304), ``u64
  data_bytes``;
* ``TensorLayoutMetadata`` (264): ``i64 global_shape[8]``, ``i64 local_shape[8]`` (unused dims
  -1), ``u32 axis_count`` (<= 4), ``u32 reserved0``, four ``LayoutAxis`` of ``i32 kind`` (DP 0,
  TP 1, EP 2, PP 3), ``i32 axis_index``, ``i32 shard_rank``, ``i32 shard_count``, ``i32
  split_dim``, ``i32 reserved0``, ``i64 reserved1``.

A TP shard (``*_with_tp``: key ``<key>_tp_<rank>``) has layout SHARD with one TP axis; the
shards are equal chunks along ``split_dim`` (a dimension not divisible by ``tp_size`` is
refused, as in Mooncake). This module only encodes and decodes; the store moves bytes.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "Header",
    "decode",
    "encode",
    "shard",
    "tensor_from",
]

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
FULL, SHARD = 0, 1
AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
_HEAD = struct.Struct("<IHHiiIIQQ")
_LAYOUT = struct.Struct("<8q8qII")
_AXIS = struct.Struct("<iiiiiiq")
HEADER_SIZE = _HEAD.size + _LAYOUT.size + MAX_AXES * _AXIS.size
assert HEADER_SIZE == 304

# Mooncake's TensorDtype order; torch names.
_DTYPES = (
    "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
    "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_SIZES = (4, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 1, 1)


class Header(NamedTuple):
    dtype: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    layout_kind: int = FULL
    axes: tuple[tuple[int, int, int, int, int], ...] = ()  # kind, index, rank, count, split
    data_offset: int = HEADER_SIZE
    data_bytes: int = 0


def dtype_code(dtype: Any) -> int | None:
    name = str(dtype).removeprefix("torch.")
    try:
        return _DTYPES.index(name)
    except ValueError:
        return None


def torch_dtype(code: int) -> Any:
    import torch

    return getattr(torch, _DTYPES[code])


def encode(h: Header) -> bytes:
    ndim = len(h.local_shape)
    g = list(h.global_shape) + [-1] * (MAX_DIMS - ndim)
    loc = list(h.local_shape) + [-1] * (MAX_DIMS - ndim)
    out = [
        _HEAD.pack(MAGIC, VERSION, HEADER_SIZE, h.dtype, ndim, h.layout_kind, 0,
                   h.data_offset, h.data_bytes),
        _LAYOUT.pack(*g, *loc, len(h.axes), 0),
    ]  # fmt: skip
    for i in range(MAX_AXES):
        out.append(_AXIS.pack(*h.axes[i], 0, 0) if i < len(h.axes) else bytes(_AXIS.size))
    return b"".join(out)


def decode(buf: Any) -> Header | None:
    """The header of a stored tensor object, or None when it is not one (Mooncake's
    ``ValidateTensorMetadata``: the same checks)."""
    mv = memoryview(buf).cast("B")
    n = len(mv)
    if n < HEADER_SIZE:
        return None
    magic, ver, hsize, dtype, ndim, kind, _f, off, nbytes = _HEAD.unpack_from(mv, 0)
    lay = _LAYOUT.unpack_from(mv, _HEAD.size)
    if magic != MAGIC or ver != VERSION or hsize != HEADER_SIZE:
        return None
    if not (0 <= dtype < len(_DTYPES)) or not (0 <= ndim <= MAX_DIMS) or kind > SHARD:
        return None
    g, loc, count = lay[:MAX_DIMS], lay[MAX_DIMS : 2 * MAX_DIMS], lay[2 * MAX_DIMS]
    if count > MAX_AXES or not (HEADER_SIZE <= off <= n) or nbytes != n - off:
        return None
    if any(d < 0 for d in g[:ndim] + loc[:ndim]):
        return None
    if any(d != -1 for d in g[ndim:] + loc[ndim:]):
        return None
    numel = 1
    for d in loc[:ndim]:
        numel *= d
    if numel * _SIZES[dtype] != nbytes:
        return None
    axes = []
    for i in range(count):
        ak, ai, rank, cnt, split, _r0, _r1 = _AXIS.unpack_from(
            mv, _HEAD.size + _LAYOUT.size + i * _AXIS.size
        )
        if not (0 <= ak <= 4) or cnt <= 0 or not (0 <= rank < cnt) or not (-1 <= split < ndim):
            return None
        axes.append((ak, ai, rank, cnt, split))
    return Header(dtype, tuple(g[:ndim]), tuple(loc[:ndim]), kind, tuple(axes), off, nbytes)


def full_header(t: Any) -> Header | None:
    code = dtype_code(t.dtype)
    if code is None or t.dim() > MAX_DIMS:
        return None
    shape = tuple(t.shape)
    return Header(code, shape, shape, FULL, (), HEADER_SIZE, t.numel() * t.element_size())


def shard(t: Any, rank: int, size: int, split_dim: int) -> tuple[Any, Header] | None:
    """Rank ``rank``'s equal chunk of ``t`` along ``split_dim`` and its SHARD header."""
    code = dtype_code(t.dtype)
    nd = t.dim()
    if code is None or nd > MAX_DIMS or size <= 0 or not 0 <= rank < size:
        return None
    if split_dim < 0:
        split_dim += nd
    if not 0 <= split_dim < nd or t.shape[split_dim] % size:
        return None
    step = t.shape[split_dim] // size
    part = t.narrow(split_dim, rank * step, step).contiguous()
    axes = ((AXIS_KINDS["tp"], 0, rank, size, split_dim),)
    h = Header(code, tuple(t.shape), tuple(part.shape), SHARD, axes, HEADER_SIZE,
               part.numel() * part.element_size())  # fmt: skip
    return part, h


def tensor_bytes(t: Any) -> memoryview:
    """A contiguous CPU tensor's bytes (a view, no copy when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if not t.numel():
        return memoryview(b"")
    import torch

    return memoryview(t.view(-1).view(torch.uint8).numpy())


def tensor_from(buf: Any, h: Header, *, copy: bool = True) -> Any:
    """The tensor a stored object holds (``buf``: the whole object), shaped as stored."""
    import torch

    dt = torch_dtype(h.dtype)
    data = memoryview(buf).cast("B")[h.data_offset : h.data_offset + h.data_bytes]
    if not h.data_bytes:
        return torch.empty(h.local_shape, dtype=dt)
    t = torch.frombuffer(data if not copy else bytearray(data), dtype=torch.uint8)
    return t.view(dt).reshape(h.local_shape)
