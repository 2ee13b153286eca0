"""SGLang plugins of kvmesh (docs/sglang.md).

* :mod:`kvmesh_sglang.plugin`: the ``sglang.srt.plugins`` entry point; it swaps SGLang's
  Mooncake transfer engine for :class:`kvmesh_sglang.pd.KvmeshTransferEngine` (PD
  disaggregation on kvmesh), unless ``KVMESH_SGLANG_PD=0``.
"""
