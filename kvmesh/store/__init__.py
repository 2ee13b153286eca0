"""kvmesh.store: a distributed KV object store on kvmesh.replog (metadata) and
kvmesh.transfer (bytes). See docs/store.md.

* :class:`StoreClient` (also ``kvmesh.StoreClient``): the synchronous, batch-first client;
  ``StoreClient()`` with no address runs an embedded single-host store (:func:`embedded`);
* :mod:`.errors`: one error tree with wire codes; :mod:`.types`: shared value types;
* :mod:`.master`: the pure, deterministic master core; :mod:`.service`: a master replica
  process; :mod:`.node`: the storage-node role; :mod:`.protocol`: the client RPC.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["StoreClient", "BatchResults", "embedded", "ReplicateConfig", "parse_size", "errors"]


def embedded(**kwargs: Any) -> Any:
    """A :class:`StoreClient` on this process's embedded master (started on first use, see
    :mod:`.embedded_master`) that contributes a local segment: ``StoreClient(None, ...)``."""
    from .client import StoreClient

    return StoreClient(None, **kwargs)


def __getattr__(name: str) -> Any:
    # Lazy: importing kvmesh.store (e.g. for its errors) must not start the transfer engine
    # machinery or pull in the asyncio service.
    if name in ("StoreClient", "BatchResults"):
        from . import client

        return getattr(client, name)
    if name == "errors":  # (not "from . import errors": that asks this function again)
        return importlib.import_module(".errors", __name__)
    if name in ("ReplicateConfig", "parse_size"):
        from . import types

        return getattr(types, name)
    raise AttributeError(f"module 'kvmesh.store' has no attribute {name!r}")
