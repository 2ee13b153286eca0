"""Another SGLang "instance" for the HiCache tests: a process with its own real host pools and
its own :class:`KvmeshHiCacheStorage`, driven through ``bench._common.Child`` JSON lines.

Commands: ``open`` (build a pool and a backend on the given store), ``set`` (fill pages from
seeds, batch_set_v1; replies the page digests), ``get`` (batch_exists + batch_get_v1 into
fresh slots; replies the page digests), ``exit``.
"""

from __future__ import annotations

from typing import Any


def main() -> None:
    from tests.plugins.sglang_env import add_plugins_path, install_torchvision_stub

    install_torchvision_stub()
    add_plugins_path()
    from bench._common import serve_json_lines
    from kvmesh_sglang.hicache import KvmeshHiCacheStorage
    from tests.plugins.hicache_util import build_pool, fill_pages, page_digests, storage_config

    backends: dict[str, tuple[Any, Any]] = {}

    def open_(name: str, kind: str, layout: str, extra: dict) -> dict:
        pool = build_pool(kind, layout)
        b = KvmeshHiCacheStorage(storage_config(mla=kind == "mla", extra=extra), {})
        b.register_mem_pool_host(pool)
        backends[name] = (b, pool)
        return {"ok": True}

    def set_(name: str, keys: list[str], seeds: list[int]) -> dict:
        b, pool = backends[name]
        idx = pool.alloc(len(keys) * pool.page_size)
        fill_pages(pool, idx, seeds)
        reply = {"ok": b.batch_set_v1(keys, idx), "digests": page_digests(pool, idx, len(keys))}
        pool.free(idx)
        return reply

    def get(name: str, keys: list[str]) -> dict:
        b, pool = backends[name]
        idx = pool.alloc(len(keys) * pool.page_size)
        reply = {
            "exists": b.batch_exists(keys),
            "ok": b.batch_get_v1(keys, idx),
            "digests": page_digests(pool, idx, len(keys)),
        }
        pool.free(idx)
        return reply

    def exit_() -> None:
        for b, _ in backends.values():
            b.close()

    serve_json_lines({"open": open_, "set": set_, "get": get, "exit": exit_}, {"ready": True})


if __name__ == "__main__":
    main()
