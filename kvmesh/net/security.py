"""Who may connect: the cluster shared secret, optional mutual TLS, and the bind-address rule.

The token comes from configuration or the environment only and is never logged (the
``repr`` of :class:`SecurityConfig` hides it). Without a token a server authenticates nobody,
so :func:`check_bind` refuses to listen anywhere but loopback unless ``allow_insecure`` is set
(or mutual TLS, which authenticates clients by certificate, is configured).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
from collections.abc import Mapping

import msgspec

from .errors import InsecureBind

_TRUE = {"1", "true", "yes", "on"}


class SecurityConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shared secret, optional mutual-TLS files, and the insecure-bind override."""

    token: str | None = None  # the cluster shared secret
    tls_cert: str | None = None  # PEM certificate chain of this process
    tls_key: str | None = None  # its private key
    tls_ca: str | None = None  # CA bundle peers' certificates must chain to (mutual TLS)
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
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SecurityConfig:
        """Read ``KVMESH_TOKEN`` (or ``KVMESH_TOKEN_FILE``), ``KVMESH_TLS_CERT``,
        ``KVMESH_TLS_KEY``, ``KVMESH_TLS_CA`` and ``KVMESH_ALLOW_INSECURE`` (1/true/yes/on)."""
        env = os.environ if environ is None else environ

        def get(key: str) -> str | None:
            value = env.get(key, "").strip()
            return value or None

        token = get("KVMESH_TOKEN")
        token_file = get("KVMESH_TOKEN_FILE")
        if token is not None and token_file is not None:
            raise ValueError("set KVMESH_TOKEN or KVMESH_TOKEN_FILE, not both")
        if token_file is not None:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip() or None
            if token is None:
                raise ValueError(f"KVMESH_TOKEN_FILE {token_file!r} is empty")
        return cls(
            token=token,
            tls_cert=get("KVMESH_TLS_CERT"),
            tls_key=get("KVMESH_TLS_KEY"),
            tls_ca=get("KVMESH_TLS_CA"),
            allow_insecure=(get("KVMESH_ALLOW_INSECURE") or "").lower() in _TRUE,
        )

    @property
    def mutual_tls(self) -> bool:
        return self.tls_cert is not None and self.tls_ca is not None

    def __repr__(self) -> str:
        return (
            f"SecurityConfig(token={'<set>' if self.token else None}, tls_cert={self.tls_cert!r}, "
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
    if sec.token is not None or sec.mutual_tls or sec.allow_insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to listen on {host or '0.0.0.0'!r} without authentication: set KVMESH_TOKEN "
        "(or KVMESH_TOKEN_FILE, or mutual TLS), bind 127.0.0.1, or set KVMESH_ALLOW_INSECURE=1"
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
