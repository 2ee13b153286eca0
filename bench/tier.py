"""Disk tier: kvmesh disk-segment put/get next to the raw bandwidth of the same disk path.

Same run, same directory (``--dir``, default a temporary directory under /tmp):

* the ceiling: raw sequential and 4 KiB-aligned random read/write of a file there, with the
  syscalls the engine uses (``preadv``/``pwritev``; ``O_DIRECT`` where the filesystem takes
  it), from 1, ``KVMESH_WORKERS`` and 4 x that many threads (the engine runs a big batch's
  parts on its workers, each with ``DiskSegment.depth`` requests in flight), the best being
  the ceiling of that op and pattern (``disk_read_gbps``/``disk_write_gbps``: the best of all
  but cached reads);
* kvmesh: batches of 256 KiB and 4 MiB objects at random object slots of a disk segment,
  WRITE (put) and READ (get), in this process (``disk`` transport) and from another process
  through the owner (``tcp``: the owner reads or writes its file), each verified once.

The page cache: with ``O_DIRECT`` (``path`` "direct") both raw and kvmesh bypass it, so every
read comes from the device. ``--buffered`` adds the same cases without ``O_DIRECT``, read
twice: "cached" (pages in memory: a memory-speed figure) and "cold-ish" (the file's pages
dropped with ``POSIX_FADV_DONTNEED`` before each repetition; the device's own cache and the
host's below a VM are out of reach). Ratios ``ratio_disk`` are to the raw figure of the
same op, pattern and cache state.

With ``--nixl`` the same gets also go through NIXL's POSIX backend (file to memory of this
process; it reaches no peer), for comparison.

With ``--store`` the store's disk tier too (``_store_cases``): demotion throughput, gets of
disk-only objects, and a working set 4 x the memory segment with and without the tier (hit
rate, GB/s).

    python bench/tier.py [--quick] [--json PATH] [--dir DIR] [--file-mib N] [--buffered] [--nixl]
        [--store [--store-mem-mib N]]
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import _common as C
from kvmesh.transfer import EngineConfig, Op, TransferEngine
from kvmesh.transfer.disk import ALIGN

MiB = C.MiB
KiB = 1 << 10
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _options(ap: Any) -> None:
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--file-mib", type=int, help="size of the raw file and the disk segment")
    ap.add_argument("--objects", default="262144,4194304", help="object sizes in bytes")
    ap.add_argument("--batch-mib", type=int, help="bytes per batch, in MiB")
    ap.add_argument("--reps", type=int)
    ap.add_argument(
        "--store",
        action="store_true",
        help="also the store's disk tier: demotion, disk-only gets, a 4x working set",
    )
    ap.add_argument("--store-mem-mib", type=int, help="the node's memory segment (--store)")
    ap.add_argument(
        "--demote-watermark",
        type=float,
        default=0.0,
        help="the master's --demote-watermark (--store; 0: its default)",
    )
    ap.add_argument(
        "--threads", help="raw thread counts, comma-separated (default 1,W,4W: W the workers)"
    )
    ap.add_argument("--buffered", action="store_true", help="also without O_DIRECT")
    ap.add_argument("--no-owner", action="store_true", help="skip the through-the-owner cases")
    ap.add_argument("--tcp-mib", type=int)
    ap.add_argument(
        "--nixl", action="store_true", help="also NIXL's POSIX backend reading the same file"
    )
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--direct", default="auto")


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), np.uint8)


def _drop_cache(path: str) -> None:
    """Write back and drop the file's cached pages (cold-ish reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_ok(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | _O_DIRECT)
    except OSError:
        return False
    try:
        os.preadv(fd, [_aligned(ALIGN)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# --- the owner process ---------------------------------------------------------------------


def peer_main(path: str, size: int, direct: bool | None) -> None:
    eng = TransferEngine(config=EngineConfig.from_env(node_id=f"tier-owner-{os.getpid()}"))
    seg = eng.register_disk(path, size, name="disk", direct=direct)
    C.serve_json_lines(
        {"exit": eng.close},
        {"address": eng.address, "pid": os.getpid(), "direct": seg.direct},
    )


# --- raw ceiling ---------------------------------------------------------------------------


def _raw_pass(fd: int, buf: np.ndarray, offsets: list[int], block: int, write: bool, threads: int):
    def run(part: list[int], base: int) -> None:
        for i, off in enumerate(part):
            view = buf[(base + i) * block : (base + i + 1) * block]
            done = 0
            while done < block:
                v = view[done:] if done else view
                got = os.pwritev(fd, [v], off + done) if write else os.preadv(fd, [v], off + done)
                done += got

    if threads <= 1:
        run(offsets, 0)
        return
    per = -(-len(offsets) // threads)
    ts = [
        threading.Thread(target=run, args=(offsets[i : i + per], i))
        for i in range(0, len(offsets), per)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def raw_gbps(
    path: str,
    direct: bool,
    write: bool,
    block: int,
    offsets_for: Any,
    reps: int,
    threads: int,
    cold: bool,
) -> float:
    fd = os.open(path, os.O_RDWR | (_O_DIRECT if direct else 0))
    try:
        n = len(offsets_for(0))
        buf = _aligned(block * n)
        buf[:] = 0x5A
        rates = []
        for rep in range(reps + 1):  # one warm-up
            offs = offsets_for(rep)
            if cold:
                _drop_cache(path)
            t0 = time.perf_counter()
            _raw_pass(fd, buf, offs, block, write, threads)
            if write and not direct:
                os.fdatasync(fd)  # buffered writes: count reaching the device, as O_DIRECT does
            dt = time.perf_counter() - t0
            if rep:
                rates.append(block * n / dt / 1e9)
        return float(np.median(rates))
    finally:
        os.close(fd)


# --- the measuring process -----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = C.bench_args(__doc__.split("\n\n")[0], argv, _options)
    quick = args.quick
    file_bytes = (args.file_mib or (256 if quick else 2048)) * MiB
    if args.peer:
        direct = {"auto": None, "off": False, "on": True}[args.direct]
        peer_main(os.path.join(args.dir, "owner.seg"), file_bytes, direct)
        return 0
    t_start = time.monotonic()
    reps = args.reps or (3 if quick else 5)
    batch_bytes = (args.batch_mib or (32 if quick else 128)) * MiB
    batch_bytes = min(batch_bytes, file_bytes // 2)
    objects = [int(x) for x in args.objects.split(",") if x.strip()]
    threads = EngineConfig.from_env().workers
    raw_threads = (
        sorted({int(x) for x in args.threads.split(",") if x.strip()})
        if args.threads
        else sorted({1, threads, 4 * threads})
    )
    own_dir = args.dir is None
    work = tempfile.mkdtemp(prefix="kvmesh-tier-", dir="/tmp") if own_dir else args.dir
    raw_path = os.path.join(work, "raw.dat")
    seg_path = os.path.join(work, "local.seg")
    rng = np.random.default_rng(7)
    try:
        with open(raw_path, "wb") as f:
            f.truncate(file_bytes)
        direct = _direct_ok(raw_path)
        tcp_bytes = (args.tcp_mib or (128 if quick else 1024)) * MiB
        mem = C.copy_limits()
        limits: dict[str, Any] = dict(mem)
        if not args.no_owner:
            limits["tcp_gbps"] = round(
                C.tcp_gbps(tcp_bytes, 4 * MiB, min(reps, 3 if quick else 5)), 3
            )
        print(
            f"kvmesh tier bench ({'quick' if quick else 'full'}): {work} "
            f"({'O_DIRECT' if direct else 'no O_DIRECT: the page cache is in the way'}), "
            f"file {file_bytes // MiB} MiB, batches of {batch_bytes // MiB} MiB, {reps} reps, "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        paths = (["direct"] if direct else []) + (
            ["cached", "cold-ish"] if args.buffered or not direct else []
        )
        records: list[dict[str, Any]] = []
        raw: dict[tuple[str, str, str, int], float] = {}

        # Fill the raw file (unwritten extents read back as zeros without touching the device).
        _fill(raw_path, file_bytes)
        for path in paths:
            use_direct = path == "direct"
            cold = path == "cold-ish"
            for block in objects:
                n = max(1, batch_bytes // block)
                slots = file_bytes // block

                def seq(rep: int, n=n, block=block, slots=slots) -> list[int]:
                    start = (rep * n) % max(1, slots - n)
                    return [(start + i) * block for i in range(n)]

                def rand(rep: int, n=n, block=block) -> list[int]:
                    return (rng.integers(0, (file_bytes - block) // ALIGN, n) * ALIGN).tolist()

                for pattern, offs in (("seq", seq), ("rand4k", rand)):
                    for op in ("write", "read"):
                        if op == "write" and path == "cached":
                            continue  # writes are measured to the device: "cold-ish" has them
                        best = 0.0
                        for t in raw_threads:
                            g = raw_gbps(
                                raw_path, use_direct, op == "write", block, offs, reps, t, cold
                            )
                            records.append(
                                C.record(
                                    limits,
                                    "raw",
                                    "pwritev" if op == "write" else "preadv",
                                    op,
                                    block,
                                    n,
                                    g,
                                    g * 1e9 / block,
                                    path=path,
                                    pattern=pattern,
                                    threads=t,
                                )
                            )
                            best = max(best, g)
                        raw[(path, op, pattern, block)] = best
        # The device's ceiling: cached reads are memory copies, not the disk.
        read_keys = [v for k, v in raw.items() if k[1] == "read" and k[0] != "cached"]
        write_keys = [v for k, v in raw.items() if k[1] == "write"]
        limits["disk_read_gbps"] = round(max(read_keys), 3) if read_keys else None
        limits["disk_write_gbps"] = round(max(write_keys), 3) if write_keys else None

        # kvmesh: this process (disk transport), then through the owner (tcp).
        eng = TransferEngine(config=EngineConfig.from_env(node_id="tier-bench"))
        owner = None
        try:
            targets: list[tuple[str, Any, str]] = []
            for path in paths:
                seg_file = f"{seg_path}.{path}"
                eng.register_disk(seg_file, file_bytes, name=path, direct=path == "direct")
                targets.append(("same-process", eng.open_segment(eng.address, path), seg_file))
            if not args.no_owner:
                owner = C.Child(
                    [
                        sys.executable,
                        str(pathlib.Path(__file__).resolve()),
                        "--peer",
                        "--dir",
                        work,
                        "--file-mib",
                        str(file_bytes // MiB),
                        "--direct",
                        "auto" if direct else "off",
                    ],
                    env={"PYTHONPATH": C.ROOT},
                )
                rs = eng.open_segment(owner.info["address"], "disk")
                targets.append(("through-owner", rs, os.path.join(work, "owner.seg")))
            cap = max(batch_bytes, max(objects))
            src, dst = _aligned(cap), _aligned(cap)
            src[:] = rng.integers(0, 256, cap, dtype=np.uint8)
            ls, ld = eng.register(src), eng.register(dst)
            for case, rs, seg_file in targets:
                seg_paths = (
                    [rs.name]
                    if case == "same-process"
                    else (["direct"] if owner.info["direct"] else ["cached", "cold-ish"])
                )
                for path in seg_paths:
                    for block in objects:
                        records.extend(
                            _kvmesh_case(
                                eng,
                                case,
                                path,
                                rs,
                                seg_file,
                                ls,
                                ld,
                                src,
                                dst,
                                block,
                                batch_bytes,
                                file_bytes,
                                reps,
                                rng,
                                limits,
                                raw,
                            )
                        )
            if args.nixl:  # after the kvmesh cases: every slot of the files is written
                for path in paths:
                    for block in objects:
                        records.extend(
                            _nixl_posix(
                                f"{seg_path}.{path}",
                                path,
                                block,
                                batch_bytes,
                                file_bytes,
                                reps,
                                rng,
                                limits,
                                raw,
                            )
                        )
        finally:
            if owner is not None:
                owner.close()
            eng.close()
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for p in (raw_path, os.path.join(work, "owner.seg")):
                if os.path.exists(p):
                    os.unlink(p)
            for path in ("direct", "cached", "cold-ish"):
                if os.path.exists(f"{seg_path}.{path}"):
                    os.unlink(f"{seg_path}.{path}")

    if args.store:
        records.extend(_store_cases(args, limits))
    C.apply_ratios(records, limits)
    cols = (
        "case",
        "path",
        "transport",
        "op",
        "pattern",
        "page_bytes",
        "batch",
        "threads",
        "gbps",
        "ratio_disk",
        "ratio_memcpy",
        "ratio_tcp",
        "hit_rate",
    )
    print(
        f"limits: {C.copy_limits_text(limits)}, raw TCP {limits.get('tcp_gbps')} GB/s, "
        f"disk read {limits['disk_read_gbps']} GB/s, write {limits['disk_write_gbps']} GB/s"
    )
    C.print_table(records, cols)
    targets_met = _targets(records)
    elapsed = C.print_footer(records, targets_met, t_start)
    if args.json:
        C.write_json(
            args.json,
            "tier",
            limits,
            records,
            targets=targets_met,
            quick=quick,
            elapsed_s=round(elapsed, 1),
            o_direct=direct,
        )
    return 0


def _fill(path: str, size: int) -> None:
    buf = _aligned(4 * MiB)
    buf[:] = 0xA5
    fd = os.open(path, os.O_WRONLY)
    try:
        for off in range(0, size, 4 * MiB):
            os.pwritev(fd, [buf[: min(4 * MiB, size - off)]], off)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _kvmesh_case(
    eng,
    case,
    path,
    rs,
    seg_file,
    ls,
    ld,
    src,
    dst,
    block,
    batch_bytes,
    file_bytes,
    reps,
    rng,
    limits,
    raw,
) -> list[dict[str, Any]]:
    n = max(1, batch_bytes // block)
    slots = file_bytes // block
    lo = np.arange(n, dtype=np.int64) * block
    out = []
    # Write every slot once (gets must read written blocks, never unwritten extents).
    for first in range(0, slots, n):
        k = min(n, slots - first)
        eng.transfer(Op.WRITE, ls, lo[:k], rs, (np.arange(k) + first) * block, block)
    eng.sync_segment(rs)
    for op in ("put", "get"):
        if op == "put" and path == "cached":
            continue
        rates = []
        transport = None
        for rep in range(reps + 1):
            ro = rng.choice(slots, n, replace=False).astype(np.int64) * block
            if path == "cold-ish":
                _drop_cache(seg_file)
            t0 = time.perf_counter()
            if op == "put":
                res = eng.transfer(Op.WRITE, ls, lo, rs, ro, block)
                if path != "direct":
                    eng.sync_segment(rs)  # to the device, as raw buffered writes are timed
            else:
                res = eng.transfer(Op.READ, ld, lo, rs, ro, block)
            dt = time.perf_counter() - t0
            transport = res.transports[0].value
            if rep:
                rates.append(n * block / dt / 1e9)
        # Verified once, outside the timed loop: put then get of the same slots.
        ro = rng.choice(slots, n, replace=False).astype(np.int64) * block
        eng.transfer(Op.WRITE, ls, lo, rs, ro, block)
        dst[: n * block] = 0
        eng.transfer(Op.READ, ld, lo, rs, ro, block)
        verified = bool((dst[: n * block] == src[: n * block]).all())
        g = float(np.median(rates))
        ref = raw.get((path, "read" if op == "get" else "write", "rand4k", block))
        out.append(
            C.record(
                limits,
                case,
                transport,
                op,
                block,
                n,
                g,
                g * 1e9 / block,
                path=path,
                pattern="random slots",
                verified=verified,
                ratio_disk=None if not ref else round(g / ref, 3),
            )
        )
    return out


def _nixl_posix(
    seg_file, path, block, batch_bytes, file_bytes, reps, rng, limits, raw
) -> list[dict[str, Any]]:
    """READ of random slots of the same file through NIXL's POSIX backend (file -> DRAM in
    this process: it serves no peers), for the comparison docs/transfer.md reports."""
    from kvmesh.transfer.nixl import loader

    nx = loader.load()
    if nx is None:
        print(f"NIXL is not available: {loader.unavailable_reason()}")
        return []
    api = nx.api
    agent = api.nixl_agent(f"tier-posix-{os.getpid()}-{block}", api.nixl_agent_config(backends=[]))
    agent.create_backend("POSIX")
    n = max(1, batch_bytes // block)
    buf = _aligned(n * block)
    fd = os.open(seg_file, os.O_RDONLY | (_O_DIRECT if path == "direct" else 0))
    mem = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    files = agent.register_memory([(0, file_bytes, fd, "")], "FILE")
    local = agent.get_xfer_descs(
        [(buf.ctypes.data + i * block, block, 0) for i in range(n)], "DRAM"
    )
    try:
        rates, slots = [], file_bytes // block
        for rep in range(reps + 2):
            ro = rng.choice(slots, n, replace=False) * block
            fdescs = agent.get_xfer_descs([(int(o), block, fd) for o in ro], "FILE")
            h = agent.initialize_xfer("READ", local, fdescs, agent.name)
            if path == "cold-ish":
                _drop_cache(seg_file)
            t0 = time.perf_counter()
            state = agent.transfer(h)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(h)
            dt = time.perf_counter() - t0
            agent.release_xfer_handle(h)
            if state == "ERR":
                raise RuntimeError("NIXL POSIX transfer failed")
            if rep < reps + 1:
                if rep:
                    rates.append(n * block / dt / 1e9)
                continue
            with open(seg_file, "rb") as f:  # the last one, verified against the file
                verified = all(
                    f.seek(int(o)) >= 0
                    and f.read(block) == buf[i * block : (i + 1) * block].tobytes()
                    for i, o in enumerate(ro.tolist())
                )
        g = float(np.median(rates))
        ref = raw.get((path, "read", "rand4k", block))
        return [
            C.record(
                limits,
                "same-process",
                "nixl-posix",
                "get",
                block,
                n,
                g,
                g * 1e9 / block,
                path=path,
                pattern="random slots",
                verified=verified,
                ratio_disk=None if not ref else round(g / ref, 3),
            )
        ]
    finally:
        agent.deregister_memory(files)
        agent.deregister_memory(mem)
        os.close(fd)


def _store_cases(args: Any, limits: dict[str, Any]) -> list[dict[str, Any]]:
    """The store's disk tier (docs/store.md, "Disk tier"), real processes: a master and a
    ``kvmesh node`` with a memory segment of ``M`` and (or, for the baseline, without) a
    disk segment, this process the client. A writer puts a working set of 4 x M in batches
    of 256 KiB objects as fast as it can (puts that find no room make the master free the
    memory of demoted objects at once, or evict what is not demoted yet): the bytes that
    went to disk per second of the fill are demotion's throughput, and the hit rate below
    says whether demotion kept up. Then every key is read once (hit rate, GB/s), and the
    oldest objects (disk-only when demotion kept up) are read again as one 4 MiB batch for
    the GB/s of disk-tier gets. "paced": the writer waits after each batch until memory is
    back under its watermark (the pace the tier keeps up with, nothing dropped). Without
    the disk tier the fill evicts, so its hit rate is what fits in memory."""
    import subprocess

    from kvmesh.replog.net.server import free_ports
    from kvmesh.store import StoreClient

    mem = (args.store_mem_mib or (32 if args.quick else 256)) * MiB
    obj = 256 * KiB
    n = 4 * mem // obj
    out: list[dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="kvmesh-tier-store-", dir=args.dir or "/tmp")
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_TOKEN"}
    env["PYTHONPATH"] = C.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    try:
        for tier, paced in ((True, True), (True, False), (False, False)):
            port, mport = free_ports(2)
            addr = f"127.0.0.1:{port}"
            cli = [sys.executable, "-m", "kvmesh.cli"]
            m = subprocess.Popen(
                cli + ["master", "--listen", addr, "--dir", os.path.join(work, f"m{tier}{paced}"),
                       "--metrics-port", str(mport), "--ticker-s", "0.05",
                       "--evict-ratio", "0.25", "--durability", "memory"]
                + (["--demote-watermark", str(args.demote_watermark)] if args.demote_watermark
                   else []),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
            procs = [m]
            c = None
            try:
                _wait_line(m, "READY")
                node = cli + ["node", "--master", addr, "--size", str(mem), "--heartbeat-s", "0.05"]
                if tier:
                    node += [
                        "--disk",
                        os.path.join(work, f"tier{paced}.seg"),
                        "--disk-size",
                        str(6 * mem),
                    ]
                nd = subprocess.Popen(
                    node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
                )
                procs.append(nd)
                _wait_line(nd, "READY node")
                c = StoreClient(addr, timeout=30, segment_size=0)
                keys = [f"page-{i}" for i in range(n)]
                val = np.random.default_rng(3).integers(0, 256, obj, dtype=np.uint8).tobytes()
                batch = max(1, mem // obj // 8)
                t0 = time.perf_counter()
                refused = 0
                for lo in range(0, n, batch):
                    res = c.put(keys[lo : lo + batch], [val] * len(keys[lo : lo + batch]))
                    refused += sum(isinstance(r, Exception) for r in res)
                    while paced:
                        u = c.status()["media"]["memory"]
                        if u["used"] < 0.9 * u["capacity"]:
                            break
                        time.sleep(0.002)  # (the pacing poll: not a floor on the figure)
                fill = time.perf_counter() - t0
                st = c.status()
                disk_used = st["media"]["disk"]["used"]
                label = ("store+disk paced" if paced else "store+disk") if tier else "store, memory"
                if tier:
                    g = disk_used / fill / 1e9
                    ref = limits.get("disk_write_gbps")
                    out.append(
                        C.record(limits, label, "node", "demote", obj, batch, g, g * 1e9 / obj,
                                 ratio_disk=None if not ref else round(g / ref, 3))
                    )  # fmt: skip
                buf = np.zeros(n * obj, np.uint8)
                region = c.register_buffer(buf)
                t0 = time.perf_counter()
                got = c.get_into(keys, region, [i * obj for i in range(n)])
                dt = time.perf_counter() - t0
                hits = sum(1 for r in got if r == obj)
                ok = all(
                    buf[i * obj : (i + 1) * obj].tobytes() == val for i in range(n) if got[i] == obj
                )
                assert ok, "a hit returned other bytes"
                used = ",".join(c.last_transports) or None
                g = hits * obj / dt / 1e9
                out.append(
                    C.record(limits, label, used, "get 4x working set", obj, n, g, hits / dt,
                             hit_rate=round(hits / n, 3))
                )  # fmt: skip
                if tier:
                    # the oldest objects the 4x get read from disk: one batch of 16 x 256 KiB
                    # (4 MiB); none when a writer at full speed outran demotion and they were
                    # evicted instead -- then the row says so rather than 0 GB/s
                    media = got.media
                    old = [k for k, m in zip(keys, media) if m == "disk"][:16]
                    best: float | None = None
                    for _ in range(3 if old else 0):
                        t0 = time.perf_counter()
                        got = c.get_into(old, region, [i * obj for i in range(len(old))])
                        dt = time.perf_counter() - t0
                        if all(r == obj for r in got) and set(got.media) == {"disk"}:
                            best = max(best or 0.0, len(old) * obj / dt / 1e9)
                    note = None if old else "no object was read from disk"
                    rate = None if best is None else best * 1e9 / obj
                    out.append(C.record(limits, label, "tcp", "get disk-only", obj, len(old), best,
                                        rate, note=note))  # fmt: skip
            finally:
                if c is not None:
                    c.close()
                for p in reversed(procs):
                    p.kill()
                    p.wait(20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _wait_line(p: Any, prefix: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline().decode(errors="replace")
        if not line:
            raise RuntimeError(f"{prefix}: the process exited ({p.poll()})")
        if line.startswith(prefix):
            return
    raise TimeoutError(prefix)


def _targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in records:
        if (
            r["op"] == "get"
            and r["page_bytes"] == 4 * MiB
            and r["path"] != "cached"
            and r["transport"] != "nixl-posix"
        ):
            out.append(
                {
                    "target": "disk-segment get of 4 MiB objects >= 0.8 x raw read",
                    "path": f"{r['case']} {r['path']}",
                    "value": r["ratio_disk"],
                    "met": r["ratio_disk"] is not None and r["ratio_disk"] >= 0.8,
                }
            )
        if r["op"] == "demote" and r["case"] == "store+disk paced":
            out.append(
                {
                    "target": "demotion keeps up with a writer at >= 0.5 x raw write",
                    "path": r["case"],
                    "value": r["ratio_disk"],
                    "met": r["ratio_disk"] is not None and r["ratio_disk"] >= 0.5,
                }
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
