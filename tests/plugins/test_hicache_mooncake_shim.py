"""The opt-in ``mooncake.store`` stand-in never shadows a real Mooncake silently (no SGLang
needed). SGLang's MooncakeStore running on it: test_hicache_backend.py."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvmesh.store import compat
from kvmesh_sglang import mooncake_compat as mc


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(mc.ENV, raising=False)
    yield
    mc.uninstall()


def test_opt_in_only():
    mc.load()
    assert not mc.installed() and "mooncake" not in sys.modules
    for off in ("0", "off", ""):
        with pytest.MonkeyPatch.context() as m:
            m.setenv(mc.ENV, off)
            mc.load()
        assert not mc.installed()


def test_installed_names_kvmesh_classes(monkeypatch):
    monkeypatch.setenv(mc.ENV, "1")
    mc.load()
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    assert MooncakeDistributedStore is compat.MooncakeDistributedStore
    assert ReplicateConfig is compat.ReplicateConfig
    mc.uninstall()
    assert "mooncake" not in sys.modules and "mooncake.store" not in sys.modules


def test_a_real_mooncake_is_not_shadowed_unless_forced(monkeypatch, caplog):
    real = types.ModuleType("mooncake")
    real.__file__ = "/site-packages/mooncake/__init__.py"
    real_store = types.ModuleType("mooncake.store")
    monkeypatch.setitem(sys.modules, "mooncake", real)
    monkeypatch.setitem(sys.modules, "mooncake.store", real_store)
    monkeypatch.setenv(mc.ENV, "1")
    with caplog.at_level(logging.WARNING, logger="kvmesh.sglang.mooncake"):
        mc.load()
    assert sys.modules["mooncake"] is real and not mc.installed()
    assert "real Mooncake is installed" in caplog.text
    caplog.clear()
    monkeypatch.setenv(mc.ENV, "force")
    with caplog.at_level(logging.WARNING, logger="kvmesh.sglang.mooncake"):
        mc.load()
    assert mc.installed() and "shadowing" in caplog.text
    assert sys.modules["mooncake.store"].MooncakeDistributedStore is compat.MooncakeDistributedStore
    mc.uninstall()  # the real one comes back
    assert sys.modules["mooncake"] is real and sys.modules["mooncake.store"] is real_store
