"""Command line for the simulator.

    python -m kvmesh.replog.sim --seeds 5000            # soak: seeds 0..4999, all cores
    python -m kvmesh.replog.sim --seed 1234 -v          # replay one seed with its trace
    python -m kvmesh.replog.sim --seeds 200 --profile ci --start 10000

Exit status 1 if any seed violated an invariant (each failure prints its replay command).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator

from .cluster import SimResult
from .cluster import run_seed_args as _run


def iter_results(work: list[tuple[int, str, dict]], jobs: int) -> Iterator[SimResult]:
    """``run_seed_args`` of each of ``work``, over ``jobs`` processes (in their order of
    completion); in this process when there is one job or one seed."""
    if len(work) == 1 or jobs <= 1:
        yield from map(_run, work)
        return
    with mp.get_context("spawn").Pool(jobs) as pool:
        yield from pool.imap_unordered(_run, work, chunksize=4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.replog.sim", description=__doc__.split("\n")[0]
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--seed", type=int, help="run one seed")
    g.add_argument("--seeds", type=int, help="run this many seeds, starting at --start")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--profile", choices=("ci", "soak"), default="soak")
    p.add_argument("--durability", choices=("disk", "memory", "ack_before_fsync"), default=None)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", action="store_true", help="print one JSON object per seed")
    p.add_argument("-v", "--verbose", action="store_true", help="print the trace of failing seeds")
    a = p.parse_args(argv)
    overrides = {}
    if a.durability:
        overrides["durability"] = a.durability
    seeds = [a.seed] if a.seed is not None else list(range(a.start, a.start + a.seeds))
    t0 = time.perf_counter()
    work = [(s, a.profile, overrides) for s in seeds]
    results = iter_results(work, a.jobs)
    failed = []
    n = acked = ops = 0
    for r in results:
        n += 1
        acked += r.writes_acked
        ops += r.ops_ok
        if a.json:
            print(
                json.dumps({k: getattr(r, k) for k in r.__struct_fields__ if k != "trace"}),
                flush=True,
            )
        if not r.ok:
            failed.append(r)
            print(f"seed {r.seed}: VIOLATION {r.violation}: {r.detail[:2000]}", file=sys.stderr)
            print(f"  replay: {r.replay_hint()}", file=sys.stderr)
            if a.verbose:
                print("\n".join("  " + line for line in r.trace), file=sys.stderr)
        elif len(seeds) == 1:
            print(
                f"seed {r.seed}: ok ({r.ops_ok} ops ok, {r.ops_unknown} unknown, "
                f"{r.writes_acked} acked writes, "
                f"{r.elections} elections, {r.crashes} crashes, {r.snapshots} snapshots, "
                f"faults {r.faults}, "
                f"{r.virtual_s:.1f}s virtual in {r.wall_s:.2f}s)"
            )
        if n % 100 == 0 and len(seeds) > 1 and not a.json:
            print(
                f"... {n}/{len(seeds)} seeds, {len(failed)} failed, "
                f"{time.perf_counter() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    dt = time.perf_counter() - t0
    print(
        f"{n} seeds, {len(failed)} failed, {acked} acknowledged writes checked, {ops} ops ok, "
        f"{dt:.1f}s wall ({a.jobs} jobs)"
    )
    if failed:
        print(
            "failing seeds: " + " ".join(str(r.seed) for r in sorted(failed, key=lambda r: r.seed))
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
