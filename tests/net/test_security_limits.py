"""SecurityConfig, check_bind, mutual TLS contexts, Deadline and ConnectionLimiter."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from kvmesh.net import (
    ConnectionLimiter,
    Deadline,
    DeadlineExceeded,
    InsecureBind,
    SecurityConfig,
    check_bind,
    client_handshake,
    client_ssl_context,
    family_of,
    join_host_port,
    server_handshake,
    server_ssl_context,
    source_of,
    split_host_port,
)


def test_from_env_reads_every_variable(tmp_path):
    env = {
        "KVMESH_TOKEN": "abc",
        "KVMESH_TLS_CERT": "/c",
        "KVMESH_TLS_KEY": "/k",
        "KVMESH_TLS_CA": "/ca",
        "KVMESH_ALLOW_INSECURE": "yes",
    }
    sec = SecurityConfig.from_env(env)
    assert sec == SecurityConfig(
        token="abc", tls_cert="/c", tls_key="/k", tls_ca="/ca", allow_insecure=True
    )
    assert "abc" not in repr(sec) and "abc" not in str(sec)
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    assert SecurityConfig.from_env({"KVMESH_TOKEN_FILE": str(f)}).token == "from-file"
    with pytest.raises(ValueError, match="not both"):
        SecurityConfig.from_env({"KVMESH_TOKEN": "a", "KVMESH_TOKEN_FILE": str(f)})
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        SecurityConfig.from_env({"KVMESH_TOKEN_FILE": str(f)})
    assert SecurityConfig.from_env({}) == SecurityConfig()
    assert SecurityConfig.from_env({"KVMESH_ALLOW_INSECURE": "0"}).allow_insecure is False
    with pytest.raises(ValueError):
        SecurityConfig(token="")
    with pytest.raises(ValueError):
        SecurityConfig(tls_cert="/c")


def test_check_bind():
    open_sec = SecurityConfig()
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        check_bind(host, open_sec)
    for host in ("0.0.0.0", "", "::", "10.1.2.3"):
        with pytest.raises(InsecureBind) as ei:
            check_bind(host, open_sec)
        assert isinstance(ei.value, ValueError)
        check_bind(host, SecurityConfig(token="t"))
        check_bind(host, SecurityConfig(allow_insecure=True))
        check_bind(host, SecurityConfig(tls_cert="/c", tls_key="/k", tls_ca="/ca"))


def test_deadline_with_a_fake_clock():
    now = [100.0]
    d = Deadline(2.0, clock=lambda: now[0])
    assert d.remaining() == 2.0 and not d.expired()
    assert d.check() == 2.0
    now[0] = 101.5
    assert d.remaining() == pytest.approx(0.5)
    now[0] = 102.0
    assert d.expired() and d.remaining() == 0.0
    with pytest.raises(DeadlineExceeded):
        d.check("handshake")


def test_connection_limiter_caps_and_releases():
    lim = ConnectionLimiter(max_total=4, max_unauthenticated=2)
    a, b = lim.try_acquire(), lim.try_acquire()
    assert a and b and lim.try_acquire() is None  # unauthenticated cap
    lim.authenticated(a)
    lim.authenticated(a)  # idempotent
    c = lim.try_acquire()
    assert c is not None and lim.unauthenticated == 2
    lim.authenticated(b)
    lim.authenticated(c)
    d = lim.try_acquire()
    assert d is not None and lim.total == 4
    assert lim.try_acquire() is None  # total cap
    lim.release(d)
    lim.release(d)  # idempotent
    assert lim.total == 3 and lim.unauthenticated == 0 and lim.refused == 2
    for s in (a, b, c):
        lim.release(s)
    assert lim.total == 0


def test_connection_limiter_evicts_the_oldest_unauthenticated_connection():
    lim = ConnectionLimiter(max_total=5, max_unauthenticated=2)
    closed: list[str] = []
    a = lim.try_acquire(on_evict=lambda: closed.append("a"))
    b = lim.try_acquire(on_evict=lambda: closed.append("b"))
    c = lim.try_acquire(on_evict=lambda: closed.append("c"))  # takes a's place
    assert c is not None and closed == ["a"] and a.evicted and lim.evicted == 1
    assert lim.unauthenticated == 2 and lim.total == 2
    assert lim.authenticated(a) is False  # too late: its connection must close
    lim.release(a)  # idempotent after eviction
    assert lim.authenticated(b) is True  # authenticated slots are never evicted
    d = lim.try_acquire(on_evict=lambda: closed.append("d"))
    e = lim.try_acquire()  # without on_evict: c is the oldest evictable
    assert d is not None and e is not None and closed == ["a", "c"]
    f = lim.try_acquire()  # d, the last evictable one, makes room
    assert f is not None and closed == ["a", "c", "d"]
    assert lim.try_acquire() is None  # e and f cannot be evicted: refused as before
    assert lim.total == 3 and lim.unauthenticated == 2 and lim.refused == 1
    for s in (b, c, d, e, f):
        lim.release(s)
    assert lim.total == 0 and lim.unauthenticated == 0


def test_connection_limiter_is_thread_safe():
    lim = ConnectionLimiter(max_total=50, max_unauthenticated=50)
    held: list = []
    lock = threading.Lock()

    def worker():
        for _ in range(2000):
            s = lim.try_acquire()
            if s is not None:
                lim.authenticated(s)
                lim.release(s)
        s = lim.try_acquire()
        if s is not None:
            with lock:
                held.append(s)

    ts = [threading.Thread(target=worker) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert lim.total == len(held) == 8 and lim.unauthenticated == 8


# --- mutual TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A self-signed CA-less cert used as its own trust anchor, and a second unrelated one."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
    d = tmp_path_factory.mktemp("tls")
    out = {}
    for name in ("cluster", "stranger"):
        cert, key = d / f"{name}.pem", d / f"{name}.key"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "2",
                "-subj",
                f"/CN={name}",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
        )
        out[name] = (str(cert), str(key))
    return out


def _serve_tls(sec: SecurityConfig, box: dict):
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        raw, _ = lsock.accept()
        raw.settimeout(5)
        try:
            with server_ssl_context(sec).wrap_socket(raw, server_side=True) as s:
                box["peer"] = server_handshake(s, sec, "store", "srv", 5.0)
        except Exception as exc:
            box["error"] = exc
        finally:
            raw.close()
            lsock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lsock.getsockname(), t


def test_mutual_tls_then_handshake(certs):
    cert, key = certs["cluster"]
    sec = SecurityConfig(token="t", tls_cert=cert, tls_key=key, tls_ca=cert)
    box: dict = {}
    addr, t = _serve_tls(sec, box)
    raw = socket.create_connection(addr, timeout=5)
    with client_ssl_context(sec).wrap_socket(raw) as s:
        assert client_handshake(s, sec, "store", "cli", 5.0) == "srv"
        assert s.version() in ("TLSv1.2", "TLSv1.3")
    t.join(5)
    assert box == {"peer": "cli"}


def test_mutual_tls_refuses_a_client_without_a_trusted_cert(certs):
    cert, key = certs["cluster"]
    sec = SecurityConfig(tls_cert=cert, tls_key=key, tls_ca=cert)
    scert, skey = certs["stranger"]
    stranger = SecurityConfig(tls_cert=scert, tls_key=skey, tls_ca=cert)
    box: dict = {}
    addr, t = _serve_tls(sec, box)
    raw = socket.create_connection(addr, timeout=5)
    with (
        pytest.raises((ssl.SSLError, OSError, EOFError)),
        client_ssl_context(stranger).wrap_socket(raw) as s,
    ):
        client_handshake(s, stranger, "store", "cli", 5.0)
    t.join(5)
    assert isinstance(box.get("error"), ssl.SSLError), box
    # A client that does not trust the server's certificate refuses it as well.
    box = {}
    addr, t = _serve_tls(sec, box)
    raw = socket.create_connection(addr, timeout=5)
    wary = SecurityConfig(tls_cert=cert, tls_key=key, tls_ca=scert)
    with pytest.raises(ssl.SSLCertVerificationError):
        client_ssl_context(wary).wrap_socket(raw)
    t.join(5)
    raw.close()


def test_no_tls_without_files():
    assert server_ssl_context(SecurityConfig(token="t")) is None
    assert client_ssl_context(SecurityConfig(token="t")) is None


def test_connection_limiter_per_source_cap_evicts_only_that_sources_handshakes():
    lim = ConnectionLimiter(max_total=10, max_unauthenticated=4, max_unauthenticated_per_source=2)
    closed: list[str] = []

    def slot(name: str, src: str):
        return lim.try_acquire(on_evict=lambda: closed.append(name), source=src)

    good = slot("good", "10.0.0.1")
    a1, a2 = slot("a1", "10.0.0.9"), slot("a2", "10.0.0.9")
    # The flooding source is at its cap: its own oldest goes.
    assert slot("a3", "10.0.0.9") is not None
    assert closed == ["a1"] and a1.evicted and not good.evicted
    assert lim.unauthenticated_from("10.0.0.9") == 2 and lim.unauthenticated == 3
    for i in range(20):  # however fast it floods, it only churns its own slots
        slot(f"a{i + 4}", "10.0.0.9")
    assert "good" not in closed and lim.unauthenticated_from("10.0.0.9") == 2
    b = slot("b", "10.0.0.2")
    c = slot("c", "10.0.0.3")  # the global cap: the heaviest source (the flood) pays
    assert c is not None and closed[-1].startswith("a") and not good.evicted and not b.evicted
    assert lim.authenticated(good) is True and lim.authenticated(a2) is False
    # Without on_evict, a source at its cap is refused rather than evicting anything.
    lim2 = ConnectionLimiter(4, 4, 1)
    assert lim2.try_acquire(source="x") is not None and lim2.try_acquire(source="x") is None
    assert lim2.try_acquire(source="y") is not None and lim2.try_acquire() is not None
    assert lim2.refused == 1


def test_source_of_groups_ipv6_by_64_and_maps_ipv4():
    assert source_of(("10.1.2.3", 5)) == "10.1.2.3"
    assert source_of(("2001:db8:1:2:aa::1", 5, 0, 0)) == source_of(("2001:db8:1:2:bb::9", 1, 0, 0))
    assert source_of(("2001:db8:1:2::1", 5, 0, 0)) != source_of(("2001:db8:1:3::1", 5, 0, 0))
    assert source_of(("::ffff:10.1.2.3", 5, 0, 0)) == "10.1.2.3"
    assert source_of(None) == "" and source_of("/tmp/sock") == ""


def test_address_helpers_take_bracketed_ipv6():
    assert split_host_port("[::1]:7001") == ("::1", 7001)
    assert split_host_port("host:1") == ("host", 1)
    assert join_host_port("::1", 7001) == "[::1]:7001"
    assert join_host_port("10.0.0.1", 1) == "10.0.0.1:1"
    for bad in ("::1:7001", "nohost", "h:99999", "[]:1", ":1"):
        with pytest.raises(ValueError):
            split_host_port(bad)
    assert family_of("::1") == socket.AF_INET6 and family_of("127.0.0.1") == socket.AF_INET


def test_connection_limiter_never_evicts_a_handshake_younger_than_the_minimum_age():
    now = [100.0]
    lim = ConnectionLimiter(8, 4, 2, min_handshake_age_s=0.25, clock=lambda: now[0])
    closed: list[str] = []

    def slot(name: str, src: str):
        return lim.try_acquire(on_evict=lambda: closed.append(name), source=src)

    a1, a2 = slot("a1", "10.0.0.9"), slot("a2", "10.0.0.9")
    # A flood churning faster than a handshake can finish is refused, not admitted in place
    # of its own young handshakes (each of which still gets its quarter second).
    assert slot("a3", "10.0.0.9") is None and closed == [] and lim.refused_young == 1
    now[0] += 0.3
    assert slot("a4", "10.0.0.9") is not None and closed == ["a1"] and a1.evicted
    assert not a2.evicted
    # The total cap: only a victim old enough, whichever source holds the most.
    b, c = slot("b", "10.0.0.2"), slot("c", "10.0.0.3")
    assert lim.unauthenticated == 4 and closed == ["a1"]
    assert slot("d", "10.0.0.4") is not None and closed == ["a1", "a2"]  # a2 is 0.3 s old
    assert slot("e", "10.0.0.5") is None and lim.refused_young == 2  # all of them are young
    assert not (b.evicted or c.evicted)
