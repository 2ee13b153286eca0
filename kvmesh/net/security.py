"""Who may connect: the cluster secret or a derived credential, optional mutual TLS, and the
bind-address rule.

A process holds either the cluster secret (``token``: replicas, operators; it can derive the
key of every role and id, :mod:`.identity`) or one credential (``credential``: a storage
node's or a client's, from ``kvmesh keys``). Both come from configuration or the environment
only and are never logged (the ``repr`` of :class:`SecurityConfig` hides them). Without
either a server authenticates nobody, so :func:`check_bind` refuses to listen anywhere but
loopback unless ``allow_insecure`` is set (or mutual TLS, which authenticates clients by
certificate, is configured).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import ssl
from collections.abc import Mapping

import msgspec

from . import identity as ident
from .errors import InsecureBind

_TRUE = {"1", "true", "yes", "on"}


@functools.lru_cache(maxsize=16)
def _credential(text: str) -> ident.Credential:
    return ident.parse(text)


class SecurityConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Cluster secret or credential, optional mutual-TLS files, the insecure-bind override."""

    token: str | None = None  # the cluster secret (replicas and operators only)
    credential: str | None = None  # a derived credential (kvmesh keys), instead of the secret
    tls_cert: str | None = None  # PEM certificate chain of this process
    tls_key: str | None = None  # its private key
    tls_ca: str | None = None  # CA bundle peers' certificates must chain to (mutual TLS)
    # With mutual TLS, refuse a peer certificate that names no kvmesh identity (SAN URI
    # kvmesh://ROLE/ID); a certificate that names some is always held to them.
    tls_require_ids: bool = False
    allow_insecure: bool = False  # permit binding a non-loopback address without a token

    def __post_init__(self) -> None:
        # msgspec checks field types when it decodes, not when a config is built in code.
        for f in ("token", "tls_cert", "tls_key", "tls_ca"):
            v = getattr(self, f)
            if v is not None and type(v) is not str:
                raise TypeError(f"SecurityConfig.{f} must be a str or None, got {type(v).__name__}")
        if type(self.allow_insecure) is not bool:
            raise TypeError(
                f"SecurityConfig.allow_insecure must be a bool, got {self.allow_insecure!r}"
            )
        if self.token == "":
            raise ValueError("an empty token would authenticate everyone; leave it unset instead")
        if self.token is not None and self.credential is not None:
            raise ValueError("give the cluster secret or a credential, not both")
        if self.credential is not None:
            _credential(self.credential)  # ValueError if malformed
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")

    @property
    def authenticates(self) -> bool:
        """Whether handshakes carry proofs (a secret or a credential is configured)."""
        return self.token is not None or self.credential is not None

    @property
    def identity(self) -> tuple[str, str] | None:
        """The (role, id) a credential names (None for the secret or nothing)."""
        if self.credential is None:
            return None
        cred = _credential(self.credential)
        return cred.role, cred.id

    def key_for(self, role: str, peer_id: str) -> bytes | None:
        """The key that proves (or verifies) ``role`` ``peer_id``; None when this process
        cannot know it (its credential is another's) or nothing is configured."""
        if self.token is not None:
            return ident.derive_key(self.token, role, peer_id)
        if self.credential is None:
            return None
        cred = _credential(self.credential)
        if role == ident.CLIENT:
            return cred.client_key
        if role == cred.role and peer_id == cred.id:
            return cred.key
        return None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SecurityConfig:
        """Read ``KVMESH_TOKEN`` (or ``KVMESH_TOKEN_FILE``: the cluster secret),
        ``KVMESH_CREDENTIAL`` (or ``KVMESH_CREDENTIAL_FILE``: a derived credential),
        ``KVMESH_TLS_CERT``, ``KVMESH_TLS_KEY``, ``KVMESH_TLS_CA``, ``KVMESH_TLS_REQUIRE_IDS``
        and ``KVMESH_ALLOW_INSECURE`` (1/true/yes/on)."""
        env = os.environ if environ is None else environ

        def get(key: str) -> str | None:
            value = env.get(key, "").strip()
            return value or None

        def secret(name: str) -> str | None:
            value, path = get(name), get(name + "_FILE")
            if value is not None and path is not None:
                raise ValueError(f"set {name} or {name}_FILE, not both")
            if path is not None:
                with open(path, encoding="utf-8") as f:
                    value = f.read().strip() or None
                if value is None:
                    raise ValueError(f"{name}_FILE {path!r} is empty")
            return value

        return cls(
            token=secret("KVMESH_TOKEN"),
            credential=secret("KVMESH_CREDENTIAL"),
            tls_cert=get("KVMESH_TLS_CERT"),
            tls_key=get("KVMESH_TLS_KEY"),
            tls_ca=get("KVMESH_TLS_CA"),
            tls_require_ids=(get("KVMESH_TLS_REQUIRE_IDS") or "").lower() in _TRUE,
            allow_insecure=(get("KVMESH_ALLOW_INSECURE") or "").lower() in _TRUE,
        )

    @property
    def mutual_tls(self) -> bool:
        return self.tls_cert is not None and self.tls_ca is not None

    def __repr__(self) -> str:
        return (
            f"SecurityConfig(token={'<set>' if self.token else None}, "
            f"credential={'<set>' if self.credential else None}, tls_cert={self.tls_cert!r}, "
            f"tls_key={'<set>' if self.tls_key else None}, tls_ca={self.tls_ca!r}, "
            f"allow_insecure={self.allow_insecure})"
        )

    __str__ = __repr__


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # the wildcard address
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, sec: SecurityConfig) -> None:
    """Raise :class:`InsecureBind` for a non-loopback ``host`` that nobody authenticates on."""
    if sec.authenticates or sec.mutual_tls or sec.allow_insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to listen on {host or '0.0.0.0'!r} without authentication: set KVMESH_TOKEN "
        "(or KVMESH_TOKEN_FILE, KVMESH_CREDENTIAL, or mutual TLS), bind 127.0.0.1, or set "
        "KVMESH_ALLOW_INSECURE=1"
    )


def server_ssl_context(sec: SecurityConfig) -> ssl.SSLContext | None:
    """TLS context for a listening side (None without ``tls_cert``).

    With ``tls_ca`` clients must present a certificate chaining to it (mutual TLS).
    """
    if sec.tls_cert is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(sec.tls_cert, sec.tls_key)
    if sec.tls_ca is not None:
        ctx.load_verify_locations(sec.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(sec: SecurityConfig) -> ssl.SSLContext | None:
    """TLS context for a connecting side (None unless ``tls_ca`` or ``tls_cert`` is set).

    The server's certificate must chain to ``tls_ca``; host names are not checked (cluster
    members are addressed by IP and the CA is the cluster's own), the chain is.
    """
    if sec.tls_ca is None and sec.tls_cert is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    if sec.tls_ca is not None:
        ctx.load_verify_locations(sec.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE  # certificate offered for the server's check only
    if sec.tls_cert is not None:
        ctx.load_cert_chain(sec.tls_cert, sec.tls_key)
    return ctx


def cert_identities(peercert: Mapping[str, object] | None) -> set[tuple[str, str]]:
    """The kvmesh identities a verified certificate names: its subjectAltName URIs
    ``kvmesh://ROLE/ID`` (``kvmesh://client`` for a client), as (role, id) pairs."""
    out: set[tuple[str, str]] = set()
    for entry in (peercert or {}).get("subjectAltName", ()) or ():  # type: ignore[union-attr]
        kind, value = entry
        if kind != "URI" or not value.startswith("kvmesh://"):
            continue
        role, _, rest = value[len("kvmesh://") :].partition("/")
        out.add((role, ident.bound_id(role, rest)))
    return out


def check_cert_identity(
    sec: SecurityConfig, peercert: Mapping[str, object] | None, role: str, peer_id: str
) -> str | None:
    """Why a TLS peer claiming ``role`` ``peer_id`` is refused, or None. Only with mutual TLS
    (a verified certificate): one that names kvmesh identities must name this one; one that
    names none is refused when ``tls_require_ids`` is set."""
    if not sec.mutual_tls or not peercert:
        return None
    names = cert_identities(peercert)
    if not names:
        return "the certificate names no kvmesh identity" if sec.tls_require_ids else None
    if (role, ident.bound_id(role, peer_id)) in names:
        return None
    return f"the certificate does not name {role} {peer_id[:64]!r}"
