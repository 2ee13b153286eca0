"""Real SGLang pool classes built on CPU in a fresh process after SGLang's plugin loader ran.

``python -m tests.plugins.shm_pool_child TMPDIR`` prints one JSON line describing, for an MHA
pool, an MLA pool and the PD ``MetadataBuffers``: the memory kind the kvmesh engine gives each
buffer SGLang hands to the transfer engine (``get_contiguous_buf_infos`` / ``get_buf_infos``),
whether the pointer tables SGLang captured at init still match the tensors, and whether bytes
written through the tensor are the bytes of the shared-memory file (mapped a second time).
A fresh process because the hooks patch SGLang's classes for the life of the process.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import pathlib
import sys
from typing import Any


def _kinds(engine: Any, ptrs: list[int], lens: list[int]) -> list[str]:
    out = []
    for p, n in zip(ptrs, lens):
        region = engine.register_raw(int(p), int(n))
        out.append(region.kind.value)
        engine.unregister(region)
    return out


def _same_file(engine: Any, t: Any) -> bool:
    """True if ``t``'s bytes are those of a shared file (written here, read via a 2nd mapping)."""
    import numpy as np

    from kvmesh.transfer import SharedBuffer

    raw = t.view(-1).view(__import__("torch").uint8).numpy()
    raw[:] = np.random.default_rng(5).integers(0, 256, raw.size, dtype=np.uint8)
    region = engine.register_raw(t.data_ptr(), raw.size)
    try:
        if region.shm is None:
            return False
        other = SharedBuffer.attach(region.shm.name)
        try:
            off = t.data_ptr() - region.shm.addr
            return bool((other.array()[off : off + raw.size] == raw).all())
        finally:
            other.close()
    finally:
        engine.unregister(region)


def main() -> None:
    from tests.plugins.sglang_env import add_plugins_path, install_torchvision_stub

    install_torchvision_stub()
    add_plugins_path()
    import torch

    from kvmesh.transfer import init_engine
    from tests.plugins.pd_harness import load_plugin_via_sglang

    load_plugin_via_sglang(pathlib.Path(sys.argv[1]))
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvmesh_sglang import shm_pools

    engine = init_engine(listen="127.0.0.1:0")
    report: dict[str, Any] = {
        "patched": sorted(t for t in shm_pools.TARGETS if t in HookRegistry._patched)
    }
    mha = MHATokenToKVPool(
        size=256,
        page_size=16,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=32,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    ptrs, lens, _ = mha.get_contiguous_buf_infos()
    report["mha"] = {
        "kinds": _kinds(engine, ptrs, lens),
        "k_ptrs_match": mha.k_data_ptrs.tolist() == [t.data_ptr() for t in mha.k_buffer],
        "v_ptrs_match": mha.v_data_ptrs.tolist() == [t.data_ptr() for t in mha.v_buffer],
        "data_ptrs_match": mha.data_ptrs.tolist()
        == [t.data_ptr() for t in mha._slot_move_pointer_buffers()],
        "shapes": [list(t.shape) for t in mha.k_buffer[:1] + mha.v_buffer[:1]],
        "dtype": str(mha.k_buffer[0].dtype),
        "zeroed": all(int(t.abs().sum()) == 0 for t in mha.k_buffer + mha.v_buffer),
        "same_file": _same_file(engine, mha.k_buffer[1]),
    }
    mla = MLATokenToKVPool(
        size=256,
        page_size=16,
        dtype=torch.bfloat16,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    ptrs, lens, _ = mla.get_contiguous_buf_infos()
    report["mla"] = {
        "kinds": _kinds(engine, ptrs, lens),
        "same_file": _same_file(engine, mla.kv_buffer[2]),
    }
    aux = MetadataBuffers(
        size=8,
        hidden_size=64,
        hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=4,
        max_top_logprobs_num=4,
    )
    ptrs, lens, _ = aux.get_buf_infos()
    report["aux"] = {"kinds": _kinds(engine, ptrs, lens)}
    report["stats"] = dict(shm_pools.stats)
    report["pid"] = os.getpid()
    mine = f"/dev/shm/kvmesh-{os.getpid()}-*"
    report["files_before_free"] = len(glob.glob(mine))
    del mha, mla, aux
    gc.collect()
    report["files_after_free"] = len(glob.glob(mine))  # the engine's fence file stays
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
