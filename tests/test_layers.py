"""The layers of kvmesh stay honest: what may import what, over every import in the tree.

The layer order is docs/architecture.md's: ``kvmesh.errors`` and ``kvmesh.net`` at the bottom,
``kvmesh/launcher.py`` on ``net``, the transfer engine and the replicated log side by side (neither
knows the other), the store on all of them, the command-line tools and the demo on top, the
SGLang plugins above everything. Four rules, over the whole ``kvmesh`` package and ``plugins/``:

(a) layers import only downward, along the edges ``ALLOWED`` names; the store reaches the
    replicated log only through ``REPLOG_FACES`` (names in their ``__all__``), and the cores
    without I/O import no driver (``PURE``);
(b) no import cycles between modules;
(c) plugins import only public names: names in the ``__all__`` of a ``PLUGIN_FACES`` module;
(d) no module uses another module's private members (``from x import _y``, ``x._y`` on an
    imported module, ``obj._y`` where ``_y`` is defined only in another module, a private
    module imported from outside its package).

Every import counts: module level, inside functions, under ``if TYPE_CHECKING:`` (a type-only
or function-local cycle is still two modules that know each other's insides; both
``store/client.py`` <-> ``store/embedded.py`` and ``transfer/control.py`` <->
``transfer/transports/tcp.py`` hid that way). Each rule is first run on a planted violation in a
small tree built under ``tmp_path``, so a passing run over the real tree means something.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (top-level package, the directory holding it)
TREES = (("kvmesh", ROOT), ("kvmesh_sglang", ROOT / "plugins"))

# Layer of a module: the longest prefix below that names it (whole dotted components).
LAYER_OF = {
    "kvmesh.errors": "errors",
    "kvmesh.net": "net",
    "kvmesh.launcher": "launcher",
    "kvmesh.transfer": "transfer",
    "kvmesh.replog": "replog",
    "kvmesh.store": "store",
    "kvmesh.store.cli": "apps",
    "kvmesh.store.demo": "apps",
    "kvmesh.cli": "apps",
    "kvmesh": "apps",  # the package face: lazily exports StoreClient
    "kvmesh_sglang": "plugins",
}
# Which layers each layer may import (besides itself). Everything else is an upward or
# sideways edge: the transfer engine never learns about the log or the store, the log never
# about bytes, the master core never about the command line.
ALLOWED = {
    "errors": set(),
    "net": set(),
    "launcher": {"net"},
    "transfer": {"errors", "net"},
    "replog": {"errors", "net", "launcher"},
    "store": {"errors", "net", "launcher", "transfer", "replog"},
    "apps": {"errors", "net", "launcher", "transfer", "replog", "store"},
    "plugins": {"apps", "store", "transfer", "net", "errors"},
}
# The store uses the replicated log through its face (``kvmesh.replog.__all__``) and the
# simulator's hand-driven network; the log's drivers, storage and core are its own business.
REPLOG_FACES = ("kvmesh.replog", "kvmesh.replog.sim.harness")
# Cores without I/O import only their own package's pure modules (the drivers sit outside).
PURE = {
    "kvmesh.replog.core": ("kvmesh.replog.core", "kvmesh.replog.types", "kvmesh.replog.errors"),
    "kvmesh.store.master": (
        "kvmesh.store.master",
        "kvmesh.store.types",
        "kvmesh.store.errors",
        "kvmesh.replog",  # the state machine contract and snapshot chunking
        "kvmesh.replog.sim.harness",  # master/sim drives the core over the replog simulator
        "kvmesh.store.leader",  # ... and the production leader's decisions
        "kvmesh.store.tiering",  # (the disk tier's part of them)
    ),
    # The leader's soft state and decisions (the service and the simulator drive it).
    "kvmesh.store.leader": (
        "kvmesh.store.leader",
        "kvmesh.store.tiering",
        "kvmesh.store.master.*",  # ".*": the package and every module under it
        "kvmesh.store.types",
        "kvmesh.store.errors",
    ),
    # The disk tier's part of the leader (``leader.tiers``), under the same rule.
    "kvmesh.store.tiering": (
        "kvmesh.store.tiering",
        "kvmesh.store.leader",
        "kvmesh.store.master.*",
        "kvmesh.store.types",
        "kvmesh.store.errors",
    ),
}
# What a plugin may import: these modules, and the names in their __all__.
PLUGIN_FACES = (
    "kvmesh",
    "kvmesh.transfer",
    "kvmesh.store",
    "kvmesh.store.errors",
    "kvmesh.store.compat",
    "kvmesh.net",
)


# ---------------------------------------------------------------------------------------------
# The tree as data


@dataclasses.dataclass
class Module:
    name: str
    path: pathlib.Path
    tree: ast.Module
    is_pkg: bool

    @property
    def package(self) -> str:
        return self.name if self.is_pkg else self.name.rpartition(".")[0]


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of the tree
    name: str | None  # ``from target import name`` (name not a module); None: the module itself
    line: int


def load(trees=TREES) -> dict[str, Module]:
    mods = {}
    for top, base in trees:
        for path in sorted((base / top).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_pkg else parts)
            mods[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_pkg)
    return mods


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def imports(mod: Module, mods: dict[str, Module]) -> list[Import]:
    """Every import of a module of the tree anywhere in ``mod`` (functions, TYPE_CHECKING)."""
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in mods:
                    out.append(Import(mod.name, sub, None, node.lineno))
                elif target in mods:
                    out.append(Import(mod.name, target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in mods:
                    out.append(Import(mod.name, alias.name, None, node.lineno))
    return [i for i in out if i.target != mod.name]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> str:
    best = max((p for p in LAYER_OF if _under(name, p)), key=len, default=None)
    assert best is not None, f"{name} is in no layer: add it to LAYER_OF"
    return LAYER_OF[best]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _all_of(mod: Module) -> set[str] | None:
    for node in mod.tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return set(ast.literal_eval(node.value))
    return None


# ---------------------------------------------------------------------------------------------
# The rules: each returns its violations as readable lines, [] when the tree keeps it


def layer_violations(mods: dict[str, Module]) -> list[str]:
    bad = []
    for mod in mods.values():
        src = layer_of(mod.name)
        for imp in imports(mod, mods):
            dst = layer_of(imp.target)
            where = f"{mod.name}:{imp.line} imports {imp.target}"
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{where}: layer {src} may not import layer {dst}")
            for core, allowed in PURE.items():
                if _under(mod.name, core) and not any(
                    imp.target == a
                    or (a == core and _under(imp.target, a))
                    or (a.endswith(".*") and _under(imp.target, a[:-2]))
                    for a in allowed
                ):
                    bad.append(f"{where}: {core} is a core without I/O; it may import {allowed}")
    bad += face_violations(mods, "kvmesh.store", "kvmesh.replog", REPLOG_FACES)
    return sorted(set(bad))


def import_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {m: sorted({i.target for i in imports(mods[m], mods)}) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps = []

    def visit(v: str) -> None:  # the tree is shallow: recursion depth <= module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(comps)


def face_violations(
    mods: dict[str, Module], importer: str, reached: str, faces: tuple[str, ...]
) -> list[str]:
    """Imports by modules under ``importer`` of modules under ``reached`` that go past
    ``faces``: a module that is not a face, or a name not in the face's ``__all__``."""
    bad = []
    for mod in mods.values():
        if not _under(mod.name, importer):
            continue
        for imp in imports(mod, mods):
            if not _under(imp.target, reached) or _under(imp.target, importer):
                continue
            where = f"{mod.name}:{imp.line}"
            if imp.target not in faces:
                what = imp.target if imp.name is None else f"{imp.name} from {imp.target}"
                bad.append(f"{where} imports {what}: not through a public face {faces}")
            elif imp.name is not None and imp.name not in (_all_of(mods[imp.target]) or ()):
                bad.append(f"{where} imports {imp.name} from {imp.target}: not in its __all__")
    return sorted(set(bad))


def plugin_violations(mods: dict[str, Module]) -> list[str]:
    return face_violations(mods, "kvmesh_sglang", "kvmesh", PLUGIN_FACES)


def _walk_skipping_protocols(tree: ast.AST):
    """``ast.walk``, but not into ``class X(Protocol)`` bodies: a Protocol that lists another
    module's private members declares the reach-in, it does not own the names."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ClassDef) and any(
            (_dotted(b) or "").rpartition(".")[2] == "Protocol" for b in node.bases
        ):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _defined_privates(mod: Module) -> set[str]:
    """Private names a module defines: functions, classes, names, attributes it assigns."""
    out = set()
    for node in _walk_skipping_protocols(mod.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)  # msgspec/dataclass field given by keyword
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
    return {n for n in out if _private(n)}


def _module_names(mod: Module, mods: dict[str, Module]) -> dict[str, str]:
    """Local names (and dotted chains) bound to modules of the tree, anywhere in ``mod``."""
    bound = {}
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in mods:
                    bound[alias.asname or alias.name] = f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in mods:
                    bound[alias.asname or alias.name] = alias.name
    return bound


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def private_violations(mods: dict[str, Module]) -> list[str]:
    defined = {m: _defined_privates(mod) for m, mod in mods.items()}
    anywhere = set().union(*defined.values())
    bad = []
    for mod in mods.values():
        for imp in imports(mod, mods):
            where = f"{mod.name}:{imp.line}"
            hidden = [i for i, p in enumerate(imp.target.split(".")) if _private(p)]
            owner = ".".join(imp.target.split(".")[: hidden[0]]) if hidden else None
            if owner is not None and not _under(mod.name, owner):
                bad.append(f"{where} imports the private module {imp.target}")
            elif imp.name is not None and _private(imp.name) and owner is None:
                # (a private module's members are its package's: compat/_common.py's helpers)
                bad.append(f"{where} imports private {imp.name} from {imp.target}")
        bound = _module_names(mod, mods)
        for node in ast.walk(mod.tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            where = f"{mod.name}:{node.lineno}"
            chain = _dotted(node.value)
            if chain is not None:
                head, _, rest = chain.partition(".")
                target = bound.get(head, head if head in mods else None)
                target = f"{target}.{rest}" if target and rest else target
                if target in mods and target != mod.name:
                    if f"{target}.{node.attr}" not in mods or not _under(mod.name, target):
                        bad.append(f"{where} uses {target}.{node.attr}")
                    continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(node.value, ast.Call) and _dotted(node.value.func) == "super":
                continue
            if node.attr not in defined[mod.name] and node.attr in anywhere:
                owners = sorted(m for m, d in defined.items() if node.attr in d)
                bad.append(f"{where} uses {node.attr}, private to {', '.join(owners)}")
    return sorted(set(bad))


# ---------------------------------------------------------------------------------------------
# The checkers on planted violations first


def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, Module]:
    """A tiny tree of two top-level packages, ``kvmesh`` and ``kvmesh_sglang``."""
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for top in ("kvmesh", "kvmesh_sglang"):
        (tmp_path / top).mkdir(exist_ok=True)
        for d in [tmp_path / top, *(p for p in (tmp_path / top).rglob("*") if p.is_dir())]:
            (d / "__init__.py").touch()
    return load((("kvmesh", tmp_path), ("kvmesh_sglang", tmp_path)))


def test_planted_upward_and_sideways_imports_are_found(tmp_path):
    mods = _plant(
        tmp_path,
        {
            "kvmesh/transfer/engine.py": "def f():\n    from ..store import client\n",
            "kvmesh/replog/__init__.py": "__all__ = ['RaftNode']\n",
            "kvmesh/replog/node.py": "from kvmesh.transfer.engine import f\n",
            "kvmesh/replog/net/transport.py": "",
            "kvmesh/replog/core/raft.py": "from ..node import x\n",
            "kvmesh/store/client.py": "from ..replog.net.transport import parse_addr\n",
            "kvmesh/store/rpc.py": "from ..replog import RaftNode\nfrom ..replog import Hidden\n",
            "kvmesh/store/ok.py": "from ..transfer import engine\n",
        },
    )
    faces = REPLOG_FACES
    assert layer_violations(mods) == [
        "kvmesh.replog.core.raft:1 imports kvmesh.replog.node: kvmesh.replog.core is a core "
        "without I/O; it may import ('kvmesh.replog.core', 'kvmesh.replog.types', "
        "'kvmesh.replog.errors')",
        "kvmesh.replog.node:1 imports kvmesh.transfer.engine: layer replog may not import "
        "layer transfer",
        f"kvmesh.store.client:1 imports parse_addr from kvmesh.replog.net.transport: not "
        f"through a public face {faces}",
        "kvmesh.store.rpc:2 imports Hidden from kvmesh.replog: not in its __all__",
        "kvmesh.transfer.engine:2 imports kvmesh.store.client: layer transfer may not import "
        "layer store",
    ]


def test_planted_cycles_are_found_through_functions_and_type_checking(tmp_path):
    mods = _plant(
        tmp_path,
        {
            "kvmesh/store/a.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
            ),
            "kvmesh/store/b.py": "def f():\n    from . import c\n",
            "kvmesh/store/c.py": "import kvmesh.store.a\n",
            "kvmesh/store/d.py": "from .a import x\n",  # into the cycle, not part of it
            "kvmesh/store/e.py": "def g():\n    from .d import y\n",
        },
    )
    assert import_cycles(mods) == [["kvmesh.store.a", "kvmesh.store.b", "kvmesh.store.c"]]
    (tmp_path / "kvmesh/store/a.py").write_text("from .e import g\n")
    mods = load((("kvmesh", tmp_path),))
    assert import_cycles(mods) == [["kvmesh.store.a", "kvmesh.store.d", "kvmesh.store.e"]]


def test_planted_plugin_imports_of_private_names_are_found(tmp_path):
    mods = _plant(
        tmp_path,
        {
            "kvmesh/transfer/__init__.py": "__all__ = ['get_engine']\n",
            "kvmesh/transfer/cuda.py": "",
            "kvmesh/store/__init__.py": "__all__ = ['StoreClient', 'errors']\n",
            "kvmesh/store/errors.py": "__all__ = ['StoreError']\n",
            "kvmesh_sglang/pd.py": (
                "from kvmesh.transfer import get_engine\n"  # fine
                "from kvmesh.store import errors\n"  # fine: a face named in __all__
                "from kvmesh.store.errors import StoreError\n"  # fine
                "from kvmesh.transfer import cuda\n"
                "def f():\n    from kvmesh.transfer import parse_thing\n"
                "import kvmesh.transfer.cuda\n"
                "from kvmesh.store.errors import Code\n"
            ),
        },
    )
    faces = PLUGIN_FACES
    assert plugin_violations(mods) == [
        f"kvmesh_sglang.pd:4 imports kvmesh.transfer.cuda: not through a public face {faces}",
        "kvmesh_sglang.pd:6 imports parse_thing from kvmesh.transfer: not in its __all__",
        f"kvmesh_sglang.pd:7 imports kvmesh.transfer.cuda: not through a public face {faces}",
        "kvmesh_sglang.pd:8 imports Code from kvmesh.store.errors: not in its __all__",
    ]


def test_planted_private_reach_ins_are_found(tmp_path):
    mods = _plant(
        tmp_path,
        {
            "kvmesh/transfer/control.py": (
                "def _expect(x):\n    return x\nclass Agent:\n    def _check_open(self): ...\n"
            ),
            "kvmesh/transfer/tcp.py": (
                "from .control import _expect\n"
                "from . import control\n"
                "import kvmesh.transfer.control\n"
                "def f(agent):\n"
                "    control._expect(1)\n"
                "    kvmesh.transfer.control._expect(2)\n"
                "    agent._check_open()\n"
                "    self._mine = agent._mine\n"  # its own attribute name: not a reach-in
                "    return super()._check_open()\n"
            ),
            "kvmesh/store/compat/_common.py": "",
            # A private module's members are its package's to share:
            "kvmesh/store/compat/store.py": "from ._common import helper, _each\n",
            "kvmesh/store/client.py": "from .compat import _common\n",
            # A Protocol naming another module's privates declares the reach-in, not owns it:
            "kvmesh/transfer/xfer.py": (
                "from typing import Protocol\n"
                "class Owner(Protocol):\n"
                "    def _check_open(self) -> None: ...\n"
                "def post(agent: Owner):\n"
                "    agent._check_open()\n"
            ),
        },
    )
    assert private_violations(mods) == [
        "kvmesh.store.client:1 imports the private module kvmesh.store.compat._common",
        "kvmesh.transfer.tcp:1 imports private _expect from kvmesh.transfer.control",
        "kvmesh.transfer.tcp:5 uses kvmesh.transfer.control._expect",
        "kvmesh.transfer.tcp:6 uses kvmesh.transfer.control._expect",
        "kvmesh.transfer.tcp:7 uses _check_open, private to kvmesh.transfer.control",
        "kvmesh.transfer.xfer:5 uses _check_open, private to kvmesh.transfer.control",
    ]


# ---------------------------------------------------------------------------------------------
# The real tree


def test_every_module_has_a_layer():
    for name in load():
        layer_of(name)


def test_layers_import_only_downward():
    assert layer_violations(load()) == []


def test_no_import_cycles():
    assert import_cycles(load()) == []


def test_plugins_import_only_public_names():
    assert plugin_violations(load()) == []


def test_no_private_reach_ins():
    assert private_violations(load()) == []


_SHADOW_CHECK = """
import importlib, importlib.util, sys
bad = []
for face in sys.argv[1:]:
    mod = importlib.import_module(face)
    for name in mod.__all__:
        before = getattr(mod, name, None)
        if before is None:
            bad.append(f"{face}.__all__ names {name}, which it does not export")
        elif hasattr(mod, "__path__") and importlib.util.find_spec(f"{face}.{name}") and (
            importlib.import_module(f"{face}.{name}") is not getattr(mod, name)
            or before is not getattr(mod, name)
        ):
            bad.append(f"{face}.{name} changes once the submodule {face}.{name} is imported")
print(repr(bad))
"""


def face_export_problems(faces: tuple[str, ...], path: list[pathlib.Path]) -> list[str]:
    """Names a face's ``__all__`` promises but does not give, or gives only until a submodule
    of the same name is imported (``kvmesh.store.embedded`` was a function until the client
    imported the module ``kvmesh.store.embedded``). In a fresh interpreter: import order
    matters."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    out = subprocess.run(
        [sys.executable, "-c", _SHADOW_CHECK, *faces],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_planted_shadowed_export_is_found(tmp_path):
    pkg = tmp_path / "face"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "__all__ = ['thing', 'errors', 'missing']\n"
        "def thing():\n    return 1\n"
        "def __getattr__(name):\n"
        "    if name == 'errors':\n"
        "        import importlib\n"
        "        return importlib.import_module('.errors', __name__)\n"
        "    raise AttributeError(name)\n"
    )
    (pkg / "thing.py").write_text("")
    (pkg / "errors.py").write_text("")
    assert face_export_problems(("face",), [tmp_path]) == [
        "face.thing changes once the submodule face.thing is imported",
        "face.__all__ names missing, which it does not export",
    ]


def test_faces_export_what_they_name():
    faces = (*PLUGIN_FACES, *REPLOG_FACES)
    assert face_export_problems(faces, [ROOT, ROOT / "plugins"]) == []


# Kept from tests/transfer/test_structure.py: the batch knows only its context, and transport
# choice leaves segment state alone.


def test_batch_knows_only_its_context():
    src = (ROOT / "kvmesh/transfer/batch.py").read_text()
    tree = ast.parse(src)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "engine" not in imported and "TransferEngine" not in src
    ctx_uses = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ctx"
    }
    ctx_uses |= {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "_ctx"
    }
    assert ctx_uses <= {"config", "check_open", "is_registered", "route", "submit", "note_batch"}, (
        ctx_uses
    )


def test_select_leaves_segment_state_alone():
    tree = ast.parse((ROOT / "kvmesh/transfer/select.py").read_text())
    private = [
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    ]
    assert private == []
