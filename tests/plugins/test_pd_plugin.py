"""The kvmesh PD plugin inside SGLang: entry point, loader, hook, switches, API conventions.

Real SGLang 0.5.23 on CPU (scripts/setup.sh installs it); skipped when it is not importable.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from .sglang_env import sglang_missing

_why = sglang_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

if _why is None:
    from kvmesh.transfer import MemoryKind, get_engine
    from kvmesh_sglang import pd as kpd
    from kvmesh_sglang import plugin as kplugin

    from .pd_harness import load_plugin_via_sglang, original_engine_class

TARGET = kplugin.TARGET if _why is None else ""


@pytest.fixture(scope="module")
def mte(tmp_path_factory):
    return load_plugin_via_sglang(tmp_path_factory.mktemp("eps"))


def test_entry_point_loaded_by_sglang_loader(mte):
    from importlib.metadata import entry_points

    from sglang.srt.plugins.hook_registry import HookRegistry

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvmesh_pd"]
    assert [ep.value for ep in eps] == ["kvmesh_sglang.plugin:load"]
    assert TARGET in HookRegistry._patched
    assert mte.MooncakeTransferEngine is kpd.KvmeshTransferEngine
    assert original_engine_class() is not kpd.KvmeshTransferEngine
    # SGLang's own constructor of the shared engine now builds the kvmesh class.
    eng = mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    assert isinstance(eng, kpd.KvmeshTransferEngine)
    assert mte.get_mooncake_transfer_engine() is eng
    from sglang.srt.distributed.parallel_state import get_mooncake_transfer_engine

    assert get_mooncake_transfer_engine() is eng  # what MooncakeKVManager.init_engine reads
    # One engine per process, shared with the HiCache backend.
    assert eng.get_engine() is get_engine()
    sid = eng.get_session_id()
    assert sid == "kvmesh://" + get_engine().address and sid.isascii()


def test_switch_off_and_broken_import_leave_sglang_alone(mte, monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = len(HookRegistry._hooks[TARGET])
    monkeypatch.setenv("KVMESH_SGLANG_PD", "0")
    kplugin.load()
    assert len(HookRegistry._hooks[TARGET]) == before
    monkeypatch.setenv("KVMESH_SGLANG_PD", "1")
    monkeypatch.setitem(sys.modules, "kvmesh_sglang.pd", None)  # import fails
    with caplog.at_level(logging.ERROR, logger="kvmesh.sglang"):
        kplugin.load()  # must not raise
    assert len(HookRegistry._hooks[TARGET]) == before
    assert "could not be registered" in caplog.text


def test_engine_start_failure_is_a_clear_error(mte, monkeypatch):
    def boom(hostname):
        raise OSError("address not available")

    monkeypatch.setattr(kpd, "_shared_engine", boom)
    with pytest.raises(RuntimeError, match="KVMESH_SGLANG_PD=0"):
        kpd.KvmeshTransferEngine("10.255.255.1", 0, None)
    monkeypatch.setenv("KVMESH_SGLANG_PD_TIMEOUT", "soon")
    with pytest.raises(RuntimeError, match="KVMESH_SGLANG_PD_TIMEOUT"):
        kpd.KvmeshTransferEngine("127.0.0.1", 0, None)


def test_register_conventions(mte):
    eng = mte.init_mooncake_transfer_engine(hostname="127.0.0.1")
    a = np.zeros(1 << 16, np.uint8)
    b = np.zeros(1 << 12, np.uint8)
    p, q = a.ctypes.data, b.ctypes.data
    eng.register(p, a.nbytes)
    eng.register(p, a.nbytes)  # the same region again is a no-op, not a second segment
    assert len(eng._regions[p]) == 1
    eng.deregister(p)
    with pytest.raises(RuntimeError):
        eng.deregister(p)  # nothing there any more
    with pytest.raises(RuntimeError):
        eng.register(p, 0)
    assert eng.batch_register([p, q], [a.nbytes]) < 0
    assert eng.batch_register([p, q], [a.nbytes, 0]) < 0  # all or nothing
    assert p not in eng._regions
    assert eng.batch_register([p, q], [a.nbytes, b.nbytes]) == 0
    names = {s.name for s in get_engine().segments()}
    assert f"sglang-pd-{p:x}-{a.nbytes:x}" in names  # published: peers can reach it
    assert eng.batch_deregister([p, q]) == 0
    assert eng.batch_deregister([p]) < 0
    assert f"sglang-pd-{p:x}-{a.nbytes:x}" not in {s.name for s in get_engine().segments()}


def test_memory_kind_detected_per_pointer(mte, monkeypatch):
    """batch_register asks the engine's pointer probe (``kvmesh.transfer.memory_kind``) per
    region (device KV, host aux: mixed lists)."""
    from kvmesh.transfer import cuda, memory_kind

    eng = mte.init_mooncake_transfer_engine(hostname="127.0.0.1")
    kv = np.zeros(8192, np.uint8)
    aux = np.zeros(512, np.uint8)
    asked: list[int] = []

    def probe(ptr):
        asked.append(ptr)
        return 0 if ptr == kv.ctypes.data else None  # "kv is on device 0"

    monkeypatch.setattr(cuda, "_probe", probe)
    assert memory_kind(kv.ctypes.data) == (MemoryKind.VRAM, 0)
    assert memory_kind(aux.ctypes.data) == (MemoryKind.DRAM, -1)
    # Register through the API with the probe in place, but keep the VRAM region away from the
    # real transports (no CUDA here): only check the kinds that reach register_raw.
    seen: list[tuple[int, MemoryKind, int]] = []
    real = get_engine().register_raw

    def spy(ptr, size, kind, device, **kw):
        seen.append((ptr, kind, device))
        return real(ptr, size, MemoryKind.DRAM, -1, **kw)

    monkeypatch.setattr(get_engine(), "register_raw", spy)
    assert eng.batch_register([kv.ctypes.data, aux.ctypes.data], [kv.nbytes, aux.nbytes]) == 0
    assert seen == [(kv.ctypes.data, MemoryKind.VRAM, 0), (aux.ctypes.data, MemoryKind.DRAM, -1)]
    assert eng.batch_deregister([kv.ctypes.data, aux.ctypes.data]) == 0


def test_no_cuda_means_host_memory():
    from kvmesh.transfer import cuda, memory_kind

    if cuda.available():
        pytest.skip("CUDA present: covered by test_pd_gpu.py")
    arr = np.zeros(64, np.uint8)
    assert memory_kind(arr.ctypes.data) == (MemoryKind.DRAM, -1)


def test_bad_sessions_fail_fast(mte):
    eng = mte.init_mooncake_transfer_engine(hostname="127.0.0.1")
    buf = np.zeros(4096, np.uint8)
    eng.register(buf.ctypes.data, buf.nbytes)
    try:
        p = buf.ctypes.data
        # A Mooncake-format session (a peer without the plugin) is refused with a clear code.
        assert eng.transfer_sync("127.0.0.1:1234", p, 0x1000, 16) == kpd.E_BAD_ARGUMENT
        bad = kpd.E_BAD_ARGUMENT
        assert eng.batch_transfer_sync("kvmesh://nonsense", [p], [0x1000], [16]) == bad
        assert eng.batch_transfer_sync("kvmesh://127.0.0.1:1", [p], [0x1000], [16]) < 0
        assert eng.send_probe("kvmesh://127.0.0.1:1") < 0
        assert eng.send_probe(eng.get_session_id()) == 0
        assert eng.batch_transfer_sync(eng.get_session_id(), [p, p], [p], [16]) == bad
        assert eng.batch_transfer_sync(eng.get_session_id(), [], [], []) == 0
        assert eng.get_ib_device() is None
    finally:
        eng.deregister(buf.ctypes.data)


def test_ib_device_as_mooncake_reports_it(mte, monkeypatch):
    """``mooncake_tcp`` (SGLang sets MC_FORCE_TCP=1) reports no IB device, as Mooncake does."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    assert kpd.KvmeshTransferEngine("127.0.0.1", 1, "mlx5_0").get_ib_device() == "mlx5_0"
    per_gpu = '{"0": "mlx5_0", "1": "mlx5_1"}'  # SGLang's per-GPU JSON form, its own parser
    assert kpd.KvmeshTransferEngine("127.0.0.1", 1, per_gpu).get_ib_device() == "mlx5_1"
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert kpd.KvmeshTransferEngine("127.0.0.1", 1, "mlx5_0").get_ib_device() == ""
