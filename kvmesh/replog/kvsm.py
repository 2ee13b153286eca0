"""An example key-value state machine for the replicated log (servers, tests, simulator, bench).

Commands are msgspec Structs in one tagged union, encoded with :func:`encode_command`:

====================  ======================================  =============================
command               effect                                  result
====================  ======================================  =============================
``KvGet(key)``        none (a read through the log)           value bytes, or ``None``
``KvPut(key, v)``     set                                     ``None``
``KvDelete(key)``     remove                                  ``True`` if the key existed
``KvCas(key, e, v)``  set to ``v`` if the value equals ``e``    ``True`` if swapped
                      (``e=None``: only if absent)
``KvBatch(cmds)``     each command in order                   list of the results
====================  ======================================  =============================

These match :class:`kvmesh.replog.sim.linearizability.KvModel` (``get``/``put``/``delete``/``cas``).

Values are stored as ``KvValue(value, index)`` frozen ``gc=False`` structs, ``index`` being
the log index of the last write (a per-key revision). Snapshots are a sequence of
CRC-framed chunks of up to ``CHUNK_ITEMS`` items, produced lazily from a shallow copy so a
driver can interleave encoding with other work (:meth:`KvStateMachine.snapshot_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import crc32c
import msgspec

from .storage.snapfile import iter_chunks, pack_chunk

__all__ = [
    "KvGet",
    "KvPut",
    "KvDelete",
    "KvCas",
    "KvBatch",
    "KvCommand",
    "KvValue",
    "KvStateMachine",
    "encode_command",
    "decode_command",
    "CHUNK_ITEMS",
]

CHUNK_ITEMS = 10_000


class KvGet(msgspec.Struct, tag="get", array_like=True, frozen=True, gc=False):
    key: str


class KvPut(msgspec.Struct, tag="put", array_like=True, frozen=True, gc=False):
    key: str
    value: bytes


class KvDelete(msgspec.Struct, tag="del", array_like=True, frozen=True, gc=False):
    key: str


class KvCas(msgspec.Struct, tag="cas", array_like=True, frozen=True, gc=False):
    key: str
    expected: bytes | None
    value: bytes


class KvBatch(msgspec.Struct, tag="batch", array_like=True, frozen=True):
    commands: list[KvGet | KvPut | KvDelete | KvCas]


KvCommand = KvGet | KvPut | KvDelete | KvCas | KvBatch


class KvValue(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A stored value and the log index of the write that set it."""

    value: bytes
    index: int


_enc = msgspec.msgpack.Encoder()
_cmd_dec = msgspec.msgpack.Decoder(KvCommand)
_chunk_dec = msgspec.msgpack.Decoder(tuple[list[str], list[KvValue]])


def encode_command(cmd: KvCommand) -> bytes:
    return _enc.encode(cmd)


def decode_command(data: bytes) -> KvCommand:
    return _cmd_dec.decode(data)


class KvStateMachine:
    """Deterministic dict-backed KV store implementing the ``StateMachine`` protocol."""

    result_type: Any = bytes | bool | None | list[bytes | bool | None]

    def __init__(self) -> None:
        self.data: dict[str, KvValue] = {}
        self.applied = 0

    def apply(self, index: int, data: bytes) -> Any:
        cmd = _cmd_dec.decode(data)
        self.applied = index
        if type(cmd) is KvBatch:
            return [self._one(index, c) for c in cmd.commands]
        return self._one(index, cmd)

    def _one(self, index: int, cmd: Any) -> Any:
        t = type(cmd)
        d = self.data
        if t is KvPut:
            d[cmd.key] = KvValue(cmd.value, index)
            return None
        if t is KvGet:
            v = d.get(cmd.key)
            return None if v is None else v.value
        if t is KvDelete:
            return d.pop(cmd.key, None) is not None
        if t is KvCas:
            v = d.get(cmd.key)
            cur = None if v is None else v.value
            if cur == cmd.expected:
                d[cmd.key] = KvValue(cmd.value, index)
                return True
            return False
        raise TypeError(f"unsupported KV command {cmd!r}")  # nested batch

    def query(self, data: bytes) -> Any:
        """Read-only evaluation of an encoded ``KvGet`` (or a ``KvBatch`` of them) against
        local state; serve it only after a read-index / lease check."""
        cmd = _cmd_dec.decode(data)
        if type(cmd) is KvBatch:
            if any(type(c) is not KvGet for c in cmd.commands):
                raise TypeError("query batches may only contain KvGet")
            return [self.get(c.key) for c in cmd.commands]
        if type(cmd) is not KvGet:
            raise TypeError(f"query accepts KvGet or a batch of them, not {type(cmd).__name__}")
        return self.get(cmd.key)

    def get(self, key: str) -> bytes | None:
        """Local read (serve it only after a read-index / lease check)."""
        v = self.data.get(key)
        return None if v is None else v.value

    def snapshot_chunks(self) -> Iterator[bytes]:
        """Shallow-copy now (consistent image at the current applied index), encode lazily:
        each ``next()`` encodes one chunk of up to ``CHUNK_ITEMS`` items."""
        keys = list(self.data)
        values = list(self.data.values())

        def gen() -> Iterator[bytes]:
            for lo in range(0, len(keys), CHUNK_ITEMS):
                yield pack_chunk(
                    _enc.encode((keys[lo : lo + CHUNK_ITEMS], values[lo : lo + CHUNK_ITEMS]))
                )

        return gen()

    def snapshot(self) -> bytes:
        return b"".join(self.snapshot_chunks())

    def restore(self, data: bytes) -> None:
        new: dict[str, KvValue] = {}
        for chunk in iter_chunks(data):
            keys, values = _chunk_dec.decode(chunk)
            new.update(zip(keys, values))
        self.data = new

    def digest(self) -> int:
        """Order-independent checksum of the state (to compare replicas)."""
        h = 0
        for k in sorted(self.data):
            v = self.data[k]
            h = crc32c.crc32c(v.value, crc32c.crc32c(b"%s\0%d\0" % (k.encode(), v.index), h))
        return h
