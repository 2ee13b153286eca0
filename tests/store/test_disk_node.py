"""``kvmesh node --disk PATH --disk-size SIZE``: the node registers a disk segment on its engine
(kvmesh/transfer/disk.py) before it mounts anything; its file keeps its bytes over a restart.
Real processes: a master, the node, and this process reading and writing the disk segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np

from kvmesh.replog.net.server import free_ports
from kvmesh.transfer import EngineConfig, Op, TransferEngine, TransportKind

from .test_e2e_cli import _kvmesh, _line


def test_node_refuses_an_unusable_disk_path_at_start(tmp_path):
    (tmp_path / "afile").write_bytes(b"x")
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_TOKEN"}
    for bad in (str(tmp_path / "afile" / "seg"), "/dev/null"):
        # No master is listening: the disk is checked before anything is mounted.
        p = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "node", "--master", "127.0.0.1:9"]
            + ["--disk", bad, "--disk-size", "1MiB"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert p.returncode == 2, p.stderr
        assert "kvmesh node: error: disk path" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_node_disk_segment_reachable_and_kept_over_a_restart(tmp_path):
    port, mport = free_ports(2)
    addr = f"127.0.0.1:{port}"
    m = _kvmesh(
        "master", "--listen", addr, "--dir", str(tmp_path / "m"), "--metrics-port", str(mport)
    )
    disk = tmp_path / "node.seg"
    nodes = []
    eng = TransferEngine(config=EngineConfig())
    try:
        _line(m, "READY")
        data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
        local = eng.register(data.copy())
        for round_ in range(2):
            n = _kvmesh(
                "node",
                "--master",
                addr,
                "--size",
                "8MiB",
                "--disk",
                str(disk),
                "--disk-size",
                "16MiB",
            )
            nodes.append(n)
            ready = _line(n, "READY node").split()
            engine_addr = ready[ready.index("engine") + 1]
            seg_name = ready[ready.index("disk") + 1]
            assert seg_name.endswith(".disk") and "16777216 bytes" in " ".join(ready)
            rs = eng.open_segment(engine_addr, seg_name)
            assert rs.kind.value == "disk" and rs.size == 16 << 20
            if round_ == 0:
                res = eng.transfer(
                    Op.WRITE, local, [0, 4096], rs, [12345, 8 << 20], [4096, 500_000]
                )
                assert res.transports == [TransportKind.TCP]
                eng.sync_segment(rs)
            back = eng.register(np.zeros(1 << 20, np.uint8))
            eng.transfer(Op.READ, back, [0, 4096], rs, [12345, 8 << 20], [4096, 500_000])
            got = back.array()
            assert (got[:4096] == data[:4096]).all()
            assert (got[4096 : 4096 + 500_000] == data[4096 : 4096 + 500_000]).all()
            eng.unregister(back)
            n.send_signal(signal.SIGTERM)
            assert n.wait(20) == 0
        assert os.path.getsize(disk) == 16 << 20
    finally:
        eng.close()
        for p in [*nodes, m]:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
