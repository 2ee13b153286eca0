"""The one patch of NIXL's Python wrapper: a progress thread that polls instead of spinning.

The stock wrapper hard-codes ``pthrDelay = 0``, so the UCX progress thread polls with a zero
timeout and spins a whole core (docs/nixl.md, "Pitfalls"). Its only hook from Python is the
binding's config class: :class:`ConfigPatch` swaps ``nixlBind.nixlAgentConfig`` for a
subclass that turns every ``pthrDelay`` assignment into ``delay_us`` while one agent is
created, under a lock, restored at once, and :meth:`ConfigPatch.verified` checks afterwards
that the patched config really reached the agent.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["PATCH_TESTED_VERSIONS", "ConfigPatch"]

# Wrapper versions whose nixl_agent.__init__ was read and found to build its config through
# ``nixlBind.nixlAgentConfig()`` and then assign ``pthrDelay``: the patch relies on that.
PATCH_TESTED_VERSIONS = frozenset({"1.5.1"})


class ConfigPatch:
    """``with ConfigPatch(api, bind, 1000): agent = api.nixl_agent(...)``, then ``verified()``.

    ``api`` and ``bind`` are the loaded package's ``_api`` and ``_bindings`` modules.
    """

    _lock = threading.Lock()

    def __init__(self, api: Any, bind: Any, delay_us: int) -> None:
        self.api = api
        self.bind = bind
        self.delay_us = max(1, int(delay_us))
        self.configs: list[Any] = []

    def __enter__(self) -> ConfigPatch:
        self._lock.acquire()
        base = self.bind.nixlAgentConfig
        delay = self.delay_us
        made = self.configs

        class _Cfg(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                made.append(self)

            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, delay if key == "pthrDelay" else value)

        self._orig = base
        self.api.nixlBind.nixlAgentConfig = _Cfg
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.api.nixlBind.nixlAgentConfig = self._orig
        finally:
            self._lock.release()

    def verified(self) -> bool:
        """Whether exactly one patched config was built and kept the new delay."""
        return (
            len(self.configs) == 1 and getattr(self.configs[0], "pthrDelay", None) == self.delay_us
        )
