"""SGLang plugins of kvmesh (docs/sglang.md).

* :mod:`kvmesh_sglang.plugin`: the ``sglang.srt.plugins`` entry point; it swaps SGLang's
  Mooncake transfer engine for :class:`kvmesh_sglang.pd.KvmeshTransferEngine` (PD
  disaggregation on kvmesh), unless ``KVMESH_SGLANG_PD=0``.
* :mod:`kvmesh_sglang.hicache`: :class:`~kvmesh_sglang.hicache.KvmeshHiCacheStorage`, SGLang's
  HiCache L3 storage on the kvmesh store (``--hicache-storage-backend dynamic``);
  :mod:`kvmesh_sglang.mooncake_compat`: SGLang's own Mooncake backend on kvmesh (opt-in).
"""
