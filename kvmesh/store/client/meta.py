"""The client's metadata calls: exists (by name or by parts), count_leading, get_size,
remove, remove_prefix, replicas, status."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .. import errors as E
from .. import protocol as P
from ..types import (
    bad_parts,
    key_error,
    keys_valid,
)
from .args import listify
from .replies import (
    MAX_KEYS_PER_RPC,
    BatchResults,
    Removed,
    coded,
    fan_out,
    finish,
    rpc_parts,
    valid_indices,
    whole_error,
)

__all__ = ["Meta"]


class Meta:
    """The metadata calls of :class:`~kvmesh.store.client.StoreClient`."""

    def exists(self, keys: Any, *, prefix: str = "", suffixes: Sequence[str] | None = None) -> Any:
        """True if a COMPLETE object has the key (no lease is taken).

        With ``prefix`` or ``suffixes``: the objects named ``prefix + key + suffix`` for every
        key and then every suffix (key-major; ``suffixes`` defaults to ``[""]``), one result
        per name, always a batch. The master gets the parts, not the names
        (:class:`protocol.ExistsPartsReq`), so names that share a long start pay for their
        middles only."""
        if prefix or suffixes is not None:
            return self._exists_parts(keys, prefix, list(suffixes or [""]))
        ks, batch = listify(keys)
        out: list[Any] = [None] * len(ks)
        # The hot path (HiCache's batch_exists): all keys valid, checked once for the batch,
        # and results written by slice, with no per-key Python work on this side.
        idx: list[int] | None = None if keys_valid(ks) else valid_indices(ks, out)
        for part in rpc_parts(ks, idx):
            pk = ks[part.start : part.stop] if type(part) is range else [ks[i] for i in part]
            resp = self.rpc.call(lambda rid, pk=pk: P.ExistsReq(rid, pk))
            fan_out(out, part, resp, P.CodesResp, ("codes",), bool)
        return finish(BatchResults(out), batch)

    def _exists_parts(self, keys: Any, prefix: str, sufs: list[str]) -> BatchResults:
        ks = listify(keys)[0]  # one key (a str) is a batch of one key here
        if len(sufs) > MAX_KEYS_PER_RPC or bad_parts(prefix, ks, sufs) is not None:
            # Some name is invalid (or too many suffixes): name by name, for per-name errors.
            return self.exists(P.parts_names(prefix, ks, sufs))
        m = len(sufs)
        out: list[Any] = [None] * (len(ks) * m)
        for part in rpc_parts(ks, per=m):
            pk = ks[part.start : part.stop]
            resp = self.rpc.call(lambda rid, pk=pk: P.ExistsPartsReq(rid, prefix, pk, sufs))
            names = range(part.start * m, part.stop * m)  # m results per key, key-major
            fan_out(out, names, resp, P.CodesResp, ("codes",), bool)
        return BatchResults(out)

    def count_leading(
        self, keys: Any, *, prefix: str = "", suffixes: Sequence[str] | None = None
    ) -> int:
        """The number of leading keys whose every name ``prefix + key + suffix`` is a
        COMPLETE object (``suffixes`` defaults to ``[""]``): what :meth:`exists` by parts
        answers, up to the first key with a missing name. The master counts (one int in the
        reply; it stops at the first missing name). A name that is invalid, or a request the
        master fails, counts as missing; when the first request fails its error is raised
        (``StoreUnavailable`` when no master answers), as nothing was counted."""
        ks = listify(keys)[0]
        sufs = list(suffixes or [""])
        m = len(sufs)
        if m > MAX_KEYS_PER_RPC or bad_parts(prefix, ks, sufs) is not None:
            # Name by name: an invalid name is an error result there, i.e. missing here.
            flags = self.exists(P.parts_names(prefix, ks, sufs))
            if (
                flags
                and isinstance(flags[0], E.StoreError)
                and not isinstance(flags[0], E.InvalidKey)
            ):
                raise flags[0]  # the first name is not known: nothing was counted
            return _leading(flags, m)
        total = 0
        for part in rpc_parts(ks, per=m):
            pk = ks[part.start : part.stop]
            resp = self.rpc.call(lambda rid, pk=pk: P.ExistsPartsReq(rid, prefix, pk, sufs, True))
            t = type(resp)
            if t is P.CountResp and type(resp.count) is int and 0 <= resp.count <= len(pk):
                n = resp.count
            elif t is P.CodesResp and len(resp.codes) == len(pk) * m:
                n = _leading(resp.codes, m)  # a master without the count answers per name
            elif part.start == 0:
                raise whole_error(resp)
            else:
                return total  # not known past here: missing
            total += n
            if n < len(pk):
                break
        return total

    def get_size(self, keys: Any) -> Any:
        ks, batch = listify(keys)
        out: list[Any] = [None] * len(ks)
        idx = valid_indices(ks, out)
        for part in rpc_parts(ks, idx):
            pk = [ks[i] for i in part]
            resp = self.rpc.call(lambda rid, pk=pk: P.GetSizeReq(rid, pk))
            each = coded("get_size", ks, part)
            fan_out(out, part, resp, P.SizesResp, ("codes", "sizes"), each)
        return finish(BatchResults(out), batch)

    def remove(self, keys: Any, *, force: bool = False) -> Any:
        """Remove objects. A key with a live read lease answers ObjectHasLease unless
        ``force`` (then readers holding a lease may get LeaseExpired)."""
        ks, batch = listify(keys)
        out: list[Any] = [None] * len(ks)
        idx = valid_indices(ks, out)
        for part in rpc_parts(ks, idx, key_bytes=True):
            pk = [ks[i] for i in part]
            resp = self.rpc.mutate(lambda rid, s, pk=pk: P.RemoveReq(rid, s, pk, force))
            fan_out(out, part, resp, P.CodesResp, ("codes",), coded("remove", ks, part))
        return finish(BatchResults(out), batch)

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every object (leased ones too with ``force``); returns how many."""
        resp = self.rpc.mutate(lambda rid, s: P.RemoveAllReq(rid, s, force))
        if type(resp) is not P.CountResp:
            raise whole_error(resp)
        return resp.count

    def remove_prefix(
        self, prefix: str, *, force: bool = False, timeout: float | None = None
    ) -> Removed:
        """Remove every object whose key starts with ``prefix`` (a non-empty valid key
        prefix: literal, no patterns); returns how many, an ``int`` whose ``skipped`` says
        how many matching objects were left because a reader holds a lease on them (or a
        put of the key was in flight). With ``force`` leased ones go too (readers holding a
        lease may get LeaseExpired), as in :meth:`remove`. The master removes at most its
        batch limit per round (one log entry each); this call sends rounds until done, or
        until ``timeout`` seconds (default: 20 x the client's ``timeout``) have passed, then
        raises :class:`StoreTimeout` (rounds already committed stay done): a master that
        keeps answering ``more`` cannot hold the caller forever."""
        why = key_error(prefix)
        if why is not None:
            raise E.InvalidKey(f"prefix: {why}")
        removed = idle = 0
        limit = 20 * self.rpc.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if time.monotonic() > deadline:
                raise E.StoreTimeout(
                    f"remove_prefix({prefix!r}) not done after {limit:g} s "
                    f"({removed} removed so far)"
                )
            resp = self.rpc.mutate(lambda rid, s: P.RemovePrefixReq(rid, s, prefix, force))
            if type(resp) is not P.RemovePrefixResp:
                raise whole_error(resp)
            removed += resp.removed
            idle = 0 if resp.removed else idle + 1
            if not resp.more or idle >= 3:  # a round that found only vanishing keys
                return Removed(removed, resp.skipped)

    def replicas(self, keys: Any) -> Any:
        """The COMPLETE copies of objects (per key a list of :class:`ObjectReplica`, slices
        in byte order, copies on this host first): where each object lives, for callers that
        show or reason about placement. Like a read, it grants a lease on each found key."""
        ks, batch = listify(keys)
        out: list[Any] = [None] * len(ks)
        idx = valid_indices(ks, out)
        host = self.engine.host_id
        for part in rpc_parts(ks, idx):
            pk = [ks[i] for i in part]
            resp = self.rpc.call(lambda rid, pk=pk: P.GetReplicasReq(rid, pk, host))
            each = coded("lookup", ks, part)
            fan_out(
                out, part, resp, P.ReplicasResp, ("codes", "replicas"),
                lambda c, reps, each=each: each(c, list(reps or [])),
            )  # fmt: skip
        return finish(BatchResults(out), batch)

    def status(self) -> dict[str, Any]:
        """The leader's view (members, term, segments, usage, objects, leases)."""
        resp = self.rpc.call(lambda rid: P.StatusReq(rid))
        if type(resp) is not P.StatusResp:
            raise whole_error(resp)
        return resp.info


def _leading(flags: Sequence[Any], per: int) -> int:
    """Leading groups of ``per`` adjacent flags that are all ``True`` (or 1)."""
    ok = [f is True or (type(f) is int and f == 1) for f in flags]
    return ok.index(False) // per if False in ok else len(ok) // per
