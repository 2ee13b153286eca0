"""Each command-line default lives once: ``kvmesh master``, ``kvmesh node`` and ``kvmesh up``
parse to exactly their config structs' defaults, and those structs take the defaults they
share with an API (the storage node's, the master's) from there."""

from __future__ import annotations

import argparse
import inspect

import msgspec
import pytest

from kvmesh.store import cli
from kvmesh.store.config import ServiceConfig, build_arg_parser, config_from_args
from kvmesh.store.node import StorageNode


def _parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvmesh")
    cli.register(ap.add_subparsers(dest="cmd", required=True))
    return ap.parse_args(list(argv))


@pytest.mark.parametrize(
    "cls,argv",
    [(cli.NodeOptions, ["node", "--master", "127.0.0.1:1"]), (cli.UpOptions, ["up"])],
)
def test_flags_default_to_their_struct(cls, argv):
    args = _parse(*argv)
    assert cli.options(cls, args) == cls()
    for f in msgspec.structs.fields(cls):  # every field has its flag
        assert f.name in vars(args), f.name


def test_shared_defaults_come_from_the_api_and_the_master():
    node, up, sc = cli.NodeOptions(), cli.UpOptions(), ServiceConfig()
    sig = inspect.signature
    assert node.heartbeat_s == sig(StorageNode.__init__).parameters["heartbeat_s"].default
    assert node.grace_s == sig(StorageNode.close).parameters["grace_s"].default
    assert node.lease_s == sc.lease_ttl_s
    assert up.durability == sc.durability
    assert up.tick_ms == sc.tick_s * 1000.0


def test_master_flags_default_to_service_config():
    assert config_from_args(build_arg_parser().parse_args([])) == ServiceConfig(
        listen="127.0.0.1:7700"  # the one default of the command line alone
    )


def test_flags_parse_their_types():
    o = cli.options(
        cli.NodeOptions,
        _parse("node", "--master", "m:1", "--size", "2MiB", "--disk-size", "1GiB"),
    )
    assert (o.size, o.disk_size) == (2 << 20, 1 << 30)
    assert cli.options(cli.UpOptions, _parse("up", "--replicas", "5")).replicas == 5
    with pytest.raises(SystemExit):
        _parse("up", "--replicas", "2")
