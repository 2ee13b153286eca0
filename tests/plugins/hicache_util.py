"""Real SGLang host KV pools on CPU and helpers of the HiCache backend tests.

Pools are built the way the installed SGLang builds them (sglang-interfaces.md §4.1): 0.5.23
from buffer infos of CPU tensors, 0.5.14 from a real device pool on CPU (its host pools take
the device pool); ``pin_memory=False`` in both. Page contents are derived from a seed, so two
processes can fill and check the same pages independently.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def page_keys(n: int, salt: str = "") -> list[str]:
    """SGLang-shaped page keys: a chain of 64-hex SHA-256 digests."""
    out, prev = [], salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def build_pool(
    kind: str,
    layout: str,
    *,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    page_size: int = 16,
    device_tokens: int = 256,
    dtype: Any = torch.bfloat16,
    mla_dim: int = 72,
) -> Any:
    try:
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MHABufferInfo,
            MLABufferInfo,
        )
    except ImportError:  # SGLang 0.5.14: host pools are built from a device pool
        pool = _build_pool_0514(
            kind, layout, layers, heads, head_dim, page_size, device_tokens, dtype, mla_dim
        )
        pool._kvmesh_kind = kind
        return pool

    cpu = torch.device("cpu")
    if kind == "mha":
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        k = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers)]
        v = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers)]
        info = MHABufferInfo(
            buffers=KVBuffers(
                k=tuple(k), v=tuple(v),
                k_data_ptrs=torch.tensor([x.data_ptr() for x in k], dtype=torch.uint64),
                v_data_ptrs=torch.tensor([x.data_ptr() for x in v], dtype=torch.uint64),
                layout=KVBufferLayout.NHD,
            ),
            page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
            dtype=dtype, device=cpu,
        )  # fmt: skip
        pool = MHATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers - 1,
        )  # fmt: skip
    else:
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        bufs = tuple(torch.zeros(device_tokens, 1, mla_dim, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(
            buffers=bufs,
            data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
            layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
            kv_lora_rank=mla_dim - 8, qk_rope_head_dim=8, kv_cache_dim=mla_dim, dtype=dtype,
            device=cpu,
        )  # fmt: skip
        pool = MLATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers - 1,
            target_layer_num=layers,
        )  # fmt: skip
    pool._kvmesh_kind = kind
    return pool


def _build_pool_0514(
    kind: str,
    layout: str,
    layers: int,
    heads: int,
    head_dim: int,
    page_size: int,
    device_tokens: int,
    dtype: Any,
    mla_dim: int,
) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    if kind == "mha":
        dev = MHATokenToKVPool(
            device_tokens, page_size, dtype, heads, head_dim, layers, "cpu", False
        )
        return MHATokenToKVPoolHost(dev, 2.0, 0, page_size, layout, pin_memory=False, device="cpu")
    dev = MLATokenToKVPool(device_tokens, page_size, dtype, mla_dim - 8, 8, layers, "cpu", False)
    return MLATokenToKVPoolHost(dev, 2.0, 0, page_size, layout, pin_memory=False, device="cpu")


def storage_config(
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str | None = "org/test-model",
    extra: dict | None = None,
    page_first: bool = True,
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=page_first, model_name=model, extra_config=extra,
    )  # fmt: skip


def fill_pages(pool: Any, host_indices: torch.Tensor, seeds: list[int]) -> None:
    """Write seeded bytes into each page (through SGLang's own flat-page accessors)."""
    ps = pool.page_size
    for i, seed in enumerate(seeds):
        flat = pool.get_dummy_flat_data_page()
        g = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randn(flat.numel(), generator=g).to(flat.dtype))
        pool.set_from_flat_data_page(int(host_indices[i * ps]), flat)


def page_digests(pool: Any, host_indices: torch.Tensor, n: int) -> list[str]:
    ps = pool.page_size
    out = []
    for i in range(n):
        page = pool.get_data_page(int(host_indices[i * ps]), flat=True).contiguous()
        out.append(hashlib.sha256(page.view(torch.uint8).numpy().tobytes()).hexdigest())
    return out


def expected_digests(kind: str, layout: str, seeds: list[int], **geometry: Any) -> list[str]:
    """Digests of seeded pages as a fresh pool of the same geometry holds them."""
    pool = build_pool(kind, layout, **geometry)
    idx = pool.alloc(len(seeds) * pool.page_size)
    fill_pages(pool, idx, seeds)
    return page_digests(pool, idx, len(seeds))
