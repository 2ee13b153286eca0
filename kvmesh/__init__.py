"""kvmesh: a prefix KV cache as a system resource.

Layers (see docs/architecture.md):
  kvmesh.transfer  segments, registered memory, batched READ/WRITE, per-segment transports
  kvmesh.replog    sans-I/O Raft core, durable log, asyncio driver (the master's metadata)
  kvmesh.store     objects, replicas, leases on top of both (kvmesh.StoreClient)
"""

__version__ = "0.1.0"
__all__ = ["StoreClient", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy export
    if name == "StoreClient":
        from .store.client import StoreClient

        return StoreClient
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
