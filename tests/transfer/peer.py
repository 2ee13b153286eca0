"""A peer engine process for multi-process tests: ``python -m tests.transfer.peer [options]``.

Prints one JSON line with its address, then answers JSON-line commands on stdin
(``sha``, ``fill``, ``expose``, ``tensor_sha``, ``read_from``, ``write_to``, ``unpublish``,
``unregister``, ``exit``). Every answer is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from kvmesh.transfer import EngineConfig, Op, TransferEngine

from .util import pattern, sha


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--kind", choices=["shm", "dram"], default="shm")
    ap.add_argument("--name", default="pool")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--host-id")
    ap.add_argument("--transport")
    ap.add_argument("--disable", default="")
    ap.add_argument("--token")
    ap.add_argument("--node-id", default="peer")
    ap.add_argument("--listen", default=None)
    ap.add_argument("--stderr", help="send this process's stderr (its log) to this file")
    args = ap.parse_args()
    if args.stderr:
        fd = os.open(args.stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.close(fd)

    cfg = EngineConfig.from_env(
        node_id=args.node_id,
        listen=args.listen,
        host_id=args.host_id,
        transport=args.transport,
        token=args.token,
        transports_disable=[k for k in args.disable.split(",") if k] or None,
    )
    eng = TransferEngine(config=cfg)
    if args.kind == "shm":
        region = eng.alloc_shared(args.size, name=args.name)
        pool = region.array()[: args.size]
    else:
        pool = np.empty(args.size, dtype=np.uint8)
        region = eng.register(pool, name=args.name)
    pool[:] = pattern(args.seed, 0, args.size)
    tensors: dict[str, object] = {}
    out = sys.stdout

    def say(**kw: object) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    say(address=eng.address, node_id=eng.node_id, pid=os.getpid(), host_id=eng.host_id,
        transports=[k.value for k in eng.transports])
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "exit":
                eng.close()
                say(ok=True)
                return
            if cmd == "sha":
                say(sha=sha(pool[msg["offset"] : msg["offset"] + msg["length"]]))
            elif cmd == "fill":
                pool[:] = pattern(msg["seed"], 0, args.size)
                say(ok=True)
            elif cmd == "expose":
                import torch

                t = torch.arange(msg["numel"], dtype=getattr(torch, msg["dtype"])).reshape(msg["shape"])
                t.mul_(msg.get("scale", 1))
                tensors[msg["name"]] = t
                eng.expose_tensor(msg["name"], t)
                say(ok=True)
            elif cmd == "tensor_sha":
                t = tensors[msg["name"]]
                say(sha=sha(t.numpy().view(np.uint8)))  # type: ignore[attr-defined]
            elif cmd in ("read_from", "write_to"):
                seg = eng.open_segment(msg["address"], msg["name"])
                op = Op.READ if cmd == "read_from" else Op.WRITE
                res = eng.transfer(op, region, [msg["local"]], seg, [msg["remote"]], [msg["length"]])
                say(ok=True, transports=[k.value for k in res.transports])
            elif cmd == "unpublish":
                eng.unpublish(msg["name"])
                say(ok=True)
            elif cmd == "unregister":  # the pool region, while peers may be using it
                t0 = time.monotonic()
                eng.unregister(region, timeout=msg["wait"])
                say(ok=True, elapsed=time.monotonic() - t0)
            else:
                say(error=f"unknown command {cmd!r}")
        except Exception as exc:  # reported to the test, which decides
            say(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
