"""kvmesh.replog: Raft-replicated log for the store master's metadata (see docs/replog.md)."""
