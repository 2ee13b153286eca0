"""kvmesh.net: the one shared-secret, framing and limits mechanism of every kvmesh server.

The transfer engine, the replicated log and the store all authenticate connections, frame
messages and bound their work with this package; none keeps its own copy.

* :mod:`.identity` -- roles (replica, node, client), keys derived per (role, id) from the
  cluster secret, credentials (:func:`~.identity.issue`, ``kvmesh keys``).
* :mod:`.security` -- :class:`SecurityConfig` (cluster secret or credential, optional mutual
  TLS, ``from_env``, ``key_for``), :func:`check_bind`, :func:`server_ssl_context` /
  :func:`client_ssl_context`, :func:`check_cert_identity`.
* :mod:`.handshake` -- sans-I/O mutual HMAC challenge-response (:class:`ServerHandshake`,
  :class:`ClientHandshake`) binding the service name, the client's role and both ids (the
  key is the claimed role and id's; servers apply an ``accept`` policy), with blocking
  (:func:`server_handshake`, :func:`client_handshake`) and asyncio (:func:`aserver_handshake`,
  :func:`aclient_handshake`) drivers under one absolute deadline.
* :mod:`.framing` -- 4-byte little-endian length + body; :class:`FrameDecoder` (sans-I/O),
  :func:`read_frame` / :func:`send_frame` (blocking), :func:`aread_frame` (asyncio).
* :mod:`.limits` -- :class:`ConnectionLimiter` (per-source caps, eviction), :func:`source_of`,
  :class:`Deadline`.
* :mod:`.admission` -- the one admission path of every server: a limiter slot now or a
  first-come line per source (``Gate``; a greeted peer that answered goes first); the accept
  paths :mod:`.listener` (asyncio servers) and :mod:`.acceptor` (threaded servers: one
  thread admits and handshakes, threads only for authenticated connections) use it.
* :mod:`.addr` -- :func:`split_host_port` / :func:`join_host_port` (``[v6]:port``), the one
  parser and formatter of ``host:port`` addresses; :func:`family_of` (the socket family to
  listen with); :func:`~.addr.parse_peers` (``ID=HOST:PORT,...`` peer lists).
* :mod:`.deadlines` -- :class:`DeadlineWatch` (idle and frame deadlines of a listener's
  asyncio connections by one sweeper task) and :func:`read_frames`.
* :mod:`.errors` -- :class:`NetError` and its subclasses; :data:`TRANSPORT_ERRORS`, what a
  failing asyncio connection raises on either event loop.
* :mod:`.eventloop` -- the event loop a server process runs (uvloop or the standard
  library's, ``KVMESH_EVENT_LOOP``).
* :mod:`.stallwatch` -- with ``KVMESH_STALL_TRACE_MS``, each hold of a server's loop logged
  with the stacks that held it and the cyclic GC's share.

Details of the API worth knowing:

* Both handshake sides may send a small opaque ``info`` blob (<= 1 KiB) covered by the MACs;
  ``peer_info`` holds the other side's after success. The MACs also cover both nonces and
  both ids (see :mod:`.handshake` for the exact transcript).
* ``run_server(sock, hs, deadline) -> peer_id`` / ``run_client`` (and ``arun_server`` /
  ``arun_client``) drive a core object the caller built, for callers that need ``peer_info``;
  ``server_handshake``/``client_handshake`` are thin wrappers over them.
* ``ClientHandshake(..., expect_server_id=...)`` refuses a server with another id (code
  ``identity``), e.g. a replog node reconnecting to a known peer.
* ``AuthFailed`` derives from ``HandshakeError`` (protocol violations: wrong service or
  version, undecodable handshake frame), whose ``code`` is the refusal code and whose
  ``reply`` is the ``Refused`` frame a server sends before closing.
* Extra errors: ``DeadlineExceeded`` (a ``TimeoutError``; ``HandshakeTimeout`` derives from
  it) and ``PeerClosed`` (a ``ConnectionError``: EOF mid-frame).
* ``read_frame(sock, max_frame, deadline=None)`` returns the body (a bytearray) and never reads
  past its frame; ``send_frame(sock, frame, deadline=None)`` sends an encoded frame.
* ``ConnectionLimiter.try_acquire(on_evict=None)`` returns a :class:`~.limits.Slot` (or
  None); with ``on_evict`` the slot may be evicted for a newer connection while it is
  unauthenticated, and ``authenticated(slot)`` returns False for an evicted slot.
* ``check_bind`` also accepts mutual TLS (``tls_cert`` + ``tls_ca``) as authentication.
* An empty token is rejected (it would authenticate everyone); ``KVMESH_TOKEN`` and
  ``KVMESH_TOKEN_FILE`` together are an error. ``repr(SecurityConfig)`` hides the token.
"""

from __future__ import annotations

from .addr import family_of, join_host_port, split_host_port
from .deadlines import TURN_REQUESTS, DeadlineWatch, Watched, read_frames
from .errors import (
    TRANSPORT_ERRORS,
    AuthFailed,
    DeadlineExceeded,
    FrameTooLarge,
    HandshakeError,
    HandshakeTimeout,
    InsecureBind,
    NetError,
    PeerClosed,
    clip,
)
from .framing import FrameDecoder, aread_frame, encode_frame, read_frame, send_frame
from .handshake import (
    DEFAULT_DEADLINE_S,
    PREAUTH_MAX_FRAME,
    ClientHandshake,
    ServerHandshake,
    aclient_handshake,
    arun_client,
    arun_server,
    aserver_handshake,
    client_handshake,
    run_client,
    run_server,
    server_handshake,
)
from .identity import CLIENT, NODE, REPLICA, ROLES, Credential, speaks_for_node
from .limits import ConnectionLimiter, Deadline, Slot, source_of
from .security import (
    SecurityConfig,
    check_bind,
    check_cert_identity,
    client_ssl_context,
    is_loopback,
    server_ssl_context,
)

__all__ = [
    "CLIENT",
    "NODE",
    "REPLICA",
    "ROLES",
    "Credential",
    "check_cert_identity",
    "speaks_for_node",
    "DeadlineWatch",
    "Watched",
    "read_frames",
    "TURN_REQUESTS",
    "DEFAULT_DEADLINE_S",
    "PREAUTH_MAX_FRAME",
    "AuthFailed",
    "ClientHandshake",
    "ConnectionLimiter",
    "Deadline",
    "DeadlineExceeded",
    "FrameDecoder",
    "FrameTooLarge",
    "HandshakeError",
    "HandshakeTimeout",
    "InsecureBind",
    "NetError",
    "PeerClosed",
    "TRANSPORT_ERRORS",
    "SecurityConfig",
    "ServerHandshake",
    "Slot",
    "aclient_handshake",
    "aread_frame",
    "arun_client",
    "arun_server",
    "aserver_handshake",
    "check_bind",
    "client_handshake",
    "client_ssl_context",
    "clip",
    "encode_frame",
    "is_loopback",
    "read_frame",
    "run_client",
    "run_server",
    "send_frame",
    "source_of",
    "family_of",
    "join_host_port",
    "split_host_port",
    "server_handshake",
    "server_ssl_context",
    "split_host_port",
]
