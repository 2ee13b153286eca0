"""Which asyncio event loop a kvmesh server process runs: the one switch.

uvloop when it is installed, else the standard library's loop; ``KVMESH_EVENT_LOOP=asyncio``
(or ``uvloop``) forces one, so tests and benchmarks can run every server on both. The two
raise different exceptions from the same transport failure (a write to a connection the peer
reset is ``ConnectionResetError`` on one and ``RuntimeError`` on the other: see
:data:`kvmesh.net.errors.TRANSPORT_ERRORS`), so code that talks to sockets is tested on both.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from . import stallwatch

__all__ = ["ENV", "loop_name", "new_event_loop", "run"]

ENV = "KVMESH_EVENT_LOOP"
_T = TypeVar("_T")


def _have_uvloop() -> bool:
    try:
        import uvloop  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: what :func:`new_event_loop` makes in this process."""
    want = os.environ.get(ENV, "").strip().lower()
    if want not in ("", "uvloop", "asyncio"):
        raise ValueError(f"{ENV}={want!r}: expected 'uvloop' or 'asyncio'")
    if want == "asyncio" or (want == "" and not _have_uvloop()):
        return "asyncio"
    if not _have_uvloop():
        raise ValueError(f"{ENV}=uvloop but uvloop is not installed")
    return "uvloop"


def new_event_loop() -> asyncio.AbstractEventLoop:
    if loop_name() == "uvloop":
        import uvloop  # type: ignore[import-not-found]

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


async def _watched(coro: Coroutine[Any, Any, _T], threshold_s: float) -> _T:
    loop = asyncio.get_running_loop()
    watch = stallwatch.StallWatch(loop, threading.get_ident(), threshold_s).start()
    try:
        return await coro
    finally:
        watch.stop()


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run`` on the loop :func:`loop_name` names; with ``KVMESH_STALL_TRACE_MS`` set
    (:mod:`.stallwatch`) stalls of the loop are logged with the stacks that held it."""
    try:
        threshold_s = stallwatch.threshold_from_env()
    except ValueError:
        coro.close()
        raise
    if threshold_s is not None:
        coro = _watched(coro, threshold_s)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
