"""A peer engine process for multi-process tests: ``python -m tests.transfer.peer [options]``.

Prints one JSON line with its address, then answers JSON-line commands on stdin
(``sha``, ``fill``, ``expose``, ``tensor_sha``, ``read_from``, ``write_to``, ``unpublish``,
``unregister``, ``unregister_reuse``, ``forge``, ``exit``). Every answer is one JSON line on stdout.

``--kind`` picks the memory behind the pool segment: ``shm`` (``alloc_shared``), ``dram``
(private memory: NIXL/cma) or ``subrange`` (a range inside a shared buffer the driver owns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import msgspec
import numpy as np

from kvmesh.transfer import EngineConfig, Op, SharedBuffer, TransferEngine, TransferError

from .util import pattern, sha


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--kind", choices=["shm", "dram", "subrange"], default="shm")
    ap.add_argument("--name", default="pool")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--host-id")
    ap.add_argument("--transport")
    ap.add_argument("--disable", default="")
    ap.add_argument("--token")
    ap.add_argument("--node-id", default="peer")
    ap.add_argument("--listen", default=None)
    ap.add_argument(
        "--no-fence",
        action="store_true",
        help="act as a host whose /dev/shm refuses new files (no fence file)",
    )
    ap.add_argument("--stderr", help="send this process's stderr (its log) to this file")
    args = ap.parse_args()
    if args.stderr:
        fd = os.open(args.stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
    if args.no_fence:
        from kvmesh.transfer import shmfile

        def refuse(size: int) -> tuple[str, int]:
            raise PermissionError(13, "no new files in /dev/shm here (--no-fence)")

        shmfile.create = refuse

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
    elif args.kind == "subrange":
        whole = SharedBuffer.create(args.size + 2 * 4096)
        pool = whole.array()[4096 : 4096 + args.size]
        region = eng.register(pool, name=args.name)
    else:
        pool = np.empty(args.size, dtype=np.uint8)
        region = eng.register(pool, name=args.name)
    pool[:] = pattern(args.seed, 0, args.size)
    tensors: dict[str, object] = {}
    out = sys.stdout

    def say(**kw: object) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    say(
        address=eng.address,
        node_id=eng.node_id,
        pid=os.getpid(),
        host_id=eng.host_id,
        transports=[k.value for k in eng.transports],
    )
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

                t = torch.arange(msg["numel"], dtype=getattr(torch, msg["dtype"])).reshape(
                    msg["shape"]
                )
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
                res = eng.transfer(
                    op, region, [msg["local"]], seg, [msg["remote"]], [msg["length"]]
                )
                say(ok=True, transports=[k.value for k in res.transports])
            elif cmd == "unpublish":
                eng.unpublish(msg["name"])
                say(ok=True)
            elif cmd == "unregister_reuse":
                say(**unregister_reuse(eng, region, pool, args, msg))
            elif cmd == "forge":
                # A hostile owner: publish a descriptor whose fields lie (tests of the peer side).
                desc, reg = eng._table.lookup(msg["name"])
                forged = msgspec.structs.replace(desc, **msg["fields"])
                eng._table._by_name[msg["name"]] = (forged, reg)
                say(ok=True)
            elif cmd == "unregister":  # the pool region, while peers may be using it
                t0 = time.monotonic()
                eng.unregister(region, timeout=msg["wait"])
                say(ok=True, elapsed=time.monotonic() - t0)
            else:
                say(error=f"unknown command {cmd!r}")
        except Exception as exc:  # reported to the test, which decides
            say(error=f"{type(exc).__name__}: {exc}")


def unregister_reuse(eng: TransferEngine, region, pool: np.ndarray, args, msg: dict) -> dict:
    """Wait until a peer's WRITE lands, unregister the pool, reuse it at once, watch it.

    The pool is zeroed; a peer writes non-zero bytes from its start. Once they show up (so a
    WRITE is just beginning, with most of its bytes still to come) we unregister
    and then fill the memory with ``0x5A`` -- reusing it -- and count for ``watch`` seconds
    how many bytes still change: any is a write that landed after ``unregister`` returned.
    """
    view = pool
    if args.kind == "shm":  # unregister unmaps our buffer: keep a mapping of our own file
        view = SharedBuffer.attach(region.shm.name).array()[: args.size]
    view.fill(0)
    step = 1 << 20
    deadline = time.monotonic() + msg.get("wait", 30.0)
    while not view[step - 1]:  # a WRITE of the whole pool has just begun (1 MiB into it)
        if time.monotonic() > deadline:
            return {"unregister_error": "the peer's write never landed"}
        time.sleep(0.001)
    t0 = time.monotonic()
    err = None
    try:
        eng.unregister(region, timeout=msg.get("timeout", 10.0))
    except TransferError as exc:
        err = f"{type(exc).__name__}: {exc}"
    t1 = time.monotonic()
    view.fill(0x5A)
    changed = 0
    end = time.monotonic() + msg.get("watch", 1.0)
    while not changed and time.monotonic() < end:
        for off in range(0, args.size, 16 * step):
            changed += int(np.count_nonzero(view[off : off + 16 * step] != 0x5A))
    return {"t0": t0, "t1": t1, "changed": changed, "unregister_error": err}


if __name__ == "__main__":
    main()
