"""Module structure of kvmesh.transfer: no import cycles, batches never reach into the engine.

Imports under ``if TYPE_CHECKING:`` count too: a type-only cycle is still two modules that
know each other's insides (batch.py <-> engine.py was one). The checker is tried on a planted
cycle first, so a passing run means something.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    base = root / package.replace(".", "/")
    out = {}
    for path in base.rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """Modules of ``known`` that ``name`` imports at module level (TYPE_CHECKING included)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    parts = here.split(".")
                    target = ".".join(parts[: len(parts) - n.level + 1])
                    target = f"{target}.{n.module}" if n.module else target
                else:
                    target = n.module or ""
                for alias in n.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in known else target)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
    return {d for d in deps if d in known and d != name}


def find_cycles(root: pathlib.Path, package: str) -> list[list[str]]:
    known = _modules(root, package)
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    cycles = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for dep in sorted(graph[node]):
            if dep == start:
                cycles.append(path)
            elif dep not in path and dep > start:  # each cycle once, from its least module
                walk(start, dep, [*path, dep])

    for m in sorted(graph):
        walk(m, m, [m])
    return cycles


def test_the_checker_finds_a_type_only_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from .a import x\n")
    assert find_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.b"]]


def test_no_import_cycles_in_transfer():
    assert find_cycles(ROOT, "kvmesh.transfer") == []


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
