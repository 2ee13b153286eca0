"""A robust wrapper around one NIXL agent with a UCX backend (engine-agnostic).

NIXL is optional: importing this package never imports NIXL; it is loaded on first use and
:func:`available` answers without raising when it is missing. One job per module:

=============  ===========================================================================
``loader``     finding and importing the NIXL package, its version, UCX's environment
``errmap``     NIXL exceptions -> kvmesh errors
``patch``      the progress-thread patch of NIXL's Python wrapper (``pthrDelay``)
``plan``       how a request becomes descriptors (pure numpy, no NIXL)
``prepped``    the cache of prepared descriptor lists
``xfer``       the lifecycle of one transfer handle
``agent``      :class:`NixlAgent`: registration, metadata, peers, transfers, notifications
``types``      :class:`NixlOptions`, :class:`NixlRegion`, :class:`RemoteRegion`
=============  ===========================================================================

The pitfalls handled and the measurements behind the choices: docs/nixl.md.
"""

from __future__ import annotations

from .agent import NixlAgent
from .loader import (
    available,
    has_rdma_devices,
    installed_reason,
    nixl_version,
    prepare_environment,
    unavailable_reason,
)
from .types import Kind, NixlOptions, NixlRegion, RemoteRegion
from .xfer import NixlXfer

__all__ = [
    "Kind",
    "NixlAgent",
    "NixlOptions",
    "NixlRegion",
    "NixlXfer",
    "RemoteRegion",
    "available",
    "has_rdma_devices",
    "installed_reason",
    "nixl_version",
    "prepare_environment",
    "unavailable_reason",
]
