"""The store's ``kvmesh`` subcommands (registered by :mod:`kvmesh.cli`).

``kvmesh master``  one replica of the master group (``kvmesh master --help``)
``kvmesh node``    a storage node: contributes a shared-memory segment until stopped
``kvmesh up``      a local cluster in the foreground: 3 master replicas + 1 storage node
``kvmesh status``  members, leader, term, segments, usage, objects, leases, hit rate
``kvmesh remove-prefix``  remove every object whose key starts with a prefix

Tokens come from ``KVMESH_TOKEN`` / ``KVMESH_TOKEN_FILE`` (never from the command line). On
loopback addresses no token is required.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from typing import Any, Literal

import msgspec

from .config import ServiceConfig, add_struct_flags
from .types import parse_size

__all__ = ["NodeOptions", "UpOptions", "parse_size", "register"]  # parse_size: CLI users'


def _default(fn: Any, name: str) -> Any:
    """Parameter ``name``'s default in ``fn``'s signature: a default the CLI shares with an
    API stays written there, once."""
    import inspect

    return inspect.signature(fn).parameters[name].default


def _node_defaults() -> tuple[float, float]:
    from .node import StorageNode

    return _default(StorageNode.__init__, "heartbeat_s"), _default(StorageNode.close, "grace_s")


_SC = ServiceConfig()
_HEARTBEAT_S, _GRACE_S = _node_defaults()


class NodeOptions(msgspec.Struct, kw_only=True, frozen=True):
    """``kvmesh node``'s settings (its flags are derived from these fields). Defaults of
    the storage node's API and of the master are taken from there."""

    size: int = 1 << 30  # the segment
    heartbeat_s: float = _HEARTBEAT_S
    disk: str | None = None
    disk_size: int | None = None
    disk_direct: Literal["auto", "on", "off"] = "auto"
    grace_s: float = _GRACE_S
    lease_s: float = _SC.lease_ttl_s  # the masters' lease TTL, waited out after the grace
    log_level: str = "WARNING"


class UpOptions(msgspec.Struct, kw_only=True, frozen=True):
    """``kvmesh up``'s settings (its flags are derived from these fields); the masters'
    own defaults are :class:`~kvmesh.store.config.ServiceConfig`'s."""

    replicas: Literal[1, 3, 5] = 3
    segment: int = 256 << 20  # the storage node's segment
    dir: str | None = None
    durability: Literal["disk", "memory"] = _SC.durability
    tick_ms: float = _SC.tick_s * 1000.0


_NODE_HELP = {
    "size": "segment size (e.g. 1GiB)",
    "disk": "also a disk segment: a file or a directory on a local filesystem",
    "disk_size": "size of the disk segment (e.g. 64GiB)",
    "disk_direct": "O_DIRECT for the disk segment: where the filesystem allows (auto),"
    " required, never",
    "grace_s": "on stop: keep copies readable this long",
    "lease_s": "the masters' lease TTL (with --grace-s)",
}
_UP_HELP = {"dir": "data directory (default: a new temporary one)"}
_SIZES = {"size": parse_size, "disk_size": parse_size, "segment": parse_size}


def options(cls: type, args: argparse.Namespace) -> Any:
    """The ``cls`` settings parsed into ``args``."""
    return cls(**{f: getattr(args, f) for f in cls.__struct_fields__})


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


# ----------------------------------------------------------------------------- master


def cmd_master(args: argparse.Namespace) -> int:
    from .service import main as master_main

    return master_main(args.rest)


# ------------------------------------------------------------------------------- node


def cmd_node(args: argparse.Namespace) -> int:
    from ..net.security import SecurityConfig
    from ..transfer import TransferError, init_engine
    from .node import StorageNode
    from .rpc import MasterClient

    o = options(NodeOptions, args)
    logging.basicConfig(
        level=getattr(logging, o.log_level.upper(), logging.WARNING), stream=sys.stderr
    )
    sec = SecurityConfig.from_env()
    # A node credential (kvmesh keys node ID) names the node: its engine runs as that id.
    who = sec.identity
    engine = init_engine(node_id=who[1] if who is not None and who[0] == "node" else None)
    rpc = MasterClient(
        [a for a in args.master.split(",") if a], sec, name="store-node", node_id=engine.node_id
    )
    if (o.disk is None) != (o.disk_size is None):
        print("kvmesh node: error: --disk and --disk-size go together", file=sys.stderr)
        return 2
    direct = {"auto": None, "on": True, "off": False}[o.disk_direct]
    node = StorageNode(
        rpc,
        o.size,
        engine=engine,
        heartbeat_s=o.heartbeat_s,
        disk=o.disk,
        disk_size=o.disk_size,
        disk_direct=direct,
    )
    try:
        node.start()
    # an unusable --disk path, or a --size /dev/shm has no room for: the engine says why
    except (TransferError, OSError) as exc:
        print(f"kvmesh node: error: {exc}", file=sys.stderr)
        rpc.close()
        return 2
    disk = ""
    if node.disk is not None:
        mode = "O_DIRECT" if node.disk.direct else "buffered"
        disk = f" disk {node.disk_segment} ({o.disk_size} bytes, {mode})"
    print(
        f"READY node {node.node_id} segment {node.segment} ({o.size} bytes) "
        f"engine {node.engine.address}{disk}",
        flush=True,
    )
    try:
        _wait_for_signal()
    finally:
        node.close(grace_s=o.grace_s, lease_s=o.lease_s)
        rpc.close()
    return 0


# --------------------------------------------------------------------------------- up


def cmd_up(args: argparse.Namespace) -> int:
    from .cluster import StoreCluster
    from .node import StorageNode
    from .rpc import MasterClient

    o = options(UpOptions, args)
    base = o.dir or tempfile.mkdtemp(prefix="kvmesh-up-")
    token = os.environ.get("KVMESH_TOKEN")
    cl = StoreCluster(base, o.replicas, token=token, durability=o.durability, tick_ms=o.tick_ms)
    print(f"starting {o.replicas} master replicas (data in {base}) ...", flush=True)
    node = None
    rpc = None
    try:
        cl.start_all()
        from ..transfer import get_engine

        engine = get_engine()
        rpc = MasterClient(list(cl.addrs.values()), name="kvmesh-up", node_id=engine.node_id)
        node = StorageNode(rpc, o.segment, engine=engine).start()
        print(f"masters   {cl.address}")
        print(f"node      {node.node_id}: segment {node.segment} of {o.segment} bytes")
        print(f"use it:   StoreClient({cl.address!r})   or   kvmesh status --master {cl.address}")
        if token:
            from ..net.identity import issue

            # What applications get instead of the secret (docs/net.md, "Identity").
            print(f"clients:  KVMESH_CREDENTIAL={issue(token, 'client')}")
        print("Ctrl-C stops the cluster.", flush=True)
        _wait_for_signal()
        print("stopping ...", flush=True)
    finally:
        if node is not None:
            node.close()
        if rpc is not None:
            rpc.close()
        cl.close()
    return 0


# ----------------------------------------------------------------------------- status


def gather_status(addrs: list[str], timeout: float = 3.0) -> dict[str, Any]:
    """Status of every reachable replica plus the leader's view of the pool."""
    from .rpc import MasterClient

    rpc = MasterClient(addrs, name="kvmesh-status", timeout=timeout)
    members: list[dict[str, Any]] = []
    leader: dict[str, Any] | None = None
    try:
        for a in addrs:
            try:
                st = rpc.status(a, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a down replica is a row, not a failure
                members.append({"address": a, "role": "DOWN", "error": str(e)[:200]})
                continue
            members.append(st)
            if st.get("role") == "LEADER":
                leader = st
    finally:
        rpc.close()
    return {"members": members, "leader": leader}


def cmd_status(args: argparse.Namespace) -> int:
    addrs = [a for a in args.master.split(",") if a]
    out = gather_status(addrs)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0 if out["leader"] else 1
    print(f"{'replica':<8}{'address':<24}{'role':<11}{'term':>6}{'commit':>10}{'applied':>10}")
    for m in out["members"]:
        print(
            f"{m.get('node_id', '?')!s:<8}{m.get('address', '')!s:<24}{m.get('role', '?')!s:<11}"
            f"{m.get('term', '')!s:>6}{m.get('commit', '')!s:>10}{m.get('applied', '')!s:>10}"
        )
    ld = out["leader"]
    if ld is None:
        print("no leader reachable")
        return 1
    u = ld["usage"]
    cap = u.get("capacity", 0) or 0
    ratio = (u.get("used", 0) / cap) if cap else 0.0
    reads = ld["hits"] + ld["misses"]
    print(
        f"\nleader {ld['node_id']} (term {ld['term']}): {ld['objects']} objects "
        f"({u.get('complete', 0)} complete, {u.get('processing', 0)} in flight), "
        f"{u.get('used', 0)}/{cap} bytes used ({ratio:.1%}), {ld['leases']} live leases, "
        f"hit rate {ld['hits'] / reads if reads else 0.0:.1%} of {reads} reads"
    )
    n_obj, cap_obj = ld["objects"], ld.get("max_objects", 0)
    rss = ld.get("rss_bytes", 0)
    print(
        f"objects {n_obj}"
        + (f" of at most {cap_obj} ({n_obj / cap_obj:.1%})" if cap_obj else " (no cap)")
        + f", {u.get('used', 0) // n_obj if n_obj else 0} bytes of data per object;"
        f" master RSS {rss / (1 << 20):.1f} MiB"
        + (f" ({rss // n_obj} bytes per object)" if n_obj else "")
    )
    disk = (ld.get("media") or {}).get("disk") or {}
    if disk.get("capacity"):
        dcap = disk["capacity"]
        print(
            f"disk tier: {disk.get('used', 0)}/{dcap} bytes used ({disk.get('used', 0) / dcap:.1%})"
        )
    lv = ld.get("liveness") or {}
    if lv.get("suspect") or lv.get("stalls"):
        print(
            f"liveness: suspect nodes {lv.get('suspect', [])}, {lv.get('stalls', 0)} stalls"
            f" of this leader, {lv.get('expired', 0)} nodes expired"
        )
    print(f"\n{'segment':<40}{'node':<28}{'medium':<7}{'size':>14}{'used':>14}{'slices':>8}  state")
    for s in ld["segments"]:
        print(
            f"{s['name']:<40}{s['node_id']:<28}{s.get('medium', 'memory'):<7}{s['size']:>14}"
            f"{s['used']:>14}{s['objects']:>8}  {s['state']}"
        )
    return 0


def cmd_remove_prefix(args: argparse.Namespace) -> int:
    from . import errors as E
    from .client import StoreClient

    try:
        c = StoreClient(args.master, segment_size=0, timeout=args.timeout)
    except E.StoreError as e:
        print(f"kvmesh remove-prefix: {e}", file=sys.stderr)
        return 1
    try:
        n = c.remove_prefix(args.prefix, force=args.force)
    except E.StoreError as e:
        print(f"kvmesh remove-prefix: {e}", file=sys.stderr)
        return 1
    finally:
        c.close()
    if args.json:
        print(json.dumps({"removed": int(n), "skipped": n.skipped}))
    else:
        left = f" ({n.skipped} left: leased or being written; --force removes leased ones)"
        print(f"removed {int(n)} objects under {args.prefix!r}" + (left if n.skipped else ""))
    return 0


# --------------------------------------------------------------------------- register


def register(sub: Any) -> None:
    """Add the store subcommands to ``kvmesh``'s subparsers."""
    p = sub.add_parser("master", help="run one replica of the store master group", add_help=False)
    p.set_defaults(fn=cmd_master, passthrough=True, rest=[])  # kvmesh.cli passes the rest

    p = sub.add_parser("node", help="contribute a shared-memory segment to a store")
    p.add_argument(
        "--master", required=True, help="store addresses of the master replicas, comma-separated"
    )
    add_struct_flags(p, list(msgspec.structs.fields(NodeOptions)), _NODE_HELP, _SIZES)
    p.set_defaults(fn=cmd_node)

    p = sub.add_parser(
        "up", help="local store in the foreground: 3 master replicas + 1 storage node"
    )
    add_struct_flags(p, list(msgspec.structs.fields(UpOptions)), _UP_HELP, _SIZES)
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("status", help="members, leader, segments, usage, objects, leases, hit rate")
    p.add_argument(
        "--master", required=True, help="store addresses of the master replicas, comma-separated"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser(
        "remove-prefix", help="remove every object whose key starts with PREFIX (not a pattern)"
    )
    p.add_argument("prefix")
    p.add_argument(
        "--master", required=True, help="store addresses of the master replicas, comma-separated"
    )
    p.add_argument("--force", action="store_true", help="remove objects readers hold leases on")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_remove_prefix)


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="kvmesh")
    register(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args()
    sys.exit(int(a.fn(a)))
