"""A process that floods the store master with requests for a while (liveness tests).

``python -m tests.store.flood_peer MASTER SECONDS THREADS`` (token from ``E2E_STORE_TOKEN``):
each thread loops until SECONDS have passed over three kinds of master work -- exists of
8,192 missing keys (decode and a table probe per key), replica lookups of 512 missing
keys, and 256-key PutStart + PutRevoke pairs (two log entries, allocation and free) --
then the process prints one JSON line with the requests done and exits. No bytes move.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> int:
    from kvmesh.net.security import SecurityConfig
    from kvmesh.store import protocol as P
    from kvmesh.store.rpc import MasterClient
    from kvmesh.store.types import ReplicateConfig

    master, seconds, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    rpc = MasterClient(
        master.split(","), SecurityConfig(token=os.environ.get("E2E_STORE_TOKEN")), timeout=30
    )
    cfg = ReplicateConfig(replica_num=1)
    done = [0] * threads
    errors: list[str] = []
    end = time.monotonic() + seconds

    def flood(t: int) -> None:
        n = 0
        try:
            while time.monotonic() < end:
                n += 1
                miss = [f"flood-{t}-{n}-{i}" for i in range(8192)]
                rpc.call(lambda rid, k=miss: P.ExistsReq(rid, k))
                rpc.call(lambda rid, k=miss[:512]: P.GetReplicasReq(rid, k))
                keys = miss[:256]
                r = rpc.mutate(
                    lambda rid, s, k=keys: P.PutStartReq(rid, s, k, [4096] * len(k), cfg)
                )
                ok = [k for k, c in zip(keys, getattr(r, "codes", [])) if c == 0]
                vers = list(getattr(r, "versions", []) or [])
                if ok and len(vers) == len(keys):
                    v = [x for x, c in zip(vers, r.codes) if c == 0]
                    rpc.mutate(lambda rid, s, k=ok, v=v: P.PutRevokeReq(rid, s, k, v))
                done[t] += 3
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(e).__name__}: {e}"[:300])

    ts = [threading.Thread(target=flood, args=(t,), daemon=True) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(seconds + 60)
    rpc.close()
    print(json.dumps({"requests": sum(done), "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
