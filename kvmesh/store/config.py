"""The store master's configuration (:class:`ServiceConfig`) and its command line.

The leader's policy fields take their defaults from :class:`~kvmesh.store.leader.LeaderConfig`,
and the ``kvmesh master`` flags are derived from the struct's fields (name, type, default),
so each default is written once.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec

from ..net.addr import parse_peers
from ..replog import (
    RaftConfig,
    ReadOnlyOption,
    SessionLimits,
)
from .leader import LeaderConfig
from .types import (
    MAX_BATCH_KEYS,
)

__all__ = [
    "ServiceConfig",
    "add_struct_flags",
    "build_arg_parser",
    "config_from_args",
    "raft_config",
]

log = logging.getLogger(__name__)


_LD = LeaderConfig()  # the leader policy's defaults (each lives once, in leader.py)


class ServiceConfig(msgspec.Struct, kw_only=True, frozen=True):
    """One master replica (driver settings; the replicated core has its own
    :class:`~kvmesh.store.master.state.MasterConfig`).

    ``peers``: raft address of every replica (this one included); ``addrs``: store RPC
    address of every replica (the ones clients and redirects use). A single replica needs
    neither: ``ServiceConfig(listen="127.0.0.1:0", durability="memory")``.
    """

    node_id: int = 1
    peers: dict[int, str] = {}
    addrs: dict[int, str] = {}
    listen: str | None = None  # default: addrs[node_id]
    data_dir: str | None = None
    durability: Literal["disk", "memory"] = "disk"
    tick_s: float = 0.05
    election_ticks: int = 10
    lease_reads: bool = True  # read barrier from the raft leader lease when it holds one
    snapshot_threshold: int = 50_000
    # a graceful stop snapshots first, so the next start restores the image instead of
    # replaying the log since the last snapshot (a batch entry holds thousands of keys)
    snapshot_on_stop: bool = True
    # also snapshot after this many keys applied since the last one (a restart after a
    # crash replays at most about that many keys; snapshot_threshold counts entries)
    snapshot_keys: int = 500_000
    # ...and at least this fraction of the objects the table holds: a snapshot costs time in
    # proportion to the table, so a big table is not re-imaged every snapshot_keys keys,
    # and a crash replays at most that fraction of it on top of the restore
    snapshot_fraction: float = 0.1
    # ...and at most this share of the time in snapshots by keys: the next one starts no
    # sooner than (1 - share) / share x the last one's duration after it ended (a 10 M
    # table's image takes 8-18 s; a bulk load would otherwise snapshot back to back)
    snapshot_max_share: float = 0.5
    session_ttl_s: float = 3600.0  # client sessions idle this long are expired (log entry)
    # live client sessions (a registration beyond it ends the least recently used one) and
    # the bounds on their cached unacknowledged results (kvmesh.replog.session)
    session_limits: SessionLimits = SessionLimits()
    # store policy (leader soft state and ticker: leader.LeaderConfig says what each does)
    lease_ttl_s: float = _LD.lease_ttl_s
    put_timeout_s: float = _LD.put_timeout_s
    node_ttl_s: float = _LD.node_ttl_s
    # Node liveness is judged over time the leader could hear (master/liveness.py).
    node_suspect_s: float = _LD.node_suspect_s
    liveness_max_gap_s: float = _LD.liveness_max_gap_s
    expire_max_fraction: float = _LD.expire_max_fraction
    ticker_s: float = _LD.ticker_s
    high_watermark: float = _LD.high_watermark
    evict_ratio: float = _LD.evict_ratio
    # new keys of a put beyond max_objects answer NoSpace
    max_objects: int = _LD.max_objects
    demote_timeout_s: float = _LD.demote_timeout_s  # the disk tier (leader.LeaderConfig)
    demote_watermark: float = _LD.demote_watermark
    demote_batch_bytes: int = _LD.demote_batch_bytes
    demote_inflight_bytes: int = _LD.demote_inflight_bytes
    disk_offline_ttl_s: float = _LD.disk_offline_ttl_s
    promote_hits: int = _LD.promote_hits
    write_through: bool = _LD.write_through
    # server limits
    max_frame: int = 8 << 20
    max_batch_keys: int = _LD.max_batch_keys
    max_connections: int = 1024
    max_unauthenticated: int = 64
    max_unauthenticated_per_source: int = 32  # of those, from one address (IPv6: one /64)
    max_inflight: int = 64
    # replica descriptors of one GetReplicas reply (later keys answer InvalidParams)
    max_reply_bytes: int = 8 << 20
    # mounted segments in the pool (placement scans them on every put); more are refused
    max_segments: int = 1024
    # keys one remove-by-prefix round removes at most (one log entry; the client loops)
    prefix_round_keys: int = 8192
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 600.0
    request_timeout_s: float = 10.0
    metrics_port: int = 0  # serve Prometheus metrics on 127.0.0.1:PORT (0: off)

    def __post_init__(self) -> None:
        self.leader_config()  # its checks
        if not self.snapshot_fraction >= 0 or self.snapshot_keys < 0:
            raise ValueError("snapshot_fraction and snapshot_keys must be >= 0")
        if not 0 < self.snapshot_max_share <= 1:
            raise ValueError("snapshot_max_share must be in (0, 1]")
        if not 0 < self.prefix_round_keys <= MAX_BATCH_KEYS:
            raise ValueError(f"prefix_round_keys must be in 1..{MAX_BATCH_KEYS}")
        if not 0 < self.max_batch_keys <= MAX_BATCH_KEYS or self.max_frame < 4096:
            raise ValueError(
                f"max_batch_keys must be in 1..{MAX_BATCH_KEYS} and max_frame at least 4096"
            )

    def leader_config(self) -> LeaderConfig:
        """The leader's policy: the fields of :class:`LeaderConfig`, by name."""
        return LeaderConfig(**{f: getattr(self, f) for f in LeaderConfig.__struct_fields__})


def raft_config(cfg: ServiceConfig) -> RaftConfig:
    return RaftConfig(
        election_tick=cfg.election_ticks,
        # Timeouts in [1, 1.5) election timeouts, not [1, 2): with the pre-vote tie-break
        # (replog core) a tie costs no second round, and the narrower spread keeps the write
        # pause after a leader kill under 1 s (docs/replog.md, failover).
        max_election_tick=cfg.election_ticks + max(1, cfg.election_ticks // 2),
        heartbeat_tick=1,
        check_quorum=True,
        read_only_option=ReadOnlyOption.LEASE_BASED if cfg.lease_reads else ReadOnlyOption.SAFE,
        max_committed_size_per_ready=8 << 20,
    )


_FLAG_HELP = {
    "node_suspect_s": "a node silent for the TTL is expired after this much more heard time"
    " (0: TTL/2)",
    "liveness_max_gap_s": "a longer gap between the leader's own observations is a stall, not"
    " silence (0: min(TTL/4, 1 s))",
    "expire_max_fraction": "fraction of the nodes and of their bytes one expiry round may drop",
    "max_objects": "objects in the master at most (0: no cap); eviction starts at the high"
    " watermark of it, new keys beyond it answer NoSpace",
    "max_inflight": "requests in flight per connection (reading pauses at the limit)",
    "request_timeout_s": "longest proposal or read, and the time a begun request frame has to"
    " arrive",
    "max_segments": "mounted segments at most",
    "prefix_round_keys": "keys one remove-by-prefix round (one log entry) removes at most",
    "metrics_port": "Prometheus metrics on 127.0.0.1:PORT",
    "snapshot_keys": "snapshot after this many keys applied (bounds the log replayed after a"
    " crash)",
    "snapshot_fraction": "...and after keys applied of at least this fraction of the objects"
    " held (a big table is not re-imaged constantly)",
    "snapshot_max_share": "...and at most this share of the time in snapshots (the next waits"
    " (1 - share) / share x the last one's duration)",
}
# Fields with a flag of their own shape (below), or none.
_SPECIAL = {"node_id", "peers", "addrs", "listen", "data_dir", "tick_s", "session_limits"}


def _flag_fields() -> list[msgspec.structs.FieldInfo]:
    """The scalar fields of ServiceConfig that get a ``--name-with-dashes`` flag."""
    out = []
    for f in msgspec.structs.fields(ServiceConfig):
        if f.name in _SPECIAL:
            continue
        if f.type in (int, float, bool) or getattr(f.type, "__origin__", None) is Literal:
            out.append(f)
    return out


def add_struct_flags(
    p: Any,
    fields: list[msgspec.structs.FieldInfo],
    helps: dict[str, str] | None = None,
    types: dict[str, Any] | None = None,
) -> None:
    """A ``--name-with-dashes`` flag per struct field, its type and default the field's, so
    that each default is written once, in the struct: bools ``--x/--no-x``, Literals their
    values, ``X | None`` an optional X. ``types``: a field's parser instead of its type
    (sizes written as ``1GiB``)."""
    import argparse

    helps, types = helps or {}, types or {}
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"default": f.default, "help": helps.get(f.name)}
        t = f.type
        if getattr(t, "__args__", None) and type(None) in t.__args__:  # X | None
            t = next(a for a in t.__args__ if a is not type(None))
        if t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif getattr(t, "__origin__", None) is Literal:  # its values, of their own type
            values = list(t.__args__)
            p.add_argument(flag, choices=values, type=type(values[0]), **kw)
        else:
            p.add_argument(flag, type=types.get(f.name, t), **kw)


def build_arg_parser() -> Any:
    import argparse

    d = ServiceConfig()
    p = argparse.ArgumentParser(
        prog="kvmesh master", description="one replica of the store master group"
    )
    p.add_argument("--id", type=int, default=d.node_id)
    p.add_argument("--peers", default="", help="ID=HOST:PORT,... raft addresses of all replicas")
    p.add_argument(
        "--addrs", default="", help="ID=HOST:PORT,... store RPC addresses of all replicas"
    )
    p.add_argument(
        "--listen",
        default=None,
        help="store RPC address (default: this id in --addrs, else 127.0.0.1:7700)",
    )
    p.add_argument("--dir", default=None, help="data directory (needed with --durability disk)")
    p.add_argument("--tick-ms", type=float, default=d.tick_s * 1000.0)
    add_struct_flags(p, _flag_fields(), _FLAG_HELP)
    p.add_argument(
        "--max-sessions",
        type=int,
        default=d.session_limits.max_sessions,
        help="live client sessions at most (the least recently used is ended beyond it)",
    )
    p.add_argument(
        "--max-session-result-bytes",
        type=int,
        default=d.session_limits.max_result_bytes,
        help="cached unacknowledged result bytes per session",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def config_from_args(a: Any) -> ServiceConfig:
    return ServiceConfig(
        node_id=a.id,
        peers=parse_peers(a.peers) if a.peers else {},
        addrs=parse_peers(a.addrs) if a.addrs else {},
        listen=a.listen or (None if a.addrs else "127.0.0.1:7700"),
        data_dir=a.dir,
        tick_s=a.tick_ms / 1000.0,
        session_limits=msgspec.structs.replace(
            SessionLimits(),
            max_sessions=a.max_sessions,
            max_result_bytes=a.max_session_result_bytes,
        ),
        **{f.name: getattr(a, f.name) for f in _flag_fields()},
    )
