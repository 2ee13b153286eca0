"""Soak (``-m slow``): many leader kills and pauses under load on real processes, then the
whole history must be linearizable and the replicas identical.

    KVMESH_SOAK_KILLS=100 .venv/bin/python -m pytest tests/replog/test_process_soak.py -m slow -s
"""

import asyncio
import os
import random

import pytest

from kvmesh.replog.net.server import LocalCluster

from .test_process import ARGS, TICK_MS, Load, converge, find_leader, run


@pytest.mark.slow
def test_soak_repeated_leader_kills_and_pauses(tmp_path):
    kills = int(os.environ.get("KVMESH_SOAK_KILLS", "20"))
    rng = random.Random(int(os.environ.get("KVMESH_SOAK_SEED", "7")))

    async def main():
        c = LocalCluster(str(tmp_path), 3, tick_ms=TICK_MS, election_ticks=10, extra_args=ARGS)
        try:
            c.start_all()
            load = Load(c, clients=6, seed=rng.randrange(1 << 30))
            load.start()
            try:
                for _ in range(kills):
                    await asyncio.sleep(rng.uniform(0.5, 2.0))
                    victim = await find_leader(c, timeout=30)
                    if rng.random() < 0.25:
                        c.pause(victim)
                        await asyncio.sleep(rng.uniform(1.0, 2.5))
                        c.resume(victim)
                    else:
                        c.kill(victim)
                        await asyncio.sleep(rng.uniform(0.2, 1.5))
                        c.start(victim)
                await asyncio.sleep(1.0)
            finally:
                await load.finish()
            final = await load.final_reads()
            load.verify(final)
            await converge(c, timeout=60)
        finally:
            c.close()

    run(main(), timeout=60 + kills * 15)
