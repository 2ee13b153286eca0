"""The store RPC under mutual TLS (kvmesh.net contexts): a client with the cluster's
certificate and token works; one without TLS, or with an untrusted certificate, is refused."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from kvmesh.net.security import SecurityConfig
from kvmesh.store import StoreClient
from kvmesh.store import errors as E
from kvmesh.store.embedded_master import EmbeddedMaster


def _cert(d, name: str) -> tuple[str, str]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_store_over_mutual_tls(tmp_path):
    cert, key = _cert(tmp_path, "cluster")
    scert, skey = _cert(tmp_path, "stranger")
    sec = SecurityConfig(token="tls-token", tls_cert=cert, tls_key=key, tls_ca=cert)
    master = EmbeddedMaster(security=sec)
    try:
        c = StoreClient(master.address, security=sec, segment_size=8 << 20, timeout=10)
        try:
            c.put("tls-a", b"over tls")
            assert c.get("tls-a") == b"over tls"
        finally:
            c.close()
        for bad in (
            SecurityConfig(token="tls-token"),  # no TLS at all
            SecurityConfig(token="tls-token", tls_cert=scert, tls_key=skey, tls_ca=cert),
        ):
            t0 = time.monotonic()
            other = StoreClient(master.address, security=bad, timeout=3)
            try:
                with pytest.raises(E.StoreUnavailable):
                    other.exists("tls-a")
            finally:
                other.close()
            assert time.monotonic() - t0 < 10
    finally:
        master.stop()
