"""Run a test on each event loop a kvmesh server can run (``kvmesh.net.eventloop``).

``loop_name`` (a fixture: import it into the test module) is ``"uvloop"`` or ``"asyncio"``;
it sets ``KVMESH_EVENT_LOOP`` for the test, so :func:`kvmesh.net.eventloop.run` in this
process and every server process the test starts run that loop.
"""

from __future__ import annotations

import importlib.util

import pytest

from kvmesh.net import eventloop

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


@pytest.fixture(
    params=[
        pytest.param(
            "uvloop", marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop not installed")
        ),
        "asyncio",
    ]
)
def loop_name(request, monkeypatch):
    monkeypatch.setenv(eventloop.ENV, request.param)
    assert eventloop.loop_name() == request.param
    return request.param
