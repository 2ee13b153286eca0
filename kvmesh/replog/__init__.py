"""kvmesh.replog: the Raft-replicated log behind the store master's metadata.

Layers (see docs/replog.md):

* :mod:`.types` - the contract: entries, messages, Ready, storage/state-machine protocols;
* :class:`RaftCore` - the sans-I/O protocol core; :class:`MemoryStorage`;
* :class:`DiskStorage` - WAL (:mod:`.wal`) + snapshot files (:mod:`.snapfile`);
* :class:`RaftNode` - the asyncio driver (timers, TCP transport, group-commit fsync,
  proposals resolved after apply, read-index, snapshots), with exactly-once client sessions
  (:class:`SessionStateMachine`);
* :class:`ReplicaServer` / ``python -m kvmesh.replog`` - a replica process with a client
  endpoint (:mod:`.protocol`); :class:`ReplogClient` / :class:`KvClient` - leader-finding,
  retrying clients; both ports authenticate with :mod:`kvmesh.net`;
* :mod:`.errors` - every exception, with wire codes;
* :mod:`.linearizability` - the Porcupine-style history checker used by the tests;
* :mod:`.sim` - the deterministic simulator.
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
from .session import SessionLimits, SessionStateMachine, SessionTracker
from .sim.linearizability import History, KvModel, KvOp, Operation, check
from .storage.disk import DiskStorage, StorageCorruptionError, StorageLockedError
from .storage.memory import MemoryStorage
from .storage.wal import WalCorruptionError, WalFatalError
from .types import (
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    HardState,
    LogStorage,
    NotLeader,
    ProposalDropped,
    RaftConfig,
    ReadOnlyOption,
    ReplogError,
    Snapshot,
    SnapshotMeta,
    StateMachine,
)

__all__ = [
    "RaftCore",
    "RaftConfig",
    "ReadOnlyOption",
    "Entry",
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
    "ReplogError",
    "ERROR_CODES",
    "BadRequest",
    "Overloaded",
    "SessionDenied",
    "ResultEvicted",
    "SessionLimits",
    "Unauthorized",
    "NotLeader",
    "NotLeaderError",
    "ProposalDropped",
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
]
