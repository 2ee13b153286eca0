"""The lifecycle of one NIXL transfer handle: post, poll or wait, release (always).

A :class:`NixlXfer` is made by :meth:`NixlAgent.make_xfer
<kvmesh.transfer.nixl.agent.NixlAgent.make_xfer>`. Every path ends in :meth:`NixlXfer.release`
(also on failure and timeout); a handle NIXL cannot release is kept by the agent and released
again when it closes. A peer found dead by a transfer is remembered by the agent, so later
transfers to it fail at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import TransferError, TransferTimeout
from .prepped import Prepped

__all__ = ["NixlXfer", "XferOwner"]

log = logging.getLogger("kvmesh.transfer.nixl")


class XferOwner(Protocol):
    """What a transfer handle needs from the agent that made it (``NixlAgent``)."""

    def check_open(self) -> None:
        """Raise ``EngineClosed`` once the agent is closed."""

    def xfer_post(self, handle: Any) -> str:
        """Post a prepared NIXL transfer: ``"DONE"``, ``"PROC"`` or ``"ERR"``."""
        ...

    def xfer_state(self, handle: Any) -> str:
        """The state of a posted NIXL transfer: ``"DONE"``, ``"PROC"`` or ``"ERR"``."""
        ...

    def failed(self, exc: BaseException, what: str, peer: str) -> TransferError:
        """The kvmesh error for a failed transfer with ``peer`` (remembers a dead peer)."""
        ...

    def leak(self, handle: Any) -> None:
        """Keep a handle NIXL refused to release, to retry when the agent closes."""

    def unuse_prepped(self, prepped: tuple[Prepped, ...]) -> None:
        """Hand back the prepared lists the transfer used (the cache may drop them now)."""


class NixlXfer:
    """One NIXL transfer request: post it, poll or wait, release it (always).

    On the cma path :meth:`post` performs the whole copy inside the call (it releases the GIL):
    call it from a worker thread, never from an event loop. A DONE handle may be posted again
    to repeat the same transfer.
    """

    __slots__ = (
        "_agent",
        "_handle",
        "_prepped",
        "op",
        "peer",
        "nbytes",
        "count",
        "prepared",
        "_state",
    )

    def __init__(
        self,
        agent: XferOwner,
        handle: Any,
        prepped: tuple[Prepped, ...],
        op: str,
        peer: str,
        nbytes: int,
        count: int,
        prepared: bool,
    ) -> None:
        self._agent = agent
        self._handle = handle
        self._prepped = prepped
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.count = count
        self.prepared = prepared  # made from cached prepared lists (else initialize_xfer)
        self._state = "new"  # new | posted | done | failed | released

    @property
    def done(self) -> bool:
        return self._state == "done"

    def _what(self) -> str:
        return (
            f"NIXL {self.op} of {self.nbytes} bytes ({self.count} descriptors) with {self.peer!r}"
        )

    def _fail(self, exc: BaseException) -> TransferError:
        self._state = "failed"
        return self._agent.failed(exc, self._what(), self.peer)

    def post(self) -> bool:
        """Start the transfer; ``True`` when it already completed inside the call."""
        if self._state not in ("new", "done"):
            raise TransferError(f"{self._what()}: cannot post a handle in state {self._state}")
        agent = self._agent
        agent.check_open()
        try:
            status = agent.xfer_post(self._handle)
        except Exception as exc:
            raise self._fail(exc) from None
        if status == "DONE":
            self._state = "done"
            return True
        if status == "PROC":
            self._state = "posted"
            return False
        raise self._fail(TransferError(f"{self._what()}: NIXL reported ERR when posting"))

    def poll(self) -> bool:
        """``True`` once every byte has landed; raises on failure."""
        state = self._state
        if state == "done":
            return True
        self._agent.check_open()
        if state != "posted":
            raise TransferError(f"{self._what()}: cannot poll a handle in state {state}")
        try:
            status = self._agent.xfer_state(self._handle)
        except Exception as exc:
            raise self._fail(exc) from None
        if status == "DONE":
            self._state = "done"
            return True
        if status == "PROC":
            return False
        raise self._fail(TransferError(f"{self._what()}: NIXL reported ERR"))

    def wait(self, timeout: float | None = None, check: Callable[[], Any] | None = None) -> None:
        """Poll until done. ``check()`` (optional) is called between polls and may raise.

        Each poll also drives UCX progress, which TCP transfers need from the initiator: the
        first 2 ms poll every ~20 µs (small transfers finish there), then the pause grows to
        1 ms so a long wait does not take a core from the copy itself.
        """
        if self.poll():
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        pause = 2e-5
        while True:
            if check is not None:
                check()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self._state = "failed"
                raise TransferTimeout(f"{self._what()}: not finished after {timeout:.3f} s")
            time.sleep(pause)
            if now - start > 2e-3:
                pause = min(pause * 2, 1e-3)
            if self.poll():
                return

    def release(self) -> None:
        """Free the NIXL handle (cancelling it if still in flight). Idempotent."""
        if self._state == "released":
            return
        self._state = "released"
        agent = self._agent
        try:
            self._handle.release()
        except Exception as exc:
            # An in-flight handle NIXL could not cancel: keep it to retry at close.
            log.warning("%s: release failed (%s); retrying at agent close", self._what(), exc)
            agent.leak(self._handle)
        finally:
            agent.unuse_prepped(self._prepped)

    def __enter__(self) -> NixlXfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
