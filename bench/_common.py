"""Helpers shared by every script in bench/ (conventions: shared docs bench-format.md).

* :func:`bench_args`: the common ``--quick`` / ``--json PATH`` command line;
* :func:`memcpy_gbps`, :func:`copy_all_cores_gbps` and :func:`tcp_gbps`: the same-run
  reference limits (single-thread memcpy of 64 MiB buffers; every core copying its own part
  at once; one raw TCP loopback stream between two processes); :func:`copy_limits` measures
  both copy limits, :func:`copy_limits_text` prints them;
* :func:`record`: one result row with every standard field (``None`` where it does not apply)
  and the ratios to the limits filled in;
* :func:`print_table` and :func:`write_json`: the human table and the JSON object;
* :func:`timed`: median of repetitions after warm-up; :func:`percentiles`;
* :class:`Child`: a helper process speaking JSON lines (peers that own remote memory);
  :func:`peer_child`: a script's own ``--peer`` mode as a :class:`Child`;
* :func:`cpu_seconds`: user+system CPU time of a process (idle-cost measurements).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

FIELDS = (
    "case",
    "transport",
    "op",
    "page_bytes",
    "batch",
    "gbps",
    "ops_per_s",
    "p50_us",
    "p99_us",
    "ratio_memcpy",
    "ratio_copy_limit",
    "ratio_tcp",
)

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_args(
    description: str,
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Parse ``--quick`` and ``--json PATH`` (plus the script's own options via ``extra``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and repetitions, same code paths (< 60 s on 2 cores)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as one JSON object")
    if extra is not None:
        extra(ap)
    return ap.parse_args(argv)


def machine_info() -> dict[str, Any]:
    gpu = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    # Other jobs on a shared box skew every figure: record how busy it was.
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "gpu": gpu,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


# --- timing ----------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def percentiles(samples_s: Iterable[float], qs: Sequence[float] = (50, 99)) -> list[float]:
    """Percentiles of durations in seconds, returned in microseconds."""
    arr = np.asarray(list(samples_s), dtype=np.float64) * 1e6
    return [float(np.percentile(arr, q)) for q in qs]


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds used so far by process ``pid`` (default: this one)."""
    if pid is None or pid == os.getpid():
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_fraction(pid: int | None, seconds: float) -> float:
    """Share of one core process ``pid`` used while we sleep ``seconds``."""
    c0, w0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - w0)


# --- reference limits ------------------------------------------------------------------------


def memcpy_gbps(size: int = 64 * MiB, reps: int = 5) -> float:
    """Single-thread memcpy bandwidth between two ``size``-byte buffers (GB/s, median)."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    dt = timed(lambda: np.copyto(dst, src), reps, warmup=2)
    return size / dt / 1e9


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def copy_all_cores_gbps(part: int = 32 * MiB, reps: int = 5, threads: int | None = None) -> float:
    """The machine's copy bandwidth with every core copying at once (GB/s, median of ``reps``).

    One thread per CPU, each copying its own ``part``-byte slice of two shared buffers
    (disjoint, so no line is shared), all released together; a round lasts until the last
    thread is done. ``ctypes.memmove`` releases the GIL, so the threads copy in parallel. This
    is the ceiling of a same-host transfer, which may copy on several cores (the engine's
    workers, a peer process): ratios above 1 x single-thread memcpy stay below this one.
    """
    n = max(1, threads or cpus())
    src = np.ones(part * n, dtype=np.uint8)
    dst = np.ones(part * n, dtype=np.uint8)  # written now: no first-touch faults in a round
    sa, da = src.ctypes.data, dst.ctypes.data
    start, done = threading.Barrier(n + 1), threading.Barrier(n + 1)
    rounds = reps + 1  # the first warms up
    # Each thread stamps its own copy: the coordinating thread is one more than there are
    # CPUs, so its clock reading after the barrier can come late (a worker ran first) and a
    # round timed there looked several times faster than memory (51 GB/s seen on 2 cores).
    spans = np.zeros((rounds, n, 2))

    def work(i: int) -> None:
        for r in range(rounds):
            start.wait()
            spans[r, i, 0] = time.perf_counter()
            ctypes.memmove(da + i * part, sa + i * part, part)
            spans[r, i, 1] = time.perf_counter()
            done.wait()

    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in pool:
        t.start()
    try:
        for _ in range(rounds):
            start.wait(60)
            done.wait(60)
    finally:
        for t in pool:
            t.join(60)
    times = spans[:, :, 1].max(axis=1) - spans[:, :, 0].min(axis=1)
    return part * n / float(np.median(times[1:])) / 1e9


def copy_limits(limits: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure both copy limits into ``limits`` (kept where an earlier sample was higher: a
    limit is the best the machine did in this run) and return it."""
    limits = {} if limits is None else limits
    for key, fn in (("memcpy_gbps", memcpy_gbps), ("copy_all_cores_gbps", copy_all_cores_gbps)):
        limits[key] = round(max(limits.get(key) or 0.0, fn()), 3)
    return limits


def copy_limits_text(limits: dict[str, Any]) -> str:
    """``memcpy X GB/s (one thread), all cores Y GB/s (N threads, Zx)`` for a limits line."""
    mem, allc = limits.get("memcpy_gbps"), limits.get("copy_all_cores_gbps")
    text = f"memcpy {mem:.2f} GB/s (one thread)" if mem else "memcpy -"
    if allc:
        text += f", all cores {allc:.2f} GB/s ({cpus()} threads"
        text += f", {allc / mem:.2f}x)" if mem else ")"
    return text


_TCP_SENDER = r"""
import socket, sys, numpy as np
port, total, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = memoryview(np.ones(chunk, dtype=np.uint8))
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
sent = 0
while sent < total:
    n = min(chunk, total - sent)
    s.sendall(buf[:n])
    sent += n
s.shutdown(socket.SHUT_WR)
s.recv(1)
"""


def tcp_gbps(total: int = 512 * MiB, chunk: int = 4 * MiB, reps: int = 3) -> float:
    """One raw TCP loopback stream from a child process, received with ``recv_into`` (GB/s).

    ``chunk`` is the send and receive buffer: 4 MiB stays in cache (64 MiB measured 30-50 %
    slower on the 2-vCPU box), so this is the stream at its best, as a limit should be.
    """
    rates = []
    buf = np.empty(chunk, dtype=np.uint8)
    view = memoryview(buf)
    for rep in range(reps + 1):  # the first stream warms up
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-c", _TCP_SENDER, str(port), str(total), str(chunk)]
        )
        try:
            conn, _ = srv.accept()
            got = conn.recv_into(view, chunk)
            t0 = time.perf_counter()
            while got < total:
                n = conn.recv_into(view, min(chunk, total - got))
                if n == 0:
                    raise RuntimeError("TCP reference stream ended early")
                got += n
            dt = time.perf_counter() - t0
            conn.sendall(b"x")
            conn.close()
        finally:
            srv.close()
            child.wait(30)
        if rep:
            rates.append(total / dt / 1e9)
    return float(np.median(rates))


# --- records and output ----------------------------------------------------------------------


def record(
    limits: dict[str, float | None],
    case: str,
    transport: str | None,
    op: str | None,
    page_bytes: int | None = None,
    batch: int | None = None,
    gbps: float | None = None,
    ops_per_s: float | None = None,
    p50_us: float | None = None,
    p99_us: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One result row in bench-format.md's shape; ratios computed from ``limits``."""
    mem = limits.get("memcpy_gbps")
    allc = limits.get("copy_all_cores_gbps")
    tcp = limits.get("tcp_gbps")
    row: dict[str, Any] = {
        "case": case,
        "transport": transport,
        "op": op,
        "page_bytes": page_bytes,
        "batch": batch,
        "gbps": None if gbps is None else round(gbps, 4),
        "ops_per_s": None if ops_per_s is None else round(ops_per_s, 1),
        "p50_us": None if p50_us is None else round(p50_us, 2),
        "p99_us": None if p99_us is None else round(p99_us, 2),
        "ratio_memcpy": None if gbps is None or not mem else round(gbps / mem, 3),
        "ratio_copy_limit": None if gbps is None or not allc else round(gbps / allc, 3),
        "ratio_tcp": None if gbps is None or not tcp else round(gbps / tcp, 3),
    }
    row.update(extra)
    return row


def apply_ratios(records: list[dict[str, Any]], limits: dict[str, float | None]) -> None:
    """(Re)compute every record's ratios from ``limits`` (once the limits are final)."""
    mem = limits.get("memcpy_gbps")
    allc = limits.get("copy_all_cores_gbps")
    tcp = limits.get("tcp_gbps")
    for r in records:
        g = r.get("gbps")
        r["ratio_memcpy"] = None if g is None or not mem else round(g / mem, 3)
        r["ratio_copy_limit"] = None if g is None or not allc else round(g / allc, 3)
        r["ratio_tcp"] = None if g is None or not tcp else round(g / tcp, 3)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}" if v < 10 else f"{v:.1f}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _size(v: Any) -> str:
    if not isinstance(v, int):
        return _fmt(v)
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if v >= 1 << k and v % (1 << k) == 0:
            return f"{v >> k} {unit}"
    return str(v)


def print_table(
    rows: list[dict[str, Any]], columns: Sequence[str] = FIELDS, out: Any = None
) -> None:
    """Print ``rows`` as an aligned text table (``page_bytes`` shown with units)."""
    out = out or sys.stdout
    head = [c.replace("_", " ") for c in columns]
    body = [
        [_size(r.get(c)) if c == "page_bytes" else _fmt(r.get(c)) for c in columns] for r in rows
    ]
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    # numbers (and sizes) right-aligned, text left-aligned
    numeric = [
        c == "page_bytes"
        or all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows)
        and any(r.get(c) is not None for r in rows)
        for c in columns
    ]
    line = "  ".join(h.rjust(w) if n else h.ljust(w) for h, w, n in zip(head, widths, numeric))
    out.write(line + "\n" + "  ".join("-" * w for w in widths) + "\n")
    for b in body:
        out.write(
            "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(b, widths, numeric)) + "\n"
        )
    out.flush()


def print_footer(
    records: list[dict[str, Any]], targets: list[dict[str, Any]], t_start: float
) -> float:
    """Print the targets (met / MISSED) and the run's summary line (records, time, load
    average); the run's seconds since ``t_start``."""
    if targets:
        print("\ntargets:")
        for t in targets:
            print(
                f"  [{'met' if t['met'] else 'MISSED'}] {t['target']} ({t['path']}): {t['value']}"
            )
    elapsed = time.monotonic() - t_start
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{len(records)} records in {elapsed:.1f} s (load average {load} on "
        f"{os.cpu_count()} CPUs; other jobs skew the figures)",
        flush=True,
    )
    return elapsed


def write_json(
    path: str,
    bench: str,
    limits: dict[str, float | None],
    records: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """Write the bench-format JSON object to ``path`` and return it."""
    obj: dict[str, Any] = {
        "bench": bench,
        "machine": machine_info(),
        "limits": limits,
        "records": records,
    }
    obj.update(extra)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return obj


# --- helper processes ------------------------------------------------------------------------


class Child:
    """A helper process that answers JSON-line commands on stdin with JSON lines on stdout.

    Lines that are not JSON objects (UCX prints to stdout) are skipped. The child's first
    line is its greeting (``info``).
    """

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        cwd: str | None = None,
    ) -> None:
        full = dict(os.environ)
        full.update(env or {})
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full, cwd=cwd
        )
        self.pid = self.proc.pid
        self.info = self._read(timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        end = time.monotonic() + timeout
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError("helper process did not answer in time")
                line = self.proc.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    raise RuntimeError(f"helper process exited (rc={self.proc.poll()})")
                line = line.strip()
                if line.startswith("{"):
                    msg = json.loads(line)
                    if "error" in msg:
                        raise RuntimeError(f"helper process: {msg['error']}")
                    return msg
        finally:
            sel.close()

    def call(self, cmd: str, timeout: float = 120.0, **kw: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=20)
            except Exception:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def peer_child(script: str, *args: str, host_id: str | None = None) -> Child:
    """``python script --peer args...`` as a :class:`Child`, with the repository importable.

    ``host_id`` (``KVMESH_HOST_ID``) makes the peer look like another host, which forces the
    network transport between it and this process.
    """
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if host_id:
        env["KVMESH_HOST_ID"] = host_id
    return Child([sys.executable, os.path.abspath(script), "--peer", *args], env=env)


def serve_json_lines(
    handlers: dict[str, Callable[..., dict[str, Any]]], greeting: dict[str, Any]
) -> None:
    """The child side of :class:`Child`: greet, then answer commands until ``exit``."""
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say(greeting)
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd == "exit":
                if "exit" in handlers:
                    handlers["exit"]()
                say({"ok": True})
                return
            say(handlers[cmd](**msg))
        except Exception as exc:  # reported to the parent, which decides
            say({"error": f"{type(exc).__name__}: {exc}"})
