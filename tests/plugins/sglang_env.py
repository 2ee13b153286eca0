"""Make SGLang importable on a CPU-only box for tests (shared/docs/sglang-interfaces.md §6).

:func:`install_torchvision_stub` puts an in-memory ``torchvision`` into ``sys.modules``: the
PyPI torchvision wheel is a CUDA build that cannot load its ops against the CPU torch, and
``sglang.srt.configs`` imports ``torchvision.transforms``. Nothing here touches a real
torchvision. Imported by tests/plugins/conftest.py and by the child processes of the PD tests,
before any sglang import.
"""

from __future__ import annotations

import enum
import importlib.machinery
import os
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
PLUGINS = ROOT / "plugins"

_STUBS = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.io",
    "torchvision.ops",
)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _placeholder(module: str, name: str) -> type:
    # A class: callable, subclassable and usable in annotations, which is all imports need.
    return type(
        name,
        (),
        {
            "__module__": module,
            "__init__": lambda self, *a, **k: None,
            "__call__": lambda self, *a, **k: None,
        },
    )


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package, so "import torchvision.x.y" resolves through sys.modules
    mod.__file__ = None
    cache: dict[str, type] = {}

    def __getattr__(attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in cache:
            cache[attr] = _placeholder(name, attr)
        return cache[attr]

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def install_torchvision_stub() -> None:
    """Register the stub (idempotent); a real, importable torchvision is left alone."""
    if "torchvision" in sys.modules:
        return
    mods = {n: _module(n) for n in _STUBS}
    mods["torchvision"].__version__ = "0.28.0"  # type: ignore[attr-defined]
    for n in (
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ):
        mods[n].InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    for n, m in mods.items():
        parent, _, leaf = n.rpartition(".")
        if parent:
            setattr(mods[parent], leaf, m)
        sys.modules[n] = m


def add_plugins_path() -> None:
    """``plugins/`` importable here and in child processes (worktrees are not installed)."""
    p = str(PLUGINS)
    if p not in sys.path:
        sys.path.insert(0, p)
    pp = os.environ.get("PYTHONPATH", "")
    if p not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = p + (os.pathsep + pp if pp else "")


def sglang_missing() -> str | None:
    """Why SGLang cannot be used here, or None.

    Only looks for the installed distribution: importing SGLang at collection time would set
    its environment variables and warning filters for every other test of the session too.
    """
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("sglang")
    except PackageNotFoundError:
        return "SGLang is not installed (scripts/setup.sh installs it; KVMESH_SKIP_SGLANG=1 skips)"
    if importlib.util.find_spec("sglang") is None:
        return f"SGLang {ver} is installed but not importable"
    return None
