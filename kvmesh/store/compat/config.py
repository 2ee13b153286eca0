"""``setup``'s arguments as Mooncake reads them: the positional form, the config-dict form
(every value turned into a ``str`` and parsed, as Mooncake's binding does), and Mooncake's
size syntax (``try_string_to_byte_size`` in Mooncake's ``utils.h``): a number, optionally
fractional, then ``B``/``K``/``KB``/``M``/``MB``/``G``/``GB``/``T``/``TB`` (any case, spaces
allowed, binary multiples), or ``infinite``. Anything else (``"50%"``) is an invalid value:
``setup`` answers -600, never raises."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

__all__ = ["Setup", "from_dict", "from_positional", "parse_mooncake_size"]

_MB16 = 16 << 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20}
_UNITS.update({"G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40})
_NUM = re.compile(r"[+]?(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
_U64_MAX = (1 << 64) - 1


def parse_mooncake_size(text: str) -> int | None:
    """Bytes for a Mooncake size string, or None when Mooncake would refuse it."""
    s = text.strip()
    if not s:
        return None
    if s == "infinite":
        return _U64_MAX
    m = _NUM.match(s)
    if m is None:
        return None
    unit = s[m.end() :].lstrip().upper()
    if unit not in _UNITS:
        return None
    try:
        return min(int(float(m.group(1)) * _UNITS[unit]), _U64_MAX)
    except (OverflowError, ValueError):
        return None


class Setup(NamedTuple):
    """What a store is set up with (Mooncake's names). ``error``: a non-zero code when a
    value was invalid (setup then answers it)."""

    local_hostname: str = "localhost"
    metadata_server: str = ""
    global_segment_size: int = _MB16
    local_buffer_size: int = _MB16
    protocol: str = "tcp"
    rdma_devices: str = ""
    master_server_addr: str = "127.0.0.1:50051"
    engine: Any = None
    tenant_id: str = "default"
    extra: dict[str, str] = {}
    error: int = 0


_POSITIONAL = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "engine",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
)
_TYPES: dict[str, Any] = {
    "local_hostname": str,
    "metadata_server": str,
    "global_segment_size": int,
    "local_buffer_size": int,
    "protocol": str,
    "rdma_devices": str,
    "master_server_addr": str,
    "enable_ssd_offload": bool,
    "ssd_offload_path": str,
    "tenant_id": str,
    "enable_client_http_server": bool,
    "client_http_port": int,
}


def from_positional(args: tuple, kwargs: dict[str, Any]) -> Setup:
    """Mooncake's positional ``setup``: the first seven are required, each of its type; a
    call that does not fit raises ``TypeError`` (pybind11 finds no overload)."""
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"setup() takes at most {len(_POSITIONAL)} arguments ({len(args)} given)")
    got = dict(zip(_POSITIONAL, args))
    for k, v in kwargs.items():
        if k not in _POSITIONAL:
            raise TypeError(f"setup() got an unexpected keyword argument {k!r}")
        if k in got:
            raise TypeError(f"setup() got multiple values for argument {k!r}")
        got[k] = v
    missing = [k for k in _POSITIONAL[:7] if k not in got]
    if missing:
        raise TypeError(
            "setup(): incompatible arguments; call setup(local_hostname, metadata_server, "
            "global_segment_size, local_buffer_size, protocol, rdma_devices, "
            f"master_server_addr, ...) or setup(config: dict) (missing {', '.join(missing)})"
        )
    for k, v in got.items():
        t = _TYPES.get(k)
        if t is None:
            continue
        ok = type(v) is bool if t is bool else isinstance(v, t) and type(v) is not bool
        if t is int and ok and v < 0:
            raise TypeError(f"setup(): {k} must be a non-negative int, got {v!r}")
        if not ok:
            raise TypeError(f"setup(): {k} must be {t.__name__}, got {type(v).__name__}")
    return Setup(
        local_hostname=got["local_hostname"],
        metadata_server=got["metadata_server"],
        global_segment_size=got["global_segment_size"],
        local_buffer_size=got["local_buffer_size"],
        protocol=got["protocol"],
        rdma_devices=got["rdma_devices"],
        master_server_addr=got["master_server_addr"],
        engine=got.get("engine"),
        tenant_id=got.get("tenant_id", "default"),
    )


def from_dict(config: dict) -> Setup:
    """Mooncake's ``setup(config: dict)``: every key and value as ``str`` (``str(v)``, so
    ``16777216``, ``"16MB"`` and ``"16 MB"`` all work); ``master_server_address`` is read
    as ``master_server_addr`` (LMCache's and SGLang's spelling), ``device_name`` as
    ``rdma_devices``."""
    cfg = {str(k): str(v) for k, v in config.items()}
    err = 0
    sizes = {}
    for k in ("global_segment_size", "local_buffer_size"):
        if k in cfg:
            v = parse_mooncake_size(cfg[k])
            if v is None:
                err = -600
                v = 0
            sizes[k] = v
        else:
            sizes[k] = _MB16
    if "local_hostname" not in cfg or "metadata_server" not in cfg:
        err = err or -600  # Mooncake: both required
    master = cfg.get("master_server_addr", cfg.get("master_server_address", "127.0.0.1:50051"))
    known = {"local_hostname", "metadata_server", "protocol", "rdma_devices", "device_name"}
    known |= {"master_server_addr", "master_server_address", "tenant_id", *sizes}
    return Setup(
        local_hostname=cfg.get("local_hostname", "localhost"),
        metadata_server=cfg.get("metadata_server", ""),
        global_segment_size=sizes["global_segment_size"],
        local_buffer_size=sizes["local_buffer_size"],
        protocol=cfg.get("protocol", "tcp"),
        rdma_devices=cfg.get("rdma_devices", cfg.get("device_name", "")),
        master_server_addr=master,
        tenant_id=cfg.get("tenant_id", "default"),
        extra={k: v for k, v in cfg.items() if k not in known},
        error=err,
    )
