"""The shared code -> exception table (kvmesh/errors.py) and the three trees built on it."""

from __future__ import annotations

import pytest

from kvmesh.errors import ErrorTable
from kvmesh.replog import errors as replog_errors
from kvmesh.store import errors as store_errors
from kvmesh.transfer import errors as transfer_errors


class _Base(Exception):
    code = "base"


class _A(_Base):
    code = "a"


class _B(_Base, ValueError):
    code = "b"


def test_table_round_trips_and_falls_back() -> None:
    table = ErrorTable(_Base, (_Base, _A, _B))
    e = table.error_for("b", "boom")
    assert type(e) is _B and isinstance(e, ValueError) and str(e) == "boom"
    assert type(table.error_for("zzz", "x")) is _Base
    assert table.class_for("a") is _A and table.class_for("zzz") is None


def test_duplicate_code_is_refused() -> None:
    class Copy(_Base):
        code = "a"  # a copy-pasted code must not shadow _A silently

    with pytest.raises(ValueError, match="share the wire code"):
        ErrorTable(_Base, (_A, Copy))
    with pytest.raises(TypeError):
        ErrorTable(_A, (_B,))


@pytest.mark.parametrize(
    ("mod", "table", "rebuild", "base"),
    [
        (
            transfer_errors,
            transfer_errors.ERROR_CODES,
            transfer_errors.error_from_code,
            transfer_errors.TransferError,
        ),
        (
            replog_errors,
            replog_errors.ERROR_CODES,
            replog_errors.error_from_code,
            replog_errors.ReplogError,
        ),
        (store_errors, store_errors.ERROR_CLASSES, store_errors.error_for, store_errors.StoreError),
    ],
)
def test_every_code_rebuilds_its_class(mod, table, rebuild, base) -> None:
    assert table, mod.__name__
    for code, cls in table.items():
        assert cls.code == code and issubclass(cls, base)
        e = rebuild(code, "remote said no")
        assert type(e) is cls and str(e) == "remote said no"
    # Every declared class whose code is in the table maps to a class of that code.
    declared = [o for o in vars(mod).values() if isinstance(o, type) and issubclass(o, base)]
    assert {c.code for c in declared} == set(table)


def test_tree_specific_rules() -> None:
    nl = replog_errors.error_from_code("not_leader", "go away")
    assert type(nl) is replog_errors.NotLeaderError and nl.leader_id is None
    assert isinstance(nl, replog_errors.NotLeader) and str(nl) == "go away"
    unknown = store_errors.error_for(-12345)
    assert type(unknown) is store_errors.StoreError and unknown.code == -12345
    assert str(store_errors.error_for(-704)) == "OBJECT_NOT_FOUND"
    assert isinstance(store_errors.error_for(-704), KeyError)
    assert store_errors.Code.OBJECT_NOT_FOUND == -704  # Mooncake's value
    assert transfer_errors.ERROR_CODES["out_of_bounds"] is transfer_errors.OutOfBounds
    assert type(transfer_errors.error_from_code("nope", "x")) is transfer_errors.TransferError
