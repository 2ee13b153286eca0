"""A shared buffer larger than the free space of its tmpfs is refused with a clear error, not
created sparse and left to kill the process with SIGBUS at its first write (a container's
``/dev/shm`` is often 64 MiB). Real files on a real small tmpfs: each case runs in a child
inside its own mount namespace (``unshare``) with an 8 MiB tmpfs as its ``SHM_DIR``; skipped
where this host cannot make one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = textwrap.dedent(
    """
    import errno, os, sys
    sys.path.insert(0, {root!r})
    from kvmesh.transfer import memory, shmfile
    d = sys.argv[1]
    shmfile.SHM_DIR = memory.SHM_DIR = d
    populate = sys.argv[2] == "1"
    try:
        memory.SharedBuffer.create(32 << 20, populate=populate)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
        print("REFUSED", e)
    else:
        print("CREATED")
    print("LEFT", len(os.listdir(d)))
    b = memory.SharedBuffer.create(4 << 20, populate=populate)  # fits: usable to the end
    b.array()[:] = 7
    print("WROTE", int(b.array()[-1]))
    b.close()
    """
)


def _run(tmp_path, populate: bool) -> subprocess.CompletedProcess:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    child = tmp_path / "child.py"
    child.write_text(_CHILD.format(root=ROOT))
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=8m tmpfs {mnt}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    script = f"mount -t tmpfs -o size=8m tmpfs {mnt} && exec {sys.executable} {child} {mnt} "
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script + ("1" if populate else "0")],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("populate", [True, False], ids=["populated", "lazy"])
def test_a_buffer_larger_than_the_tmpfs_is_refused_not_a_bus_error(tmp_path, populate):
    r = _run(tmp_path, populate)
    # A sparse file would have been created, and the first write past 8 MiB ends the child
    # with SIGBUS (returncode -7 through sh's exec) before it prints anything more.
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    out = r.stdout.splitlines()
    assert out[0].startswith("REFUSED"), r.stdout
    assert "32.0 MiB asked for" in out[0] and "free on" in out[0] and "--shm-size" in out[0]
    assert out[1] == "LEFT 0"  # the refused file was removed
    assert out[2] == "WROTE 7"
