"""A store client process for the end-to-end tests, driven by JSON lines on stdin.

``python -m tests.store.store_peer MASTER SEGMENT_BYTES`` (master token from ``E2E_STORE_TOKEN``)
prints ``{"ready": ...}`` then answers one JSON line per command:

* ``{"op": "put", "keys": [...], "sizes": [...]}`` -> ``{"codes": [...], "transports": [...]}``
* ``{"op": "get", "keys": [...]}`` -> ``{"codes": [...], "sha": [...]}``
* ``{"op": "put_start_only", "keys": [...], "sizes": [...]}`` -> allocate, never finish
* ``{"op": "unmount", "grace": G}`` -> unmount this process's segment with a grace period
* ``{"op": "exit"}``

Values are derived from the key (:func:`value_of`) so any process can verify them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def value_of(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    reps = size // len(seed) + 1
    return (seed * reps)[:size]


def main() -> int:
    from kvmesh.store import StoreClient

    master, seg = sys.argv[1], int(sys.argv[2])
    client = StoreClient(
        master,
        segment_size=seg or None,
        token=os.environ.get("E2E_STORE_TOKEN"),
        heartbeat_s=float(os.environ.get("E2E_HEARTBEAT_S", "2.0")),
    )
    print(json.dumps({"ready": client.engine.address, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "put":
            keys, sizes = cmd["keys"], cmd["sizes"]
            res = client.put(keys, [value_of(k, s) for k, s in zip(keys, sizes)])
            out = {"codes": res.codes, "transports": res.transports}
        elif op == "get":
            res = client.get(cmd["keys"])
            out = {
                "codes": res.codes,
                "transports": res.transports,
                "sha": [
                    hashlib.sha256(r).hexdigest() if isinstance(r, bytes) else None for r in res
                ],
            }
        elif op == "put_start_only":
            # A writer that allocates and then vanishes before put_end (the test kills us).
            from kvmesh.store import protocol as P

            keys, sizes = cmd["keys"], cmd["sizes"]
            r = client.rpc.mutate(
                lambda rid, s, k=keys, z=sizes: P.PutStartReq(rid, s, k, z, client.config)
            )
            out = {"codes": list(r.codes)}
        elif op == "unmount":
            # What StorageNode.close(grace_s) sends, without freeing the memory: the node's
            # own peer identity is the only one the master accepts for its segment.
            from kvmesh.store import protocol as P

            sn = client.node
            assert sn is not None
            nid, seg, grace = sn.node_id, sn.segment, cmd["grace"]
            r = client.rpc.mutate(
                lambda rid, s, n=nid, g=seg, t=grace: P.UnmountReq(rid, s, n, g, t)
            )
            out = {"codes": list(getattr(r, "codes", [getattr(r, "code", -1)]))}
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
