"""The ``kvmesh`` command.

``kvmesh master`` / ``node`` / ``up`` / ``status``: the store (see kvmesh/store/cli.py).
``kvmesh info``   what this host offers: host id, transports (and why one is missing), NIXL,
                  the copy routine in use.
``kvmesh demo``   the store demo (kvmesh/store/demo.py): an embedded store, a prefill worker
                  writing prefix KV pages (256 x 1 MiB a round), decode workers reading them
                  back on this host and over the network path, every byte verified; a
                  warm-up round reported apart from the steady state.
``kvmesh demo transfer``   the transfer engine alone: a second process holds a KV page pool
                  in shared memory (a "cache node"); this process (a "prefill worker") WRITEs
                  batches of real KV pages into it and READs them back over every transport that
                  can reach it, verifies every byte, and prints pages/s and GB/s per transport.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return (
                f"{n:g} {unit}"
                if unit == "B"
                else f"{n:.0f} {unit}"
                if n == int(n)
                else f"{n:.1f} {unit}"
            )
        n /= 1024  # type: ignore[assignment]
    return str(n)


# --- info ---------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    from kvmesh.transfer import EngineConfig, TransferEngine, fastcopy, nixl, shmfile

    cfg = EngineConfig.from_env(shm_sweep=False)
    with TransferEngine(config=cfg) as eng:
        info = eng.info()
    ch = fastcopy.choice()
    info["copy"] = ch.label
    info["copy_kernel"] = {
        "kernel": ch.kernel,
        "reason": ch.reason,
        "probe_ms": ch.probe_ms,
        "gbps": ch.medians(),  # median GB/s per probe shape and kernel
    }
    info["nixl"] = {"installed": nixl.installed_reason() is None, "reason": nixl.installed_reason()}
    if args.probe_nixl:
        info["nixl"]["usable"] = nixl.available()
        info["nixl"]["version"] = nixl.nixl_version()
        info["nixl"]["reason"] = nixl.unavailable_reason()
    try:
        free, total = shmfile.space()
        info["shm"] = {"dir": shmfile.SHM_DIR, "free_bytes": free, "size_bytes": total}
    except OSError as e:
        info["shm"] = {"dir": shmfile.SHM_DIR, "error": e.strerror}
    info["python"] = platform.python_version()
    info["cpus"] = os.cpu_count()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"kvmesh transfer engine on {platform.node()} "
        f"(python {info['python']}, {info['cpus']} cpus)"
    )
    print(f"  host id       {info['host_id']}")
    print(f"  copy routine  {info['copy']}")
    for shape, by in info["copy_kernel"]["gbps"].items():
        figures = ", ".join(f"{k} {v:.1f}" for k, v in by.items())
        print(f"    {shape:14} {figures} GB/s")
    if ch.probe_ms is not None:
        print(f"    (probe of {ch.probe_ms:.0f} ms at engine start; KVMESH_COPY forces a kernel)")
    nx = info["nixl"]
    state = "installed" if nx["installed"] else f"not installed ({nx['reason']})"
    if "usable" in nx:
        state = (
            f"usable, version {nx['version']}" if nx["usable"] else f"not usable ({nx['reason']})"
        )
    print(f"  nixl          {state}")
    sh = info["shm"]
    if "error" in sh:
        print(f"  shared memory {sh['dir']}: {sh['error']}")
    else:
        print(
            f"  shared memory {sh['dir']}: {sh['free_bytes'] / 2**20:,.0f} MiB free of "
            f"{sh['size_bytes'] / 2**20:,.0f} MiB (shared segments and pools must fit here)"
        )
    print("  transports (preference order):")
    for kind, status in info["transports"].items():
        print(f"    {kind:9} {status}")
    return 0


# --- demo ---------------------------------------------------------------------------------------
def _demo_peer(args: argparse.Namespace) -> int:
    """The cache node: holds the pool, answers checksum requests on stdin."""
    import hashlib

    from kvmesh.transfer import EngineConfig, TransferEngine

    eng = TransferEngine(node_id="cache-node", config=EngineConfig.from_env())
    pool = eng.alloc_shared(args.slots * args.page_bytes, name="kv-pool")
    arr = pool.array().reshape(args.slots, args.page_bytes)
    print(json.dumps({"address": eng.address, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "sha":
            h = hashlib.sha256()
            for s in msg["slots"]:
                h.update(memoryview(arr[s]))
            print(json.dumps({"sha": h.hexdigest()}), flush=True)
        elif msg.get("cmd") == "exit":
            break
    eng.close()
    return 0


class _Node:
    def __init__(self, slots: int, page_bytes: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "_demo-peer",
                "--slots",
                str(slots),
                "--page-bytes",
                str(page_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.address = self._read()["address"]

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"cache node exited (rc={self.proc.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def sha(self, slots: list[int]) -> str:
        self.proc.stdin.write(json.dumps({"cmd": "sha", "slots": slots}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()["sha"]

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"cmd": "exit"}\n')  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)


def _kv_pages(n: int, layers: int, heads: int, head_dim: int, tokens: int, seed: int) -> np.ndarray:
    """n KV pages in page-first layout: [page][layer][K|V][token][head][dim], float16."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((n, layers, 2, tokens, heads, head_dim), dtype=np.float32)
    return kv.astype(np.float16)


def cmd_demo(args: argparse.Namespace) -> int:
    import hashlib

    from kvmesh.transfer import EngineConfig, Op, TransferEngine, TransportKind

    page_shape = (args.layers, 2, args.page_tokens, args.kv_heads, args.head_dim)
    page_bytes = int(np.prod(page_shape)) * 2
    n = args.pages
    slots = max(2 * n, args.slots)
    print(
        f"kvmesh demo: {n} KV pages of {_fmt_bytes(page_bytes)} "
        f"({args.layers} layers x K,V x {args.page_tokens} tokens x {args.kv_heads} heads x "
        f"{args.head_dim} dims, fp16) into a {_fmt_bytes(slots * page_bytes)} shared pool "
        f"held by a second process",
        flush=True,
    )
    t_start = time.monotonic()
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    node = _Node(slots, page_bytes, env)
    rows = []
    ok = True
    try:
        pages = _kv_pages(
            n, *page_shape[:1], args.kv_heads, args.head_dim, args.page_tokens, seed=1
        )
        flat = pages.reshape(n, page_bytes // 2).view(np.uint8).reshape(n, page_bytes)
        wanted = args.transports.split(",") if args.transports != "auto" else ["shm", "nixl", "tcp"]
        for name in wanted:
            kind = TransportKind(name)
            try:
                eng = TransferEngine(
                    node_id=f"prefill-{name}", config=EngineConfig.from_env(transport=kind.value)
                )
            except Exception as exc:
                rows.append((name, "-", "-", "-", "-", f"unavailable: {exc}"))
                continue
            try:
                src = eng.register(flat)
                back_arr = np.zeros_like(flat)
                back = eng.register(back_arr)
                seg = eng.open_segment(node.address, "kv-pool")
                rng = np.random.default_rng(2)
                last_dest = np.arange(n)  # slots of the last WRITE round: what READ fetches back
                for op in (Op.WRITE, Op.READ):
                    times = []
                    for rnd in range(args.rounds + 1):  # the first round warms up (connect, map)
                        dest = rng.permutation(slots)[:n]
                        if op is Op.READ:
                            dest = last_dest
                        t0 = time.perf_counter()
                        res = eng.transfer(
                            op,
                            src if op is Op.WRITE else back,
                            np.arange(n) * page_bytes,
                            seg,
                            dest * page_bytes,
                            page_bytes,
                        )
                        dt = time.perf_counter() - t0
                        if rnd:
                            times.append(dt)
                        if op is Op.WRITE:
                            last_dest = dest
                    served = ",".join(k.value for k in res.transports)
                    if op is Op.WRITE:
                        h = hashlib.sha256()
                        for i in range(n):
                            h.update(memoryview(flat[i]))
                        good = node.sha(last_dest.tolist()) == h.hexdigest()
                    else:
                        good = bool((back_arr == flat).all())
                        back_arr[:] = 0
                    ok &= good
                    dt = float(np.median(times))
                    rows.append(
                        (
                            name,
                            op.value,
                            f"{n / dt:,.0f}",
                            f"{n * page_bytes / dt / 1e9:.2f}",
                            served,
                            "verified" if good else "MISMATCH",
                        )
                    )
            except Exception as exc:
                ok = False
                rows.append((name, "-", "-", "-", "-", f"failed: {type(exc).__name__}: {exc}"))
            finally:
                eng.close()
    finally:
        node.close()
    head = ("transport", "op", "pages/s", "GB/s", "served by", "bytes")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(
        f"done in {time.monotonic() - t_start:.1f}s; "
        f"every page {'verified' if ok else 'NOT verified'}"
    )
    return 0 if ok else 1


def _demo(args: argparse.Namespace) -> int:
    if args.which == "transfer":
        args.pages = args.pages or 128
        return cmd_demo(args)
    from kvmesh.store.demo import PAGES, run_demo

    if args.page_kib:
        page_bytes = args.page_kib << 10
    else:  # one page_first KV page of the model geometry below: 1 MiB by default
        page_bytes = args.layers * 2 * args.page_tokens * args.kv_heads * args.head_dim * 2
    return run_demo(pages=args.pages or PAGES, page_bytes=page_bytes, rounds=args.rounds)


def cmd_keys(args: argparse.Namespace) -> int:
    """Print the credential of ``role`` (and ``id``), derived from the cluster secret."""
    from kvmesh.net.identity import CLIENT, issue
    from kvmesh.net.security import SecurityConfig

    try:
        sec = SecurityConfig.from_env()
        if sec.token is None:
            raise ValueError("set KVMESH_TOKEN or KVMESH_TOKEN_FILE to the cluster secret")
        if (args.role == CLIENT) != (args.id is None):
            raise ValueError("give an id for node and replica credentials, none for client")
        print(issue(sec.token, args.role, args.id or ""))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvmesh", description="kvmesh: a prefix KV cache as a system resource"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="transports, host id, NIXL presence")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--probe-nixl", action="store_true", help="import NIXL to check it is usable (~0.5 s)"
    )
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser(
        "demo", help="KV pages through the store (default) or the transfer engine alone"
    )
    p.add_argument(
        "which",
        nargs="?",
        choices=["store", "transfer"],
        default="store",
        help="store: embedded store, two worker processes; transfer: engine only",
    )
    p.add_argument(
        "--pages", type=int, default=0, help="pages per batch (default: store 256, transfer 128)"
    )
    p.add_argument("--slots", type=int, default=0, help="pool slots (default 2 x pages)")
    # A KV page of a small model (Llama-3.2-1B) in SGLang's page_first layout: 1 MiB.
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after a warm-up one)")
    p.add_argument("--transports", default="auto", help="comma list of shm,nixl,tcp (default: all)")
    p.add_argument(
        "--page-kib",
        type=int,
        default=0,
        help="store demo: page size in KiB (default: one KV page of the geometry above)",
    )
    p.set_defaults(fn=_demo)
    from kvmesh.store.cli import register as register_store

    register_store(sub)  # master, node, up, status
    p = sub.add_parser(
        "keys",
        help="print a credential derived from the cluster secret (KVMESH_TOKEN[_FILE])",
        description="Print the credential a client, storage node ID or replica ID gets "
        "instead of the cluster secret (give it as KVMESH_CREDENTIAL or KVMESH_CREDENTIAL_FILE;"
        " docs/net.md, 'Identity').",
    )
    p.add_argument("role", choices=["client", "node", "replica"])
    p.add_argument("id", nargs="?", default=None, help="the node or replica id")
    p.set_defaults(fn=cmd_keys)
    p = sub.add_parser("_demo-peer")
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--page-bytes", type=int, required=True)
    p.set_defaults(fn=_demo_peer)
    args, rest = ap.parse_known_args(argv)
    if getattr(args, "passthrough", False):  # kvmesh master: its own parser takes the rest
        args.rest = rest
    elif rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
