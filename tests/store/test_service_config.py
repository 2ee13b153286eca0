"""The master's command line is derived from ServiceConfig: no default is written twice, and
every scalar field has a flag that reaches the config."""

from __future__ import annotations

import msgspec

from kvmesh.store.config import ServiceConfig, build_arg_parser, config_from_args
from kvmesh.store.leader import LeaderConfig


def test_no_flags_give_the_structs_defaults() -> None:
    cfg = config_from_args(build_arg_parser().parse_args([]))
    assert cfg == ServiceConfig(listen="127.0.0.1:7700")


def test_every_scalar_field_has_a_flag_that_reaches_the_config() -> None:
    base = ServiceConfig()
    skip = {"node_id", "peers", "addrs", "listen", "data_dir", "session_limits", "durability"}
    argv: list[str] = ["--durability", "memory"]
    want: dict[str, object] = {"durability": "memory"}
    for f in msgspec.structs.fields(ServiceConfig):
        if f.name in skip:
            continue
        v = getattr(base, f.name)
        if f.name == "tick_s":
            argv += ["--tick-ms", "250"]
            want[f.name] = 0.25
        elif type(v) is bool:
            argv.append(("--no-" if v else "--") + f.name.replace("_", "-"))
            want[f.name] = not v
        elif type(v) in (int, float):
            # a valid value other than the default (fractions stay inside (0, 1])
            nv = (
                v / 2 if type(v) is float and 0 < v <= 1 else (v + 1 if type(v) is int else v + 0.5)
            )
            argv += ["--" + f.name.replace("_", "-"), str(nv)]
            want[f.name] = nv
    argv += ["--max-sessions", "7", "--max-session-result-bytes", "12345"]
    cfg = config_from_args(build_arg_parser().parse_args(argv))
    for name, v in want.items():
        assert getattr(cfg, name) == v, name
    assert cfg.session_limits.max_sessions == 7
    assert cfg.session_limits.max_result_bytes == 12345


def test_the_leader_policy_defaults_live_in_leader_config() -> None:
    lc, sc = LeaderConfig(), ServiceConfig()
    assert sc.leader_config() == lc
    for name in LeaderConfig.__struct_fields__:
        assert getattr(sc, name) == getattr(lc, name), name
