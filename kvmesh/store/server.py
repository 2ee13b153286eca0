"""The store master's connections: handshake, frames, inline answers, request tasks,
replies with backpressure, errors mapped to replies.

The handshake runs before anything is allocated for a connection (connection limiter with a
separate cap on unauthenticated connections, pre-auth frames of a few KiB), then frames are
capped at ``max_frame``, requests in flight per connection at ``max_inflight``, and an idle
connection is closed after ``idle_timeout_s``. Replies are written one at a time
(:class:`Replies`); a peer that leaves more than 1 MiB of them unread for
``request_timeout_s`` is disconnected, as is one whose begun request frame does not end
within it. A connection that sends junk is closed; the server keeps serving. Requests go to
the handler table (:mod:`~kvmesh.store.handlers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Generator
from typing import Any

import msgspec

from ..net import framing as _framing
from ..net.deadlines import TURN_REQUESTS, Watched, read_frames
from ..net.errors import TRANSPORT_ERRORS
from ..net.handshake import ServerHandshake, arun_server
from ..net.limits import Slot
from ..replog import (
    CommandError,
    NodeStopped,
    NotLeaderError,
    ProposalTimeout,
    ProposalTooLarge,
    ReadTimeout,
    ReplogError,
    ResultEvicted,
    SessionExpiredError,
)
from . import errors as E
from . import protocol as P
from .admission import Busy
from .handlers import LEASE_READS

__all__ = ["Replies", "Server"]

log = logging.getLogger(__name__)


# Reads this small are answered inline (latency); bigger ones run as tasks, so that requests
# buffered on one connection never hold the event loop for long.
_INLINE_KEYS = 512


class Server:
    """The connection side (a part of :class:`~kvmesh.store.service.MasterService`)."""

    def _new_handshake(self) -> ServerHandshake:
        return ServerHandshake(self.sec, P.SERVICE, self.server_id)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: Slot
    ) -> None:
        # ``token``: the listener's admission (per-source caps, eviction, minimum age)
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        inflight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(self.cfg.max_inflight)
        watched: Watched | None = None
        try:
            try:
                # A greeted connection's handshake began in the listener (its Challenge
                # is sent): go on with it.
                hs = token.handshake or self._new_handshake()
                who = await arun_server(reader, writer, hs, self.cfg.handshake_timeout_s)
                # Sessions and storage nodes bind to the authenticated role and id: a
                # client's connection is never the same peer as node X's (_admit).
                peer = f"{hs.peer_role}:{who}"
            except TRANSPORT_ERRORS as e:
                self._throttle.log(
                    logging.INFO,
                    "auth",
                    "store master: handshake from %s refused: %s",
                    writer.get_extra_info("peername"),
                    str(e)[:200],
                )
                return
            if not self._limiter.authenticated(token):
                return  # evicted to make room while it was still unauthenticated
            out = Replies(writer, self.cfg.request_timeout_s)
            # Idle and begun-frame deadlines: the listener's one sweeper (replog's
            # DeadlineWatch), not a timeout context per request (two cost ~15 us of a
            # single-key lookup under uvloop).
            watched = self._watch.watch(writer, _framing.FrameDecoder(self.cfg.max_frame))
            turn = 0  # requests taken since this connection last let the loop run others
            while True:
                # Read no further request while the peer leaves our replies unread.
                await out.wait_writable()
                try:
                    bodies = await read_frames(reader, watched)
                except TimeoutError:  # idle, or a begun frame that did not end in time
                    return
                for i, body in enumerate(bodies):
                    if i:
                        await out.wait_writable()
                    turn += 1
                    if turn >= TURN_REQUESTS:
                        # One read holds up to 256 KiB of frames (thousands of single-key
                        # gets answered inline without a suspension): let the other
                        # connections in every few requests, or one pipelining peer holds
                        # the loop for all of them (~0.5 s per read here).
                        turn = 0
                        await asyncio.sleep(0)
                    try:
                        req = P.decode_request(body)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        # Answered, not dropped: the frame ended where its length said, so
                        # the connection is still in step, and a dropped connection reads
                        # to the sender as an outage to retry until its deadline.
                        log.info("store master: undecodable request: %s", str(e)[:200])
                        await out.send(_framing.encode_frame(P.encode(P.undecodable(body, e))))
                        continue
                    if type(req) is P.HeartbeatReq and out.ready():
                        # Heartbeats never wait for a task, a slot or the requests queued
                        # before them: liveness must not depend on the request load.
                        self._reply_inline(req, out, peer)
                        continue
                    if type(req) in LEASE_READS and self._reply_now(req, out, peer):
                        continue  # answered inline from the leader lease
                    if slots.locked():
                        # Our own in-flight limit stops the reading, not the peer: a frame it
                        # began meanwhile must not run out of time (a quorum loss holds
                        # every slot for long).
                        watched.pause()
                        try:
                            await slots.acquire()
                        finally:
                            watched.resume()
                    else:
                        await slots.acquire()
                    coro = self._handle(req, out, peer)
                    if type(req) in LEASE_READS:  # a big read: a task, never this read loop
                        t = asyncio.get_running_loop().create_task(coro)
                    else:
                        t = _start_eagerly(coro)
                        if t is None:  # answered without suspending (a memory log's commit)
                            slots.release()
                            continue
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                    t.add_done_callback(lambda _t: slots.release())
        except TRANSPORT_ERRORS as e:  # incl. uvloop's RuntimeError on a reset connection
            log.debug("store master: connection ended: %s: %s", type(e).__name__, str(e)[:200])
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, never the server
            log.exception("store master: connection failed")
        finally:
            if watched is not None:
                self._watch.unwatch(watched)
            for t in inflight:
                t.cancel()
            self._limiter.release(token)
            self._conns.discard(task)
            writer.close()

    def _reply_now(self, req: Any, out: Replies, peer: str) -> bool:
        """Answer a read request inline, without a task, when the leader's lease makes its
        read index immediate (the common case): the same checks and replies as
        :meth:`_dispatch` minus the scheduling. False: handle it as any request (a big
        batch, no lease now, or a reply being sent or left unread: backpressure of
        :class:`Replies` applies)."""
        node = self.node
        if node is None or P.request_key_count(req) > _INLINE_KEYS or not out.ready():
            return False
        try:
            if node.lease_read_index() is None:
                return False
        except ReplogError:  # stopped: the task path answers with the right error
            return False
        self._reply_inline(req, out, peer)
        return True

    def _reply_inline(self, req: Any, out: Replies, peer: str) -> None:
        """Answer a request that needs no suspension (a lease read, a heartbeat) at once."""
        started = time.perf_counter()
        try:
            node = self._admit(req, peer)
            if type(req) is P.HeartbeatReq:
                resp: Any = self._heartbeat(node, req)
            else:
                resp = self._read_now(req)
        except Exception as e:  # noqa: BLE001 - mapped to a reply as in _handle
            resp = self._error_reply(req, e)
        self._observe(req, resp, started)
        out.send_now(_framing.encode_frame(P.encode(resp)))

    async def _handle(self, req: Any, out: Replies, peer: str = "") -> None:
        # A GetReplicas reply is the one large reply (up to max_reply_bytes): one at a time
        # per connection, from the lookup until it is handed to the socket, so a peer that
        # pipelines them makes us hold one, not max_inflight of them.
        # Likewise a connection's remove-by-prefix rounds run one at a time: it holds one
        # place in the master's scan queue (MAX_SCANS), however many it pipelines.
        t = type(req)
        big = (
            out.big
            if t is P.GetReplicasReq or t is P.GetPartsReq
            else out.scan
            if t is P.RemovePrefixReq
            else contextlib.nullcontext()
        )
        async with big:
            await self._handle_one(req, out, peer)

    async def _handle_one(self, req: Any, out: Replies, peer: str) -> None:
        started = time.perf_counter()
        try:
            resp = await self._dispatch(req, peer)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            resp = self._error_reply(req, e)
        self._observe(req, resp, started)
        await out.send(_framing.encode_frame(P.encode(resp)))

    def _error_reply(self, req: Any, exc: Exception) -> Any:
        """The reply for a request whose handling raised ``exc``."""
        try:
            raise exc
        except NotLeaderError as e:
            return P.Redirect(req.rid, e.leader_id or 0, e.leader_addr or "")
        except Busy as e:
            return P.ErrorResp(req.rid, e.code, str(e), retry=True)
        except (TimeoutError, ProposalTimeout, ReadTimeout) as e:
            return P.ErrorResp(
                req.rid, E.StoreTimeout.code, f"timeout (outcome unknown): {e}", retry=True
            )
        except SessionExpiredError as e:
            # A forgotten session (not applied: a new session may send it again) has its own
            # code; an evicted result (maybe applied once) is an outcome-unknown failure.
            evicted = isinstance(e, ResultEvicted)
            code = E.StoreUnavailable.code if evicted else E.SessionExpired.code
            return P.ErrorResp(req.rid, code, f"session: {e}", retry=False)
        except CommandError as e:
            return P.ErrorResp(req.rid, E.InternalError.code, f"command failed: {e}", retry=False)
        except NodeStopped as e:
            return P.ErrorResp(req.rid, E.StoreUnavailable.code, f"stopped: {e}", retry=True)
        except ProposalTooLarge as e:  # deterministic: the same request can never fit
            return P.ErrorResp(
                req.rid,
                E.InvalidParams.code,
                f"request too large for one log entry, split the batch: {e}"[:500],
                retry=False,
            )
        except ReplogError as e:  # ProposalDropped/ProposalLost: not applied, retry
            return P.ErrorResp(
                req.rid, E.StoreUnavailable.code, f"{type(e).__name__}: {e}", retry=True
            )
        except E.StoreError as e:
            return P.ErrorResp(req.rid, e.code, str(e)[:500], retry=False)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            log.warning("store master: request %s failed: %r", type(req).__name__, e)
            return P.ErrorResp(req.rid, E.InternalError.code, f"{type(e).__name__}: {e}"[:500])

    def _observe(self, req: Any, resp: Any, started: float) -> None:
        if self.metrics is not None:
            rt = type(resp)
            outcome = "redirect" if rt is P.Redirect else "error" if rt is P.ErrorResp else "ok"
            self.metrics.observe(type(req).__name__, outcome, P.request_key_count(req), started)


def _start_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task | None:
    """Run a request's handler ``coro`` in the read loop's task up to its first suspension:
    None when it ended without one (a mutation on a memory log commits, applies and is
    answered inside its proposal call), else a task that goes on from that suspension. The
    request then skips the task hop (a task, a turn of the event loop and the read loop's
    return to its socket before the handler starts: ~20-30 us of a put's commit, measured
    with stage timers) while one that waits (an fsync, a quorum) is a task as before."""
    try:
        first = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_finish(_Suspended(coro, first)))


async def _finish(rest: _Suspended) -> None:
    await rest


class _Suspended:
    """A coroutine suspended at ``yielded`` (what its first ``send`` returned), awaitable:
    awaiting it goes on with the coroutine as ``await`` would have -- the task waits on what
    it yields, sends the results in and throws exceptions and cancellation in. (An
    awaitable, not a generator handed to ``create_task``: asyncio takes only coroutines
    from Python 3.12 on.)"""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, None], yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded

    def __await__(self) -> Generator[Any, Any, None]:
        coro, yielded = self.coro, self.yielded
        while True:
            try:
                got = yield yielded
            except BaseException as e:  # noqa: BLE001 - cancellation: the handler's to handle
                try:
                    yielded = coro.throw(e)
                except StopIteration:
                    return
            else:
                try:
                    yielded = coro.send(got)
                except StopIteration:
                    return


_WRITE_HIGH = 1 << 20  # unread reply bytes above which a connection stops and waits


class Replies:
    """The reply side of one connection: writes one frame at a time and, above
    :data:`_WRITE_HIGH` unread bytes, waits for the peer to read (at most ``timeout`` s,
    then the connection is aborted), so a peer that stops reading holds at most that much
    of our memory plus the reply being written."""

    __slots__ = ("big", "lock", "scan", "timeout", "writer")

    def __init__(self, writer: asyncio.StreamWriter, timeout: float) -> None:
        self.writer = writer
        self.timeout = timeout
        self.lock = asyncio.Lock()
        self.big = asyncio.Lock()
        self.scan = asyncio.Lock()

    async def _drain(self) -> None:
        w = self.writer
        if w.transport.get_write_buffer_size() <= _WRITE_HIGH:
            return
        try:
            await asyncio.wait_for(w.drain(), self.timeout)
        except TimeoutError:
            log.info(
                "store master: a peer left %d reply bytes unread; closing it",
                w.transport.get_write_buffer_size(),
            )
            w.transport.abort()
        except TRANSPORT_ERRORS:
            w.transport.abort()

    async def wait_writable(self) -> None:
        if self.ready():  # the usual case: no lock, no coroutine, the same outcome
            return
        async with self.lock:
            await self._drain()

    async def send(self, frame: bytes) -> None:
        async with self.lock:
            if self.writer.is_closing():
                return
            try:
                self.writer.write(frame)
            except TRANSPORT_ERRORS:
                return
            await self._drain()

    def ready(self) -> bool:
        """Whether a reply may be written at once (:meth:`send_now`): no send in progress
        and the peer keeps up with reading."""
        return (
            not self.lock.locked() and self.writer.transport.get_write_buffer_size() <= _WRITE_HIGH
        )

    def send_now(self, frame: bytes) -> None:
        """Write without waiting, after :meth:`ready`; a backlog this leaves is drained by
        the read loop's next :meth:`wait_writable` before it reads another request."""
        if self.writer.is_closing():
            return
        try:
            self.writer.write(frame)
        except TRANSPORT_ERRORS:
            pass
