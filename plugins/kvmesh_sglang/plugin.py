"""The ``sglang.srt.plugins`` entry point of kvmesh.

SGLang runs :func:`load` in every process it starts (engine, schedulers, detokenizer), before
it builds anything. It only registers a ``HookRegistry`` REPLACE of SGLang's
``MooncakeTransferEngine`` class; the kvmesh engine itself starts when SGLang constructs the
transfer engine, that is in scheduler processes with ``--disaggregation-transfer-backend
mooncake`` (or ``mooncake_tcp``).

``KVMESH_SGLANG_PD``: ``1`` (the default once kvmesh is installed) swaps the engine, ``0`` leaves
SGLang's Mooncake engine in place. ``SGLANG_PLUGINS`` (SGLang's own allow list) can exclude the
plugin, named ``kvmesh_pd``, as well.

``KVMESH_SGLANG_SHM_POOLS``: ``1`` also allocates CPU KV pools and the PD aux buffers in kvmesh
shared memory (:mod:`kvmesh_sglang.shm_pools`), so a same-host peer copies them with memcpy;
off by default, and never applied to CUDA pools.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvmesh.sglang")

ENV_PD = "KVMESH_SGLANG_PD"
TARGET = (
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
)
_OFF = {"0", "false", "no", "off"}


def pd_enabled() -> bool:
    return os.environ.get(ENV_PD, "1").strip().lower() not in _OFF


def load() -> None:
    """Register the kvmesh PD engine with SGLang's ``HookRegistry``; never raises.

    A failure here (kvmesh or SGLang too old to import) is logged and leaves SGLang untouched:
    a plugin must not stop SGLang's other processes from starting.
    """
    if not pd_enabled():
        log.info(
            "kvmesh PD plugin off (%s=%s): SGLang keeps its Mooncake transfer engine",
            ENV_PD,
            os.environ.get(ENV_PD),
        )
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from .pd import KvmeshTransferEngine

        HookRegistry.register(TARGET, KvmeshTransferEngine, HookType.REPLACE)
    except Exception:
        log.exception(
            "kvmesh PD plugin could not be registered; SGLang keeps its Mooncake transfer engine"
        )
        return
    log.info("kvmesh PD plugin: MooncakeTransferEngine -> kvmesh_sglang.pd.KvmeshTransferEngine")
    from . import shm_pools

    if shm_pools.shm_pools_enabled():
        try:
            shm_pools.install(HookRegistry, HookType.AROUND)
        except Exception:
            log.exception("kvmesh shm pools could not be registered; pools stay private memory")
            return
        log.info("kvmesh PD plugin: CPU KV pools and PD aux buffers in shared memory")
