"""A disk-segment owner for multi-process tests: ``python -m tests.transfer.disk_peer PATH SIZE``.

Registers a disk segment ``disk`` at PATH, prints one JSON line with its address, then
answers JSON-line commands on stdin (``syncs``: how many fdatasync calls it made,
``unregister``: give the segment back, ``exit``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvmesh.transfer import EngineConfig, TransferEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("size", type=int)
    ap.add_argument("--token")
    ap.add_argument("--durable", action="store_true")
    ap.add_argument("--file-bytes", type=int)
    args = ap.parse_args()
    syncs = [0]
    real = os.fdatasync

    def counted(fd: int) -> None:
        syncs[0] += 1
        real(fd)

    os.fdatasync = counted  # the durability test counts them
    eng = TransferEngine(config=EngineConfig(token=args.token, node_id="disk-owner"))
    seg = eng.register_disk(
        args.path, args.size, name="disk", durable=args.durable, file_bytes=args.file_bytes
    )

    def say(**kw: object) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    say(address=eng.address, pid=os.getpid(), direct=seg.direct)
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "syncs":
            say(syncs=syncs[0])
        elif cmd == "unregister":  # while peers may be using it
            eng.unregister(seg, timeout=10)
            say(ok=True)
        elif cmd == "exit":
            eng.close()
            say(ok=True)
            return
        else:
            say(error=f"unknown command {cmd!r}")


if __name__ == "__main__":
    main()
