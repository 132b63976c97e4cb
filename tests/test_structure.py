"""The layout rules of the tree, checked from the source: no module imports in a circle (module-level or inside a
function), and no private `_name` is imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"vitserve": "vitserve", "encoder": "vitserve.encoder", "service": "vitserve.service"}  # folder: package


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = (*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import of this tree's modules in `path`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from . import spool` imports a module
                sub = f"{base}.{alias.name}"
                out.append((sub, []) if sub in known else (base, [alias.name]))
        elif isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
    return [(m, names) for m, names in out if m in known and m != name]


def test_no_module_imports_in_a_circle():
    known = modules()
    graph = {name: {m for m, _ in imports(name, path, known)} for name, path in known.items()}
    for name in graph:  # a package imports its own modules (lazily in encoder/__init__): not a cycle of two jobs
        graph[name] -= {m for m in graph[name] if m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]):
        state[name] = 1
        for target in sorted(graph[name]):
            assert state.get(target) != 1, "import cycle: " + " -> ".join([*trail, name, target])
            if target not in state:
                visit(target, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_no_private_name_is_imported_across_modules():
    known = modules()
    private = [(name, m, n) for name, path in known.items() for m, names in imports(name, path, known) for n in names
               if n.startswith("_") and not n.startswith("__")]
    assert private == []
