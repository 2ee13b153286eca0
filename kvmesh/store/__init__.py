"""kvmesh.store: a distributed KV object store (Mooncake Store semantics) on kvmesh.replog and
kvmesh.transfer. ``master/`` is the pure metadata core; the drivers live beside it."""
