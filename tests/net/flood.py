"""Pre-authentication floods for live-server tests (an attacker without the token).

* :class:`SilentFlood` (a thread): holds ``n`` connections that never send a byte, and
  reopens each one the server closes (at its handshake deadline, or evicted), so the
  server's handshake slots stay full.
* ``python -m tests.net.flood HOST PORT SECONDS [SOURCE]`` (a process, :func:`connect_flood`):
  opens connections as fast as it can for ``SECONDS``, keeping the newest 256 open (silent)
  and closing the oldest, so the server's handshake slots are both full and churned.
  Prints the number of connections it opened (also when stopped early with SIGINT:
  :func:`stop_connect_flood`).

Both are bounded in count and time and bind only loopback source addresses.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque

_RST = struct.pack("ii", 1, 0)


def _open(host: str, port: int, source: str | None, blocking: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if source is not None:
            s.bind((source, 0))
        if blocking:
            s.settimeout(2.0)
            s.connect((host, port))
        else:
            s.setblocking(False)
            err = s.connect_ex((host, port))
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, "connect")
    except BaseException:
        s.close()
        raise
    return s


class SilentFlood:
    """``n`` silent connections to ``(host, port)`` from ``source``, renewed as the server
    closes them, for at most ``max_s`` seconds (context manager)."""

    def __init__(
        self, host: str, port: int, n: int, source: str | None = None, max_s: float = 60.0
    ) -> None:
        self.addr = (host, port)
        self.n = n
        self.source = source
        self.max_s = max_s
        self.opened = 0
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name="silent-flood", daemon=True)

    def __enter__(self) -> SilentFlood:
        for _ in range(self.n):
            self._add()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()

    def _add(self) -> None:
        try:
            s = _open(*self.addr, self.source, blocking=True)
        except OSError:
            return  # refused at once (a cap): the next round tries again
        s.setblocking(False)
        self._sel.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < end:
            for key, _ in self._sel.select(0.02):
                s = key.fileobj
                try:
                    data = s.recv(4096)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it: open another in its place
                    self._sel.unregister(s)
                    s.close()  # type: ignore[union-attr]
                    self.closed_by_server += 1
            # Refill at once: an attacker reopens each connection the moment it is closed.
            missing = self.n - len(self._sel.get_map())
            for _ in range(missing):
                if self._stop.is_set():
                    break
                self._add()


def connect_flood(host: str, port: int, seconds: float, source: str | None = None) -> int:
    """Open connections as fast as possible for ``seconds`` (module docstring)."""
    ring: deque[socket.socket] = deque()
    errors: dict[int | None, int] = {}
    n = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for _ in range(64):
                try:
                    ring.append(_open(host, port, source, blocking=False))
                    n += 1
                except OSError as exc:
                    errors[exc.errno] = errors.get(exc.errno, 0) + 1
                    time.sleep(0.001)  # refused, or out of ports or fds for a moment
                    break
                while len(ring) > 256:
                    old = ring.popleft()
                    with contextlib.suppress(OSError):
                        old.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
                    old.close()  # a reset: no TIME_WAIT to exhaust the source's ports
    except KeyboardInterrupt:
        pass  # stopped early (SIGINT, stop_connect_flood): report what was opened
    finally:
        for s in ring:
            s.close()
        if errors:
            print("connect errors:", errors, file=sys.stderr)
    return n


def start_connect_flood(
    host: str, port: int, seconds: float, source: str | None = None
) -> subprocess.Popen:
    """:func:`connect_flood` in a child process (it needs a CPU of its own to flood)."""
    args = [sys.executable, "-m", "tests.net.flood", host, str(port), str(seconds)]
    if source is not None:
        args.append(source)
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def stop_connect_flood(p: subprocess.Popen, timeout: float = 10.0) -> int:
    """Stop a :func:`start_connect_flood` process (SIGINT) and return how many connections
    it opened (0 if it printed nothing)."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    try:
        return int((out or "").strip() or 0)
    except ValueError:
        return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    print(connect_flood(a[0], int(a[1]), float(a[2]), a[3] if len(a) > 3 else None), flush=True)
