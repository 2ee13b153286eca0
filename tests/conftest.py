import os
import pathlib

# Child processes spawned by tests must import this checkout's kvmesh even when the
# package is not installed (worktrees, plain clones).
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
_pp = os.environ.get("PYTHONPATH", "")
if _ROOT not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = _ROOT + (os.pathsep + _pp if _pp else "")
# NIXL prints INFO lines on stdout otherwise; UCX must not multi-rail over non-loopback NICs.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
