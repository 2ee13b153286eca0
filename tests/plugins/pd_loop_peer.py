"""One SGLang PD instance (prefill or decode) for tests/plugins/test_pd_loop.py.

A process that runs SGLang's own Mooncake PD classes on CPU with the kvmesh plugin loaded
through SGLang's plugin loader, driven through ``bench._common.Child`` JSON lines. What it
builds, in SGLang's order (``disaggregation/prefill.py`` and ``decode.py``):

* ``ServerArgs`` for a tiny local model config, ``publish``-ed as SGLang's scheduler does
  (``runtime_context.publish(..., role="scheduler", ranks=SpawnRanks(world_rank=0))``): the
  runtime context (TP/PP/DP ranks of a single-rank instance) is SGLang's own, not a fake;
* ``maybe_init_shared_mooncake_transfer_engine`` (SGLang's constructor of the shared engine:
  with the plugin it builds ``KvmeshTransferEngine``);
* SGLang's ``MHATokenToKVPool`` on CPU (several layers, K and V) and ``MetadataBuffers`` (the
  aux rows), and ``KVArgs`` filled from them with SGLang's own helpers
  (``get_kv_transfer_buf_infos``, ``build_kv_layer_ids``, ``setup_state_kv_args``,
  ``MetadataBuffers.get_buf_infos``) as ``_init_kv_manager`` does; the ranks are 0 and
  ``kv_cache_dtype_str`` (the model runner's) is the pool's dtype;
* prefill: SGLang's ``MooncakeKVBootstrapServer`` (aiohttp) and ``MooncakeKVManager(PREFILL)``
  (registers to the bootstrap server, starts its ZMQ bootstrap thread and transfer workers),
  one ``MooncakeKVSender`` per request;
* decode: ``MooncakeKVManager(DECODE)`` (ZMQ status thread, heartbeat thread) and one
  ``MooncakeKVReceiver`` per request.

Commands: ``open`` (senders), ``receive`` (receivers: parallel info, ``init``,
``send_metadata``), ``send`` (``init`` + ``send`` of page indices), ``wait`` (poll until every
room concludes; failures through ``failure_exception``), ``digest`` (of pages and a metadata
row), ``stats``, ``exit`` (bootstrap server closed; the process then exits, which ends SGLang's
daemon threads).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

# A tiny Llama whose attention matches the tests' KV geometry (8 KV heads x 128, 2 layers).
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
}


class Memory:
    """The raw bytes of an instance's KV buffers and metadata rows (what KVArgs describes)."""

    def __init__(self, kv_args: Any) -> None:
        import ctypes

        import numpy as np

        def raw(ptr: int, n: int) -> np.ndarray:
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))

        self.kv = [
            raw(p, n).reshape(-1, item)
            for p, n, item in zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens)
        ]
        self.aux = [
            raw(p, n).reshape(-1, item)
            for p, n, item in zip(
                kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens
            )
        ]

    def fill(self, seed: int) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        for buf in self.kv + self.aux:
            buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)

    def digest(self, pages: list[int], aux_row: int | None) -> dict[str, Any]:
        """SHA-256 over the pages of every K then V buffer (and one row of every metadata
        buffer), and how many of those bytes are not zero."""
        import hashlib

        import numpy as np

        h, nonzero = hashlib.sha256(), 0
        parts = [buf[np.asarray(pages, np.int64)] for buf in self.kv]
        if aux_row is not None:
            parts += [buf[aux_row] for buf in self.aux]
        for part in parts:
            part = np.ascontiguousarray(part)
            h.update(part.data)
            nonzero += int(np.count_nonzero(part))
        return {"digest": h.hexdigest(), "nonzero": nonzero}


def wait_healthy(url: str, within: float = 20.0) -> None:
    """Until the bootstrap server answers (SGLang's launcher starts it before the schedulers,
    whose managers register to it at once and back off for a second when it is not up)."""
    import requests

    end = time.monotonic() + within
    while True:
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"bootstrap server at {url} did not come up")
        time.sleep(0.02)


def main() -> None:
    from tests.plugins.sglang_env import add_plugins_path, install_torchvision_stub

    install_torchvision_stub()
    add_plugins_path()

    from bench._pd import geometry_args

    ap = argparse.ArgumentParser()
    geometry_args(ap)
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--eps-dir", required=True)
    ap.add_argument("--bootstrap-port", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    import numpy as np
    import torch

    from bench._common import serve_json_lines
    from kvmesh_sglang.pd import KvmeshTransferEngine
    from tests.plugins.pd_harness import load_plugin_via_sglang

    load_plugin_via_sglang(Path(a.eps_dir))  # SGLang's loader runs kvmesh's entry point

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        setup_state_kv_args,
    )
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_device,
        get_disagg,
        get_parallel,
        publish,
    )
    from sglang.srt.server_args import ServerArgs

    prefill = a.role == "prefill"
    server_args = ServerArgs(
        model_path=a.model_dir,
        skip_tokenizer_init=True,
        device="cpu",
        host="127.0.0.1",
        page_size=a.page_size,
        disaggregation_mode=a.role,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=a.bootstrap_port or 8998,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    # The one runtime-context value publish cannot supply: the PP process group handle, built
    # by torch.distributed init in a real scheduler. CommonKVManager stores it and uses it only
    # when pp_size > 1 (PPConsensusStore); a single-rank instance has none.
    get_parallel().override_permanently(pp_group=None)
    mte.maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    engine = mte.get_mooncake_transfer_engine()
    if not isinstance(engine, KvmeshTransferEngine):
        raise SystemExit(f"SGLang built {type(engine).__name__}, not the kvmesh engine")

    # The instance's KV pool and metadata rows: SGLang's own classes on CPU, and KVArgs filled
    # with SGLang's own helpers, as PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager
    # fill it for an MHA pool.
    kv_pool = MHATokenToKVPool(
        size=a.pages * a.page_size,
        page_size=a.page_size,
        dtype=getattr(torch, a.dtype),
        head_num=a.heads,
        head_dim=a.head_dim,
        layer_num=a.layers,
        device="cpu",
        enable_memory_saver=False,
    )
    metadata = MetadataBuffers(
        size=a.aux_rows,
        hidden_size=MODEL_CONFIG["hidden_size"],
        hidden_states_dtype=getattr(torch, a.dtype),
        max_sampling_mask_tokens=0,
    )
    backend = TransferBackend.MOONCAKE
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    kv_args.engine_rank = kv_args.pp_rank = kv_args.system_dp_rank = 0  # the one rank
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = a.dtype
    kv_args.kv_layout = get_pd_kv_layout(kv_pool)
    kv_args.prefill_start_layer = kv_pool.start_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(
        kv_pool
    )
    kv_args.prefill_end_layer = kv_pool.end_layer
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=kv_pool,
        draft_token_to_kv_pool=None,
        num_draft_entries=0,
        num_hidden_layers=a.layers,
    )
    kv_args.kv_head_num = kv_args.total_kv_head_num = kv_pool.head_num
    kv_args.page_size = kv_pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = get_device().gpu_id
    setup_state_kv_args(kv_args, kv_pool, None, a.layers)
    memory = Memory(kv_args)
    if prefill:
        memory.fill(a.seed)

    bootstrap = None
    if prefill:  # the bootstrap server lives in the prefill instance's main process
        bootstrap = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(
            "127.0.0.1", a.bootstrap_port
        )
        wait_healthy(f"http://127.0.0.1:{a.bootstrap_port}/health")
    mode = DisaggregationMode.PREFILL if prefill else DisaggregationMode.DECODE
    mgr = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, server_args, False)
    bootstrap_addr = f"127.0.0.1:{a.bootstrap_port}"
    peers: dict[int, Any] = {}  # room -> sender (prefill) or receiver (decode)
    concluded: dict[int, dict[str, Any]] = {}

    def open_(rooms: list[int]) -> dict[str, Any]:
        sender_cls = get_kv_class(backend, KVClassType.SENDER)
        for room in rooms:
            peers[room] = sender_cls(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room)
        return {"polls": {str(r): int(peers[r].poll()) for r in rooms}}

    def receive(rooms: list[int], pages: list[list[int]], aux_rows: list[int], addr: str) -> dict:
        receiver_cls = get_kv_class(backend, KVClassType.RECEIVER)
        end = time.monotonic() + 20
        while not mgr.try_ensure_parallel_info(addr):  # the decode scheduler retries too
            if time.monotonic() > end:
                raise TimeoutError(f"no parallel info from the bootstrap server at {addr}")
            time.sleep(0.05)
        for room, pg, row in zip(rooms, pages, aux_rows):
            r = receiver_cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
            r.init(prefill_dp_rank=0)
            peers[room] = r
            if r.poll() != KVPoll.WaitingForInput:
                raise RuntimeError(f"room {room}: receiver at {r.poll()} after init")
            r.send_metadata(np.asarray(pg, np.int32), aux_index=row)
        return {"ok": True}

    def poll(rooms: list[int]) -> dict[str, Any]:
        return {"polls": {str(r): int(peers[r].poll()) for r in rooms}}

    def send(room: int, pages: list[int], aux_row: int, chunks: int = 1) -> dict[str, Any]:
        """``init`` then one ``send`` per prefill chunk (chunked prefill sends page slices)."""
        s = peers[room]
        if s.poll() != KVPoll.WaitingForInput:  # the scheduler only sends past bootstrap
            raise RuntimeError(f"room {room}: sender at {s.poll()}, not WaitingForInput")
        s.pop_decode_prefix_len()
        s.init(len(pages), aux_row)
        for part in np.array_split(np.asarray(pages, np.int32), chunks):
            s.send(part)
        return {"ok": True}

    def wait(rooms: list[int], within: float) -> dict[str, Any]:
        """Poll until every room is Success or Failed (as the scheduler's inflight queue)."""
        end = time.monotonic() + within
        pending = [r for r in rooms if r not in concluded]
        while pending and time.monotonic() < end:
            for r in list(pending):
                st = peers[r].poll()
                if st in (KVPoll.Success, KVPoll.Failed):
                    info: dict[str, Any] = {"status": int(st), "t": time.monotonic()}
                    if st == KVPoll.Failed:
                        try:
                            peers[r].failure_exception()
                        except KVTransferError as exc:
                            info["reason"] = exc.failure_reason
                    else:
                        peers[r].clear()
                    concluded[r] = info
                    pending.remove(r)
            time.sleep(0.01)
        return {
            "concluded": {str(r): concluded[r] for r in rooms if r in concluded},
            "pending": {str(r): int(peers[r].poll()) for r in pending},
            "now": time.monotonic(),
        }

    def digest(pages: list[int], aux_row: int | None = None) -> dict[str, Any]:
        return memory.digest(pages, aux_row)

    def stats() -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine": {k: v for k, v in engine.stats.items() if k != "by_code"},
            "by_code": {str(k): v for k, v in engine.stats["by_code"].items()},
        }
        if prefill:
            with mgr.session_lock:
                out["failed_sessions"] = sorted(mgr.failed_sessions)
                out["session_failures"] = dict(mgr.session_failures)
                # SGLang's failed-session probe loop (on by default): the back-off interval
                # doubles after every probe that fails (KvmeshTransferEngine.send_probe < 0).
                out["probe_intervals"] = {
                    sid: p.interval for sid, p in mgr.failed_session_probes.items()
                }
        return out

    def exit_() -> None:
        # Process exit ends SGLang's daemon threads; teardown() would wait 3 s for each thread
        # parked in a blocking ZMQ recv (it polls only with --enable-pd-role-switch).
        if bootstrap is not None:
            bootstrap.close()

    serve_json_lines(
        {
            "open": open_,
            "receive": receive,
            "poll": poll,
            "send": send,
            "wait": wait,
            "digest": digest,
            "stats": stats,
            "exit": exit_,
        },
        {
            "pid": os.getpid(),
            "role": a.role,
            "session_id": engine.get_session_id(),
            "engine_class": f"{type(engine).__module__}.{type(engine).__qualname__}",
            "bootstrap_addr": bootstrap_addr if prefill else None,
            "rank_port": mgr.rank_port,
            "kv_item_lens": kv_args.kv_item_lens,
            "aux_item_lens": kv_args.aux_item_lens,
        },
    )


if __name__ == "__main__":
    main()
