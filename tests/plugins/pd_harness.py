"""The prefill side of the PD tests: SGLang's own plugin loader and Mooncake KV manager on CPU.

:func:`load_plugin_via_sglang` makes the ``sglang.srt.plugins`` entry point that pyproject.toml
declares visible (a dist-info built from pyproject, first on ``sys.path``: a worktree is not
installed) and runs SGLang's ``load_plugins()``. :func:`prefill_manager` builds a real
``MooncakeKVManager`` without its ``__init__`` (which needs a running server: bootstrap, ZMQ,
parallel state) and sets the fields its transfer methods read, so ``send_kvcache``,
``send_aux``, ``register_buffer_to_engine`` and ``_transfer_data`` run SGLang's own code.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

from bench._pd import KVPool

from .sglang_env import ROOT

_loaded: dict[str, Any] = {}


def entry_points_dist(where: Path) -> Path:
    """A ``kvmesh`` dist-info under ``where`` with pyproject's ``sglang.srt.plugins`` entries."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    eps = project["entry-points"]["sglang.srt.plugins"]
    d = where / f"kvmesh-{project['version']}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: kvmesh\nVersion: {project['version']}\n"
    (d / "METADATA").write_text(meta)
    (d / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    return where


def load_plugin_via_sglang(tmp: Path) -> types.ModuleType:
    """Run SGLang's plugin loader once per process; returns the patched engine module."""
    if "mte" not in _loaded:
        sys.path.insert(0, str(entry_points_dist(tmp)))
        importlib.invalidate_caches()
        from sglang.srt import plugins
        from sglang.srt.distributed.device_communicators import (
            mooncake_transfer_engine as mte,
        )

        _loaded["original"] = mte.MooncakeTransferEngine
        plugins.load_plugins()
        _loaded["mte"] = mte
    return _loaded["mte"]


def original_engine_class() -> type:
    return _loaded["original"]


def prefill_manager(pool: KVPool, monkeypatch: Any) -> Any:
    """A ``MooncakeKVManager`` (prefill role) over ``pool``, with SGLang's shared engine."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake import conn as mc

    # The one runtime-context read on this path (unified memory off, as by default).
    memory = types.SimpleNamespace(enable_unified_memory=False)
    monkeypatch.setattr(mc, "get_memory", lambda: memory)
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens = pool.kv_data_ptrs, pool.kv_data_lens
    args.kv_item_lens = pool.kv_item_lens
    args.kv_layer_ids = None
    args.aux_data_ptrs, args.aux_data_lens = pool.aux_data_ptrs, pool.aux_data_lens
    args.aux_item_lens = pool.aux_item_lens
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.prefill_start_layer = 0
    mgr = object.__new__(mc.MooncakeKVManager)
    mgr.kv_args = args
    mgr.is_mla_backend = mgr.is_hybrid_mla_backend = False
    mgr.pp_size = 1
    mgr.enable_custom_mem_pool, mgr.custom_mem_pool_type = False, None
    mgr.max_transfer_batch_indices = 0
    mgr.state_strides_validated = set()
    mgr.init_engine()  # SGLang's: get_mooncake_transfer_engine()
    mgr.register_buffer_to_engine()
    return mgr


def transfer_info(session_id: str, dst_aux_index: int) -> Any:
    """The two fields of ``TransferInfo`` that ``send_aux`` reads."""
    return types.SimpleNamespace(mooncake_session_id=session_id, dst_aux_index=dst_aux_index)
