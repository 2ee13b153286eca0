"""HiCache object names are injective over configurations (plugins/kvmesh_sglang/hicache.py,
"naming"): two deployments share an object name only when the module says they share the
object (the TP ranks of MLA KV); every other difference in any field -- namespace, model,
layout, dtype, page size, MHA/MLA, TP/PP/CP/DCP rank and size -- gives disjoint names, for
any page hashes, adversarial ones with ``/``, ``%`` and ``-`` included. A model of None,
``""`` and ``"-"`` used to share one name segment (``-``), so such deployments read each
other's pages. No SGLang needed: configurations are plain attribute bags, as SGLang's are.

A seeded generator (hypothesis is not installed here) draws the configurations and hashes.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvmesh_sglang.hicache import _Names, _namespace_prefix, _pool_names, _shards

SEED = 20240516
CONFIGS = 2000
PARTS = ["a", "b", "-", "/", "%", "%2D", "%2F", "%25", ".", "?", "é", "tp0of1", "mla", "ps1"]


def _text(rng: random.Random, empty: bool) -> str:
    n = rng.randint(0 if empty else 1, 3)
    return "".join(rng.choice(PARTS) for _ in range(n))


def _par(rng: random.Random) -> tuple[int, int]:
    n = rng.choice((1, 1, 2, 3))
    return rng.randrange(n), n


# Few values per field, with the separators: configurations then often agree on all but a
# field or two, where a collision between two fields' encodings would show.
NAMESPACES = ["a", "a/b", "a%2Fb", "-", "%", "b"]
MODELS = (None, "", "-", "%2D", "%", "a/b", "a")
LAYOUTS = ["page_first", "a", "a/b", "b/ps1", "/", "%2F", "b"]
DTYPES = ["torch.bfloat16", "bfloat16", "a", "b/a", "a/ps1", "ps1", "/", "%2F", "torch.a/b"]


def _config(rng: random.Random) -> dict[str, Any]:
    (tp, tp_n), (pp, pp_n), (cp, cp_n), (d, d_n) = (_par(rng) for _ in range(4))
    return {
        "namespace": rng.choice(NAMESPACES + [_text(rng, False)]),
        "model_name": rng.choice(MODELS + (_text(rng, True),)),
        "layout": rng.choice(LAYOUTS),
        "dtype": rng.choice(DTYPES),
        "page_size": rng.choice((1, 2)),
        "is_mla_model": rng.random() < 0.5,
        "tp_rank": tp,
        "tp_size": tp_n,
        "pp_rank": pp,
        "pp_size": pp_n,
        "attn_cp_rank": cp,
        "attn_cp_size": cp_n,
        "dcp_rank": d,
        "dcp_size": d_n,
    }


FAMILIES = [("kv", None), ("flat", None), ("mamba", False), ("swa", True), ("indexer", False)]
"""A deployment's families of names: its KV pool, generic (flat) pages and sidecar pools
(Mamba state, an MHA-shaped and a non-MHA-shaped one), as (pool, pool keeps K and V apart;
None: as the model)."""


def _shared(c: dict[str, Any], pool: str, mha: bool | None) -> bool:
    """Whether the family's objects are shared by the TP ranks (the module's rule)."""
    return c["is_mla_model"] and pool != "mamba" and not (mha if mha is not None else False)


def _identity(c: dict[str, Any], pool: str, mha: bool | None) -> tuple:
    """What must keep one family's objects of two deployments apart: every field, except
    that objects shared by the TP ranks do not name the rank (nor, without DCP, the TP
    size), rank-private ones do not name the DCP group, and a dtype is named without
    ``torch.``."""
    shared = _shared(c, pool, mha)
    dcp = c["is_mla_model"] and shared and c["dcp_size"] > 1
    return (
        pool,
        c["namespace"],
        c["model_name"],
        c["layout"],
        c["dtype"].removeprefix("torch."),
        c["page_size"],
        c["is_mla_model"],
        None if shared else c["tp_rank"],
        c["tp_size"] if (not shared or dcp) else None,
        (c["pp_rank"], c["pp_size"]),
        (c["attn_cp_rank"], c["attn_cp_size"]),
        (c["dcp_rank"], c["dcp_size"]) if dcp else None,
    )


def _families(c: dict[str, Any], keys: list[str]) -> dict[tuple, list[str]]:
    """Per family (its identity) the names of ``keys``' objects."""
    sh = _shards(SimpleNamespace(**c), c["namespace"], c["layout"], c["dtype"], c["page_size"])
    out = {}
    for pool, mha in FAMILIES:
        names = _pool_names(sh, c["is_mla_model"], "kv" if pool == "flat" else pool, mha)
        split = mha if mha is not None else not c["is_mla_model"]
        comps = ["flat"] if pool == "flat" else ["k", "v"] if split else ["kv"]
        out[_identity(c, pool, mha)] = names.names(keys, comps)
    return out


def _mutate(rng: random.Random, c: dict[str, Any]) -> dict[str, Any]:
    """``c`` with one field drawn again (possibly to the same value)."""
    d = _config(rng)
    f = rng.choice(sorted(c))
    m = {**c, f: d[f]}
    for r, n in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("attn_cp_rank", "attn_cp_size")):
        if f in (r, n):  # keep the pair a valid rank
            m[r], m[n] = d[r], d[n]
    if f in ("dcp_rank", "dcp_size"):
        m["dcp_rank"], m["dcp_size"] = d["dcp_rank"], d["dcp_size"]
    return m


def test_names_are_injective_over_configurations():
    """Across thousands of configurations and adversarial hashes: a name belongs to one
    family identity (no two deployments that must be apart share any object), and a
    configuration changed in one field keeps exactly the names its identity says."""
    rng = random.Random(SEED)
    # hashes that could absorb name segments if a field's encoding let "/" through
    keys = ["0123abcd", "ps1/0123abcd", "a/ps1/0123abcd", "ps2/a/ps1/0123abcd"]
    keys += [_text(rng, False) for _ in range(6)]
    owner: dict[str, tuple] = {}
    by_prefix: dict[str, tuple] = {}
    same = differ = 0
    for _ in range(CONFIGS):
        c = _config(rng)
        for cfg in (c, _mutate(rng, c)):
            fams = _families(cfg, keys)
            every = [n for names in fams.values() for n in names]
            assert len(set(every)) == len(every), cfg  # distinct within one deployment
            for ident, names in fams.items():
                for n in names:
                    other = owner.setdefault(n, ident)
                    assert other == ident, f"{n!r} is named by {other} and by {ident}"
            # clear() removes by the prefix {namespace}/{model}/: it starts these names and,
            # its two segments having no "/" inside, no name of another namespace or model
            pre = _namespace_prefix(cfg["namespace"], cfg["model_name"])
            assert pre.count("/") == 2 and all(n.startswith(pre) for n in every)
            who = (cfg["namespace"], cfg["model_name"])
            assert by_prefix.setdefault(pre, who) == who, pre
        # one field changed: a family keeps its names exactly when its identity is the same
        a, b = _families(c, keys), _families(_mutate(rng, c), keys)
        for ia, ib in zip(a, b):
            assert (a[ia] == b[ib]) == (ia == ib), (ia, ib)
            same += ia == ib
            differ += ia != ib
    assert same > CONFIGS and differ > CONFIGS  # the generator explored both sides


def test_names_are_injective_over_every_combination_of_the_prefix_fields():
    """Exhaustively: every namespace x model x layout x dtype x page size of the lists above
    (separators in every field), under a few shards, with hashes that could absorb
    segments. A random draw rarely meets two configurations that differ in exactly two
    fields whose encodings might swap a "/" between them; the product meets them all."""
    keys = ["0123abcd", "ps1/0123abcd", "a/ps1/0123abcd", "b/a/ps1/0123abcd"]
    par = {"pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1}
    shards = [
        {"is_mla_model": False, "tp_rank": 0, "tp_size": 1, "dcp_rank": 0, "dcp_size": 1},
        {"is_mla_model": True, "tp_rank": 1, "tp_size": 2, "dcp_rank": 0, "dcp_size": 1},
    ]
    owner: dict[str, tuple] = {}
    for ns, model, layout, dtype, page, sh in itertools.product(
        NAMESPACES, MODELS, LAYOUTS, DTYPES, (1, 2), shards
    ):
        c = {"namespace": ns, "model_name": model, "layout": layout, "dtype": dtype}
        c.update(page_size=page, **par, **sh)
        for ident, names in _families(c, keys).items():
            for n in names:
                other = owner.setdefault(n, ident)
                assert other == ident, f"{n!r} is named by {other} and by {ident}"


def test_none_empty_and_dash_models_are_separate_deployments():
    c = _config(random.Random(1))
    got = {m: sorted(sum(_families({**c, "model_name": m}, ["h"]).values(), [])) for m in MODELS}
    assert all(not set(got[x]) & set(got[y]) for x in MODELS for y in MODELS if x != y)


def test_names_of_common_configurations_are_unchanged():
    """The names existing deployments wrote stay the same (no re-warm after an upgrade)."""
    cfg = SimpleNamespace(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, model_name="org/m-7B")
    sh = _shards(cfg, "default", "page_first", "torch.bfloat16", 64)
    assert sh.prefix == "default/org%2Fm-7B/page_first/bfloat16/ps64/"
    assert (
        _Names(sh.prefix, sh.rank)("abc", "k")
        == "default/org%2Fm-7B/page_first/bfloat16/ps64/abc/tp1of2/k"
    )
    cfg = SimpleNamespace(is_mla_model=True, tp_rank=0, tp_size=8, pp_rank=1, pp_size=2)
    sh = _shards(cfg, "ns", "layer_first", "torch.float8_e4m3fn", 1)
    assert sh.prefix == "ns/-/layer_first/float8_e4m3fn/ps1/"  # no model name: "-" as before
    assert sh.shared == "mla/pp1of2"
    # (an MLA model's rank-private sidecar objects were "tp0of8/pp1of2", an MHA model's name)
    assert sh.rank == "mlatp0of8/pp1of2"


@pytest.mark.parametrize(
    "bad",
    [
        {"tp_rank": 2, "tp_size": 2},
        {"tp_rank": -1},
        {"pp_rank": 0, "pp_size": 0},
        {"tp_rank": "0"},
        {"attn_cp_rank": 1.0, "attn_cp_size": 2},
        {"model_name": 5},
    ],
)
def test_configurations_that_name_no_shard_are_refused(bad):
    cfg = SimpleNamespace(**{"tp_rank": 0, "tp_size": 2, **bad})
    with pytest.raises(ValueError):
        _shards(cfg, "ns", "page_first", "torch.bfloat16", 64)
