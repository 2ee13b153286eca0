"""EngineConfig (env parsing, transport filters) and wire types."""

import msgspec
import pytest

from kvmesh.transfer import (
    EngineConfig,
    InvalidArgument,
    MemoryKind,
    SegmentDescriptor,
    TransportKind,
)
from kvmesh.transfer import protocol as P


def test_from_env_parses_every_kind_of_field():
    env = {
        "KVMESH_NODE_ID": "n1",
        "KVMESH_LISTEN": "127.0.0.1:7000",
        "KVMESH_HOST_ID": "h1",
        "KVMESH_TOKEN": "secret",
        "KVMESH_TRANSPORTS_DISABLE": "SHM, nixl",
        "KVMESH_TRANSFER_TIMEOUT": "2.5",
        "KVMESH_WORKERS": "3",
        "KVMESH_TCP_KEEPALIVE": "false",
        "KVMESH_NIXL": "ucx_devices=lo,num_workers=2",
        "UNRELATED": "x",
    }
    cfg = EngineConfig.from_env(env)
    assert cfg.node_id == "n1" and cfg.listen == "127.0.0.1:7000" and cfg.host_id == "h1"
    assert cfg.token == "secret"
    assert cfg.transports_disable == [TransportKind.SHM, TransportKind.NIXL]
    assert cfg.transfer_timeout == 2.5 and cfg.workers == 3 and cfg.tcp_keepalive is False
    assert cfg.nixl == {"ucx_devices": "lo", "num_workers": "2"}
    assert not cfg.transport_enabled(TransportKind.SHM)
    assert cfg.transport_enabled(TransportKind.TCP)


def test_forced_transport_and_allow_list():
    cfg = EngineConfig.from_env({"KVMESH_TRANSPORT": "TCP"})
    assert cfg.transport is TransportKind.TCP
    assert [k for k in TransportKind if cfg.transport_enabled(k)] == [TransportKind.TCP]
    cfg = EngineConfig.from_env({"KVMESH_TRANSPORTS_ALLOW": "local,shm"})
    assert [k for k in TransportKind if cfg.transport_enabled(k)] == [
        TransportKind.LOCAL,
        TransportKind.SHM,
    ]


def test_overrides_win_over_env_and_none_is_ignored():
    cfg = EngineConfig.from_env({"KVMESH_WORKERS": "3", "KVMESH_TOKEN": "a"}, workers=5, token=None)
    assert cfg.workers == 5 and cfg.token == "a"


def test_plain_constructor_accepts_strings_for_enums():
    cfg = EngineConfig(transport="tcp", transports_disable=["shm"])
    assert cfg.transport is TransportKind.TCP
    assert cfg.transports_disable == [TransportKind.SHM]


@pytest.mark.parametrize(
    "env",
    [
        {"KVMESH_TRANSPORT": "carrier-pigeon"},
        {"KVMESH_WORKERS": "many"},
        {"KVMESH_TRANSPORTS_DISABLE": "shm,bogus"},
    ],
)
def test_bad_configuration_is_refused_clearly(env):
    with pytest.raises(InvalidArgument):
        EngineConfig.from_env(env)


def test_zero_workers_refused():
    with pytest.raises(InvalidArgument, match="workers"):
        EngineConfig(workers=0)


def test_descriptor_and_messages_roundtrip_msgpack():
    desc = SegmentDescriptor(
        name="pool",
        seg_id=7,
        node_id="n",
        host_id="h",
        engine_id="e",
        pid=1,
        region_id=2,
        kind=MemoryKind.SHM,
        base=0x7F0000000000,
        size=1 << 30,
        control="127.0.0.1:1",
        shm_name="kvmesh-1-ab",
        shm_offset=4096,
        shm_size=(1 << 30) + 4096,
        cuda_ipc=b"\x01" * 64,
        meta={"dtype": "float16"},
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(desc), type=SegmentDescriptor) == desc
    frame = P.encode(P.SegmentInfo(desc))
    assert int.from_bytes(frame[:4], "little") == len(frame) - 4
    assert P._decoder.decode(frame[4:]) == P.SegmentInfo(desc)


def test_server_limits_from_env_and_validated(tmp_path):
    env = {
        "KVMESH_MAX_CONNECTIONS": "10",
        "KVMESH_MAX_UNAUTHENTICATED": "3",
        "KVMESH_REQUEST_TIMEOUT": "1.5",
        "KVMESH_IDLE_TIMEOUT": "30",
        "KVMESH_MAX_REQUEST_PIECES": "100",
        "KVMESH_MAX_REQUEST_BYTES": "4096",
        "KVMESH_ALLOW_INSECURE": "1",
    }
    cfg = EngineConfig.from_env(env)
    assert (
        cfg.max_connections,
        cfg.max_unauthenticated,
        cfg.request_timeout,
        cfg.idle_timeout,
        cfg.max_request_pieces,
        cfg.max_request_bytes,
        cfg.allow_insecure,
    ) == (10, 3, 1.5, 30.0, 100, 4096, True)
    for bad in (
        {"max_connections": 0},
        {"max_request_bytes": 0},
        {"request_timeout": 0},
        {"idle_timeout": -1.0},
    ):
        with pytest.raises(InvalidArgument):
            EngineConfig(**bad)


def test_token_file_and_insecure_bind(tmp_path):
    from kvmesh.net import InsecureBind
    from kvmesh.transfer import TransferEngine
    from kvmesh.transfer.control import security_of

    f = tmp_path / "token"
    f.write_text("from-a-file\n")
    assert security_of(EngineConfig(token_file=str(f))).token == "from-a-file"
    with pytest.raises(InvalidArgument):
        security_of(EngineConfig(token="x", token_file=str(f)))
    # A wildcard listener authenticates nobody without a token: refused unless allowed.
    with pytest.raises(InsecureBind):
        TransferEngine(config=EngineConfig(listen="0.0.0.0:0"))
    for cfg in (
        EngineConfig(listen="0.0.0.0:0", token_file=str(f)),
        EngineConfig(listen="0.0.0.0:0", allow_insecure=True),
    ):
        TransferEngine(config=cfg).close()
