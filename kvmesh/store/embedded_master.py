"""An in-process, single-replica store master (memory mode) for zero-configuration use.

``StoreClient()`` with no master address calls :func:`acquire_embedded`: the first caller in a
process starts a :class:`~kvmesh.store.service.MasterService` on its own event loop in a
daemon thread, bound to ``127.0.0.1`` on a free port and protected by a random token; later
callers share it, and it stops when the last one releases it. Its metadata lives in memory
only (the process is the whole cluster). Other processes on the host can join it with
``StoreClient(handle.address, token=handle.security.token)``.

:func:`kvmesh.store.embedded` is the one-liner: a :class:`~kvmesh.store.client.StoreClient`
on this process's embedded master that contributes a local segment. (The function is not here:
this module is below the client, which starts the master, and a submodule named ``embedded``
would shadow the package's function once imported.)
"""

from __future__ import annotations

import asyncio
import secrets
import threading

from ..net import eventloop
from ..net.security import SecurityConfig
from .service import MasterService, ServiceConfig

__all__ = ["EmbeddedMaster", "acquire_embedded", "release_embedded"]


def _new_loop() -> asyncio.AbstractEventLoop:
    return eventloop.new_event_loop()


class EmbeddedMaster:
    """A :class:`MasterService` running on a private event loop in a daemon thread."""

    def __init__(
        self, config: ServiceConfig | None = None, security: SecurityConfig | None = None
    ) -> None:
        self.config = config or ServiceConfig(
            listen="127.0.0.1:0", durability="memory", tick_s=0.05
        )
        self.security = security or SecurityConfig(token=secrets.token_hex(16))
        self.address = ""
        self.service: MasterService | None = None
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvmesh-store-master", daemon=True
        )
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    async def _start(self) -> None:
        self.service = MasterService(self.config, self.security)
        await self.service.start()
        self.address = self.service.address
        # A single replica elects itself within an election timeout; wait so the first
        # request does not have to retry.
        node = self.service.node
        assert node is not None
        for _ in range(400):
            if node.is_leader:
                break
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        if self.service is None:
            return
        svc, self.service = self.service, None
        try:
            asyncio.run_coroutine_threadsafe(svc.stop(), self._loop).result(15)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


_lock = threading.Lock()
_shared: EmbeddedMaster | None = None
_users = 0


def acquire_embedded() -> EmbeddedMaster:
    """This process's embedded master (started on first use)."""
    global _shared, _users
    with _lock:
        if _shared is None:
            _shared = EmbeddedMaster()
        _users += 1
        return _shared


def release_embedded(handle: EmbeddedMaster) -> None:
    global _shared, _users
    with _lock:
        if handle is not _shared:
            return
        _users -= 1
        if _users > 0:
            return
        _shared = None
    handle.stop()
