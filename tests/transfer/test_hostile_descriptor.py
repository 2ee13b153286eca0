"""A hostile owner's descriptor cannot make our WRITE land in a file of its choosing.

A live owner process (tests/transfer/peer.py) publishes a real shared segment, then rewrites
its descriptor (``forge``) so that the shared-memory name (or the fence name) points at a
file outside the engine's own files: a ``../..`` path, an absolute path, a symlink with a
valid name, a file of another user. We WRITE into the segment with the shm transport forced;
the transport must refuse to open the file, and the file must keep its bytes.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from kvmesh.transfer import TransportUnavailable
from kvmesh.transfer.memory import SHM_DIR

SIZE = 1 << 20


def _valid_name() -> str:
    return f"kvmesh-{os.getpid()}-{secrets.token_hex(6)}"


@pytest.fixture
def owner(make_peer):
    return make_peer("--kind", "shm", "--size", str(SIZE), "--name", "pool")


@pytest.mark.parametrize(
    "field,how",
    [
        ("shm_name", "dotdot"),
        ("shm_name", "absolute"),
        ("shm_name", "symlink"),
        ("shm_name", "foreign"),
        ("fence", "dotdot"),
        ("fence", "symlink"),
    ],
)
def test_forged_file_names_are_refused(owner, make_engine, tmp_path, field, how):
    target = tmp_path / "victim.bin"
    target.write_bytes(bytes(SIZE))
    made = []
    if how == "dotdot":
        evil = "../.." + str(target)
    elif how == "absolute":
        evil = str(target)
    elif how == "symlink":
        evil = _valid_name()
        os.symlink(target, os.path.join(SHM_DIR, evil))
        made.append(evil)
    else:  # a file with a valid name on the right device, but another user's
        if os.getuid() != 0:
            pytest.skip("only root can create a file of another user")
        evil = _valid_name()
        with open(os.path.join(SHM_DIR, evil), "wb") as f:
            f.write(bytes(SIZE))
        os.chown(os.path.join(SHM_DIR, evil), 4242, 4242)
        made.append(evil)
        target = os.path.join(SHM_DIR, evil)
    try:
        assert owner.cmd("forge", name="pool", fields={field: evil, "seg_id": 7})["ok"]
        eng = make_engine(transport="shm")
        src = eng.register(np.full(SIZE, 0xC3, np.uint8))
        seg = eng.open_segment(owner.address, "pool")
        assert getattr(seg.desc, field) == evil
        with pytest.raises(
            TransportUnavailable,
            match="not a kvmesh shared-memory name|symbolic|Too many levels|belongs to uid",
        ):
            eng.write(src, 0, seg, 0, SIZE)
        with open(target, "rb") as f:
            assert f.read() == bytes(SIZE)  # not a byte of ours landed there
    finally:
        for name in made:
            os.unlink(os.path.join(SHM_DIR, name))


def test_a_forged_offset_outside_the_file_is_refused(owner, make_engine):
    # A negative offset would aim our copy below the mapping, into our own memory.
    assert owner.cmd("forge", name="pool", fields={"shm_offset": -(1 << 20), "seg_id": 9})["ok"]
    eng = make_engine(transport="shm")
    src = eng.register(np.full(SIZE, 0xC3, np.uint8))
    seg = eng.open_segment(owner.address, "pool")
    with pytest.raises(TransportUnavailable, match="holds"):
        eng.write(src, 0, seg, 0, SIZE)
