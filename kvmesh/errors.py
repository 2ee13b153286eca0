"""The one code -> exception mechanism shared by kvmesh's error trees.

``kvmesh.transfer.errors``, ``kvmesh.replog.errors`` and ``kvmesh.store.errors`` each declare
their own classes, each with a wire ``code`` (strings for transfer and replog, Mooncake-compatible
ints for the store). A peer sends ``(code, message)``; the receiver rebuilds the same class with
an :class:`ErrorTable` built from those declarations, so a remote refusal raises locally exactly
as it would have on the peer. The table refuses two classes with one code at import time, so a
copy-pasted code cannot silently shadow another class.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["ErrorTable"]

E = TypeVar("E", bound=BaseException)


class ErrorTable(Generic[E]):
    """Maps wire codes to the classes of one error tree.

    ``classes`` are the classes a code rebuilds (each must subclass ``base`` and carry a
    ``code``). A class may define a ``from_wire(message)`` classmethod when its constructor
    takes other arguments first. ``unknown(code, message)`` builds the error for a code outside
    the table (default: ``base(message)``).
    """

    def __init__(
        self,
        base: type[E],
        classes: Iterable[type[E]],
        *,
        unknown: Callable[[Hashable, str], E] | None = None,
    ) -> None:
        self.base = base
        self._unknown = unknown
        # Public as the modules' historical ERROR_CODES / ERROR_CLASSES dicts (same object).
        self.by_code: dict[Hashable, type[E]] = {}
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(f"{cls!r} is not a subclass of {base.__name__}")
            code = cls.code  # type: ignore[attr-defined]
            other = self.by_code.get(code)
            if other is not None:
                raise ValueError(
                    f"{other.__name__} and {cls.__name__} share the wire code {code!r}"
                )
            self.by_code[code] = cls

    def class_for(self, code: Hashable) -> type[E] | None:
        """The class registered for ``code``, or None."""
        return self.by_code.get(code)

    def error_for(self, code: Hashable, message: str) -> E:
        """The exception a peer's ``(code, message)`` stands for."""
        cls = self.by_code.get(code)
        if cls is None:
            if self._unknown is not None:
                return self._unknown(code, message)
            return self.base(message)
        from_wire = getattr(cls, "from_wire", None)
        return from_wire(message) if from_wire is not None else cls(message)
