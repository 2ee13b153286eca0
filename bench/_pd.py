"""PD (prefill/decode) helpers shared by bench/pd.py and tests/plugins: KV pools and a decode peer.

* :class:`KVPool`: CPU tensors laid out like an SGLang MHA KV pool: one K and one V buffer per
  layer of ``pages * page_size`` token rows (``[tokens, heads, head_dim]``), plus aux buffers
  with one row per request. ``kv_data_ptrs`` lists all K layers, then all V layers, and
  ``kv_item_lens`` is the bytes of one page of one layer
  (SGLang's ``KVArgs``; docs/sglang.md, "PD disaggregation").
* :func:`page_digest`: a SHA-256 of given pages of every layer buffer (byte-for-byte checks
  across processes).
* :func:`serve_decode`: the decode side as a helper process (``python -m bench._pd``): it builds
  a pool, registers it through :class:`kvmesh_sglang.pd.KvmeshTransferEngine` (the class SGLang
  constructs once the plugin is loaded) and answers JSON-line commands (:class:`_common.Child`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE.parent / "plugins")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}
# "private": torch's own allocations, like SGLang's pools by default (same-host peers reach them
# through NIXL/UCX cma); "shm": the allocations KVMESH_SGLANG_SHM_POOLS=1 gives SGLang's CPU
# pools (kvmesh_sglang.shm_pools), which same-host peers write with the shm transport.
POOL_MEMORY = ("private", "shm")


def _torch_u8() -> Any:
    import torch

    return torch.uint8


def _allocations(memory: str) -> Any:
    if memory != "shm":
        import contextlib

        return contextlib.nullcontext()
    from kvmesh_sglang.shm_pools import shared_allocations

    return shared_allocations()


class KVPool:
    """A KV pool shaped like SGLang's (MHA), plus aux rows (always host memory, as in SGLang).

    ``device="cpu"``: torch CPU tensors. ``device="cuda"``: ``cudaMalloc`` buffers through
    ``kvmesh.transfer.cuda`` (no CUDA build of torch needed), read and written by copies.
    Aux rows are numpy arrays: host memory in every case. ``memory="shm"`` (CPU only) allocates
    the K/V tensors and the aux rows as ``KVMESH_SGLANG_SHM_POOLS=1`` does for SGLang's pools.
    """

    def __init__(
        self,
        layers: int,
        pages: int,
        page_size: int,
        heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        aux_rows: int = 64,
        aux_item_lens: Sequence[int] = (64, 256),
        device: str = "cpu",
        memory: str = "private",
    ) -> None:
        if memory not in POOL_MEMORY or (memory == "shm" and device != "cpu"):
            raise ValueError(f"pool memory {memory!r} on {device!r}: shm is for CPU pools only")
        self.layers, self.pages, self.page_size = layers, pages, page_size
        self.heads, self.head_dim, self.device = heads, head_dim, device
        self.memory = memory
        self.item_len = page_size * heads * head_dim * DTYPES[dtype]
        self.nbytes = pages * self.item_len  # one layer buffer
        tokens = pages * page_size
        if device == "cpu":
            import torch

            tdtype = getattr(torch, dtype)
            with _allocations(memory):
                # torch.empty: pages are written before they are read (fill / a transfer).
                shape = (tokens, heads, head_dim)
                self.k = [torch.empty(shape, dtype=tdtype) for _ in range(layers)]
                self.v = [torch.empty(shape, dtype=tdtype) for _ in range(layers)]
        else:
            from kvmesh.transfer import cuda

            self.k = [cuda.malloc(self.nbytes) for _ in range(layers)]
            self.v = [cuda.malloc(self.nbytes) for _ in range(layers)]
        if memory == "shm":  # SGLang's aux rows are torch CPU tensors (MetadataBuffers)
            from kvmesh_sglang.shm_pools import shared_tensor

            self.aux = [shared_tensor((aux_rows, n), _torch_u8()).numpy() for n in aux_item_lens]
        else:
            self.aux = [np.zeros((aux_rows, n), np.uint8) for n in aux_item_lens]  # metadata rows
        self.aux_item_lens = list(aux_item_lens)

    @property
    def buffers(self) -> list[Any]:
        return self.k + self.v

    @property
    def kv_data_ptrs(self) -> list[int]:
        if self.device != "cpu":
            return list(self.buffers)
        return [t.data_ptr() for t in self.buffers]

    @property
    def kv_data_lens(self) -> list[int]:
        return [self.nbytes] * (2 * self.layers)

    @property
    def kv_item_lens(self) -> list[int]:
        return [self.item_len] * (2 * self.layers)

    @property
    def aux_data_ptrs(self) -> list[int]:
        return [a.ctypes.data for a in self.aux]

    @property
    def aux_data_lens(self) -> list[int]:
        return [a.nbytes for a in self.aux]

    @staticmethod
    def raw(t: Any) -> np.ndarray:
        """The bytes of CPU tensor ``t`` as a writable uint8 numpy view."""
        return t.view(-1).view(__import__("torch").uint8).numpy()

    def _write_buffer(self, i: int, data: np.ndarray) -> None:
        if self.device == "cpu":
            self.raw(self.buffers[i])[:] = data
        else:
            from kvmesh.transfer import cuda

            cuda.copy(self.buffers[i], np.ascontiguousarray(data).ctypes.data, self.nbytes)

    def _pages(self, i: int, pages: np.ndarray) -> np.ndarray:
        if self.device == "cpu":
            return self.raw(self.buffers[i]).reshape(self.pages, self.item_len)[pages]
        from kvmesh.transfer import cuda

        out = np.empty((len(pages), self.item_len), np.uint8)
        for j, p in enumerate(pages.tolist()):
            cuda.copy(out[j].ctypes.data, self.buffers[i] + p * self.item_len, self.item_len)
        return out

    def fill(self, seed: int) -> None:
        """Distinct pseudo-random bytes in every page of every buffer (and every aux row)."""
        rng = np.random.default_rng(seed)
        for i in range(2 * self.layers):
            self._write_buffer(i, rng.integers(0, 256, self.nbytes, dtype=np.uint8))
        for a in self.aux:
            a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)

    def zero(self) -> None:
        zeros = np.zeros(self.nbytes, np.uint8)
        for i in range(2 * self.layers):
            self._write_buffer(i, zeros)
        for a in self.aux:
            a[:] = 0

    def page_digest(self, pages: Sequence[int], aux_row: int | None = None) -> str:
        """SHA-256 over the given pages of every K then V buffer (and one aux row of each)."""
        h = hashlib.sha256()
        idx = np.asarray(pages, dtype=np.int64)
        for i in range(2 * self.layers):
            h.update(np.ascontiguousarray(self._pages(i, idx)).data)
        if aux_row is not None:
            for a in self.aux:
                h.update(a[aux_row].data)
        return h.hexdigest()

    def register(self, engine: Any) -> int:
        """``batch_register`` of every KV and aux buffer (device and host mixed), as SGLang's
        manager does."""
        return engine.batch_register(
            self.kv_data_ptrs + self.aux_data_ptrs, self.kv_data_lens + self.aux_data_lens
        )

    def close(self) -> None:
        if self.device != "cpu":
            from kvmesh.transfer import cuda

            for p in self.buffers:
                cuda.free(p)
            self.k, self.v = [], []


def geometry_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--aux-rows", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--pool-memory", default="private", choices=POOL_MEMORY)


def pool_from_args(a: argparse.Namespace) -> KVPool:
    return KVPool(
        a.layers,
        a.pages,
        a.page_size,
        a.heads,
        a.head_dim,
        a.dtype,
        a.aux_rows,
        device=a.device,
        memory=a.pool_memory,
    )


def geometry_argv(
    layers: int,
    pages: int,
    page_size: int,
    heads: int,
    head_dim: int,
    dtype: str = "bfloat16",
    aux_rows: int = 64,
    device: str = "cpu",
    memory: str = "private",
) -> list[str]:
    return [
        "--layers",
        str(layers),
        "--pages",
        str(pages),
        "--page-size",
        str(page_size),
        "--heads",
        str(heads),
        "--head-dim",
        str(head_dim),
        "--dtype",
        dtype,
        "--aux-rows",
        str(aux_rows),
        "--device",
        device,
        "--pool-memory",
        memory,
    ]


def serve_decode(argv: Sequence[str] | None = None) -> None:
    """The decode process: a registered, zeroed pool; answers ``digest``/``zero``/``deregister``/
    ``stats``/``exit``."""
    from bench._common import serve_json_lines
    from kvmesh_sglang.pd import KvmeshTransferEngine

    ap = argparse.ArgumentParser()
    geometry_args(ap)
    ap.add_argument("--hostname", default="127.0.0.1")
    a = ap.parse_args(argv)
    pool = pool_from_args(a)
    pool.zero()
    eng = KvmeshTransferEngine(a.hostname)
    rc = pool.register(eng)
    if rc != 0:
        raise SystemExit(f"batch_register failed: {rc}")

    def digest(pages: list[int], aux_row: int | None = None) -> dict[str, Any]:
        return {"digest": pool.page_digest(pages, aux_row)}

    def zero() -> dict[str, Any]:
        pool.zero()
        return {"ok": True}

    def deregister() -> dict[str, Any]:
        # As SGLang's manager does on shutdown; the memory itself stays (the pool is alive).
        return {"rc": eng.batch_deregister(pool.kv_data_ptrs + pool.aux_data_ptrs)}

    serve_json_lines(
        {
            "digest": digest,
            "zero": zero,
            "deregister": deregister,
            "stats": lambda: {"stats": {k: v for k, v in eng.stats.items() if k != "by_code"}},
        },
        {
            "session_id": eng.get_session_id(),
            "pid": os.getpid(),
            "kv_data_ptrs": pool.kv_data_ptrs,
            "kv_data_lens": pool.kv_data_lens,
            "aux_data_ptrs": pool.aux_data_ptrs,
            "aux_data_lens": pool.aux_data_lens,
            "host_id": eng.engine.host_id,
            "pool_memory": pool.memory,
        },
    )


if __name__ == "__main__":
    serve_decode()
