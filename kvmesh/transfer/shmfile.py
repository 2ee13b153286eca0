"""Files under ``/dev/shm``: their names, opening a peer's file safely, liveness, the sweep.

Every file the engine creates is named ``kvmesh-<pid>-<12 hex digits>`` and its creator holds
an open-file-description (OFD) write lock on byte 0 for as long as it owns the file. That lock
is the liveness proof: the kernel drops it when the owner closes the file or dies, and it
works across PID namespaces (a pid in a name does not; containers sharing one IPC namespace
see each other's files but not each other's pids). The sweep removes a file only when it can
take that lock itself, and only files of our own uid. As a second, conservative condition the
pid in the name must not be alive here either: files of kvmesh versions that took no lock
(a host mid-upgrade) survive while their process runs.

A name that comes from a peer (a segment descriptor) is never trusted: it must match the
engine's own pattern (no ``/``, no ``..``), is opened with ``O_NOFOLLOW``, and the open file
must be a regular file on the ``/dev/shm`` device owned by our uid (``open_peer``).

OFD locks, not POSIX ``lockf`` locks: POSIX locks belong to the process and vanish when *any*
descriptor of the file is closed, and they never conflict within one process; OFD locks
belong to the open file and conflict between two opens of the same file even in one process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import struct

from .errors import InvalidArgument

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvmesh-"
_NAME = re.compile(r"kvmesh-[0-9]{1,10}-[0-9a-f]{12}\Z")
LIVE_BYTE = 0  # the owner's liveness lock

F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = "hhqqi4x"  # struct flock on 64-bit Linux: type, whence, start, len, pid (0 for OFD)


def new_name() -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def check_name(name: object) -> str:
    """``name`` if it is a file name of the engine's own pattern, else ``InvalidArgument``."""
    if not isinstance(name, str) or _NAME.match(name) is None:
        shown = repr(name)[:80]
        raise InvalidArgument(f"{shown} is not a kvmesh shared-memory name (kvmesh-<pid>-<hex>)")
    return name


def flock_request(kind: int, start: int, length: int = 1) -> bytes:
    """A packed ``struct flock`` for ``fcntl(fd, F_OFD_*, ...)``."""
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0)


def flock_type(packed: bytes) -> int:
    """The lock type in an ``F_OFD_GETLK`` answer (``F_UNLCK``: nothing conflicts)."""
    return struct.unpack(_FLOCK, packed)[0]


def try_lock(fd: int, start: int, *, write: bool, length: int = 1) -> bool:
    """Take an OFD lock on ``[start, start + length)`` without waiting; False if held."""
    try:
        kind = fcntl.F_WRLCK if write else fcntl.F_RDLCK
        fcntl.fcntl(fd, F_OFD_SETLK, flock_request(kind, start, length))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def create(size: int) -> tuple[str, int]:
    """Create a new ``/dev/shm`` file of ``size`` bytes holding its liveness lock: (name, fd).

    A sweep that runs between our create and our lock could take the lock and unlink the file;
    so after locking, the name must still lead to our file, else we start again.
    """
    for _ in range(100):
        name = new_name()
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if try_lock(fd, LIVE_BYTE, write=True) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                if size:
                    os.ftruncate(fd, size)
                return name, fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
    raise OSError(errno.EEXIST, "could not create a shared-memory file (sweeps kept racing)")


def space(fd: int | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of the filesystem of ``fd``, or of :data:`SHM_DIR`."""
    st = os.statvfs(SHM_DIR) if fd is None else os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def reserve(fd: int, size: int, *, commit: bool) -> None:
    """Make sure the ``size`` bytes of a new file ``fd`` exist, so that touching them never
    raises ``SIGBUS``: a tmpfs file is sparse, and a page that cannot be allocated when it is
    first written kills the process with a bus error, no Python traceback (a container's
    ``/dev/shm`` is often 64 MiB). ``commit``: allocate them now (``posix_fallocate``: exact,
    the same memory a populated mapping commits anyway); else only check the free space (a
    lazily committed buffer can still run out later if others fill the filesystem).
    ``OSError(ENOSPC)`` naming the space there and the usual remedies."""
    if commit:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: stays sparse
                return
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
    free, total = space(fd)
    if not commit and size <= free:
        return
    raise OSError(
        errno.ENOSPC,
        f"shared memory: {size / 2**20:.1f} MiB asked for, {free / 2**20:.1f} MiB free on "
        f"{SHM_DIR} (a tmpfs of {total / 2**20:.1f} MiB). Ask for less, or grow it (docker "
        "run --shm-size=..., a Kubernetes emptyDir with medium: Memory, or mount -o "
        f"remount,size=... {SHM_DIR})",
    )


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_shm_dev: int | None = None


def _check_file(fd: int, name: str) -> os.stat_result:
    global _shm_dev
    st = os.fstat(fd)
    if _shm_dev is None:
        _shm_dev = os.stat(SHM_DIR).st_dev
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"shared-memory file {name!r} is not a regular file")
    if st.st_dev != _shm_dev:
        raise InvalidArgument(f"shared-memory file {name!r} is not on the {SHM_DIR} device")
    if st.st_uid != os.getuid():
        raise InvalidArgument(f"shared-memory file {name!r} belongs to uid {st.st_uid}, not to us")
    return st


def open_peer(name: object, *, write: bool = True) -> tuple[int, os.stat_result]:
    """Open a file a peer named, after every check in the module docstring: (fd, stat)."""
    name = check_name(name)
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(os.path.join(SHM_DIR, name), flags)
    try:
        return fd, _check_file(fd, name)
    except BaseException:
        os.close(fd)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def sweep(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink our uid's kvmesh files in ``/dev/shm`` whose owner no longer holds their lock."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix) or _NAME.match(name) is None:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd, st = open_peer(name)
        except (OSError, InvalidArgument):
            continue  # vanished, another user's, not a regular file: not ours to judge
        try:
            if not try_lock(fd, LIVE_BYTE, write=True):
                continue  # its owner is alive (in whatever pid namespace)
            if _pid_alive(int(name[len(SHM_PREFIX) :].split("-", 1)[0])):
                continue  # unlocked, but maybe an older kvmesh that took no lock: keep it
            if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
