"""Who a peer is: roles, per-(role, id) keys derived from the cluster secret, credentials.

Three roles (:data:`ROLES`):

* ``replica`` N -- a member of a replicated group (a replog replica, a store master);
* ``node`` N -- a storage node (contributes segments to the store under node id N);
* ``client`` -- anything else (a ``StoreClient``, a replog client, an SGLang process, every
  transfer engine). Clients are not told apart by key: one client key serves them all.

The cluster secret (``KVMESH_TOKEN``) is held by replicas and operators only. Every key is
derived from it, with the role and id bound in::

    key(role, id) = HMAC-SHA256(secret, "kvmesh-id/1" | role | id)      (id = "" for client)

(each part after the label prefixed with its 4-byte little-endian length). A process that
is not a replica gets a *credential* instead of the secret (``kvmesh keys ...`` prints one):
its own role, id and key, and the client key (a storage node's engine must verify clients,
and a node speaks to other engines as a client). HMAC is one-way, so no credential yields
the secret or another (role, id)'s key: a client cannot become a node or a replica, node 2
cannot become node 3.

A credential is the text ``kvmesh-cred1.`` + base64url(msgpack :class:`Credential`); treat
it as a secret (it is never logged; ``repr`` hides the keys).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Annotated, Literal

import msgspec

REPLICA, NODE, CLIENT = "replica", "node", "client"
ROLES = (REPLICA, NODE, CLIENT)
Role = Literal["replica", "node", "client"]
PREFIX = "kvmesh-cred1."
MAX_ID_BYTES = 256
NODE_SEP = "/"

_Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_BYTES)]


class Credential(msgspec.Struct, frozen=True, array_like=True):
    """A derived credential: ``key`` = key(role, id), ``client_key`` = key(client, "")."""

    role: Role
    id: _Id
    key: _Key
    client_key: _Key

    def __post_init__(self) -> None:
        if self.role == CLIENT and (self.id or self.key != self.client_key):
            raise ValueError("a client credential has no id and its key is the client key")
        if self.role != CLIENT and not self.id:
            raise ValueError(f"a {self.role} credential needs an id")

    def __repr__(self) -> str:
        return f"Credential(role={self.role!r}, id={self.id!r}, keys=<hidden>)"

    __str__ = __repr__


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Credential)


def bound_id(role: str, ident: str) -> str:
    """The id a key is bound to: ``ident`` for replicas and nodes, ``""`` for clients."""
    return "" if role == CLIENT else ident


def derive_key(secret: str, role: str, ident: str) -> bytes:
    """key(role, id) of the module docstring."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    h = hmac.new(secret.encode(), b"kvmesh-id/1", hashlib.sha256)
    for part in (role, bound_id(role, ident)):
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


def speaks_for_node(authenticated: str | None, node_id: str) -> bool:
    """Whether a connection authenticated as storage node ``authenticated`` may act for
    storage node ``node_id``: its own id, or a sub-node ``<authenticated>/<name>`` that its
    process hosts (a Mooncake-compatible store mounts a segment per store, each its own
    node). No issued node id contains ``/`` (:func:`issue` refuses it), so a sub-node id
    never names another credential's node."""
    if not authenticated:
        return False
    return node_id == authenticated or node_id.startswith(authenticated + NODE_SEP)


def issue(secret: str, role: str, ident: str = "") -> str:
    """The credential text for ``role`` (and ``ident`` unless a client)."""
    if role != CLIENT and not ident:
        raise ValueError(f"a {role} credential needs an id")
    if role == NODE and NODE_SEP in ident:
        raise ValueError(f"node ids contain no {NODE_SEP!r} (it separates a node's sub-nodes)")
    if role == CLIENT and ident:
        raise ValueError("client credentials carry no id (every client shares the client key)")
    if len(ident.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise ValueError(f"ids are at most {MAX_ID_BYTES} bytes")
    cred = Credential(role, ident, derive_key(secret, role, ident), derive_key(secret, CLIENT, ""))  # type: ignore[arg-type]
    return PREFIX + base64.urlsafe_b64encode(_enc.encode(cred)).decode().rstrip("=")


def parse(text: str) -> Credential:
    """The :class:`Credential` in ``text`` (``ValueError`` if it is not one)."""
    text = text.strip()
    if not text.startswith(PREFIX):
        raise ValueError(f"not a kvmesh credential (expected {PREFIX}...; see `kvmesh keys`)")
    raw = text[len(PREFIX) :]
    try:
        return _dec.decode(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (binascii.Error, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"malformed kvmesh credential: {str(exc)[:100]}") from None
