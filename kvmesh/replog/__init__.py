"""kvmesh.replog: the Raft-replicated log behind the store master's metadata.

The package's face: other layers import from here (its ``__all__``), not from the modules.
Module map and contracts: docs/replog.md. In short:

* :mod:`.types` - the contract: entries, messages, Ready, storage/state-machine protocols;
  :mod:`.errors` - every exception, with wire codes;
* :class:`RaftCore` (:mod:`.core`) - the sans-I/O protocol core;
* :class:`MemoryStorage` (:mod:`.storage.memory`); :class:`DiskStorage`
  (:mod:`.storage.disk`) - WAL (:mod:`.storage.wal`) + snapshot files
  (:mod:`.storage.snapfile`, whose :func:`pack_chunk` / :func:`iter_chunks` also frame the
  inside of state-machine snapshots);
* :class:`RaftNode` (:mod:`.node`) - the asyncio driver (timers, TCP transport
  :mod:`.net.transport`, group-commit fsync, proposals resolved after apply, read-index,
  snapshots) over the one Ready path (:mod:`.readypath`), with exactly-once client sessions
  (:class:`SessionStateMachine`, :mod:`.session`);
* :class:`ReplicaServer` / ``python -m kvmesh.replog`` (:mod:`.net.server`) - a replica
  process with a client endpoint (:mod:`.net.protocol`); :class:`ReplogClient` /
  :class:`KvClient` (:mod:`.net.client`) - leader-finding, retrying clients; both ports
  authenticate with :mod:`kvmesh.net`;
* :mod:`.sim.linearizability` - the Porcupine-style history checker (:func:`check`);
  :mod:`.sim` - the deterministic simulator.
"""

from .core.raft import RaftCore
from .errors import (
    ERROR_CODES,
    BadRequest,
    Overloaded,
    ResultEvicted,
    SessionDenied,
    Unauthorized,
)
from .kvsm import KvBatch, KvCas, KvDelete, KvGet, KvPut, KvStateMachine
from .net.client import ClusterUnavailable, KvClient, ReplogClient
from .net.server import LocalCluster, ReplicaServer, ServerLimits
from .node import (
    CommandError,
    LeaderChange,
    NodeConfig,
    NodeStopped,
    NotLeaderError,
    ProposalLost,
    ProposalTimeout,
    RaftNode,
    ReadTimeout,
    SessionExpiredError,
)
from .session import SessionLimits, SessionRejected, SessionStateMachine, SessionTracker
from .sim.linearizability import UNKNOWN, History, KvModel, KvOp, Operation, check
from .storage.disk import DiskStorage, StorageCorruptionError, StorageLockedError
from .storage.memory import MemoryStorage
from .storage.snapfile import SnapshotCorruptionError, iter_chunks, pack_chunk
from .storage.wal import WalCorruptionError, WalFatalError
from .types import (
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    EntryKind,
    HardState,
    LogStorage,
    NotLeader,
    ProposalDropped,
    ProposalTooLarge,
    RaftConfig,
    ReadOnlyOption,
    ReplogError,
    Role,
    Snapshot,
    SnapshotMeta,
    StateMachine,
)

__all__ = [
    "RaftCore",
    "RaftConfig",
    "ReadOnlyOption",
    "Entry",
    "EntryKind",
    "Role",
    "HardState",
    "ConfState",
    "ConfChange",
    "ConfChangeType",
    "Snapshot",
    "SnapshotMeta",
    "LogStorage",
    "StateMachine",
    "MemoryStorage",
    "DiskStorage",
    "RaftNode",
    "NodeConfig",
    "LeaderChange",
    "SessionStateMachine",
    "SessionTracker",
    "KvStateMachine",
    "KvGet",
    "KvPut",
    "KvDelete",
    "KvCas",
    "KvBatch",
    "ReplicaServer",
    "ServerLimits",
    "LocalCluster",
    "ReplogClient",
    "KvClient",
    "History",
    "Operation",
    "KvModel",
    "KvOp",
    "check",
    "UNKNOWN",
    "ReplogError",
    "ERROR_CODES",
    "BadRequest",
    "Overloaded",
    "SessionDenied",
    "ResultEvicted",
    "SessionLimits",
    "SessionRejected",
    "Unauthorized",
    "NotLeader",
    "NotLeaderError",
    "ProposalDropped",
    "ProposalTooLarge",
    "ProposalLost",
    "ProposalTimeout",
    "ReadTimeout",
    "NodeStopped",
    "SessionExpiredError",
    "CommandError",
    "ClusterUnavailable",
    "StorageCorruptionError",
    "StorageLockedError",
    "WalCorruptionError",
    "WalFatalError",
    "SnapshotCorruptionError",
    "pack_chunk",
    "iter_chunks",
]
