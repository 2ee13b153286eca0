"""Fixtures for the transfer tests: engines and peer processes that are always cleaned up."""

from __future__ import annotations

import pytest

from kvmesh.transfer import EngineConfig, TransferEngine

from .util import Peer


@pytest.fixture
def make_engine():
    engines: list[TransferEngine] = []

    def make(**kw) -> TransferEngine:
        node_id = kw.pop("node_id", None)
        eng = TransferEngine(node_id=node_id, config=EngineConfig(**kw))
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


@pytest.fixture
def make_peer():
    peers: list[Peer] = []

    def make(*args: str, **kw) -> Peer:
        p = Peer(*args, **kw)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()
