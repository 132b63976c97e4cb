"""The layout rules of the tree, checked from the source: no module imports in a circle (module-level or inside a
function), imports run one way down the service's layers (each folder of vitserve/service/ is one), no private
`_name` is imported from another module, and the service's modules and functions stay small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vitserve"
# the service's layers, from the top: each imports only from itself and the layers below it, and the library
# (vitserve.encoder) below them all imports none of them (docs/architecture.md)
LAYERS = ("entry", "tiers", "api", "pipeline", "devices", "decoding", "ground")
MAX_MODULE_LINES = 360  # a service module
MAX_FUNCTION_LINES = 60  # a service function, its docstring included


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("vitserve", *path.relative_to(PACKAGE).with_suffix("").parts)
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
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from . import spool` imports a module
                sub = f"{base}.{alias.name}"
                out.append((sub, []) if sub in known else (base, [alias.name]))
        elif isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
    return [(m, names) for m, names in out if m in known and m != name]


def layer(name: str) -> int | None:
    """The module's depth: its service layer's index, len(LAYERS) for the library; None for the package's own top
    modules (vitserve, its __main__, client and consumers), which stand beside the layers."""
    parts = name.split(".")
    if parts[1:2] == ["encoder"]:
        return len(LAYERS)
    if parts[1:2] == ["service"] and len(parts) > 2:
        return LAYERS.index(parts[2])
    return None


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


def test_every_service_module_is_in_a_layer_folder():
    service = PACKAGE / "service"
    assert {p.name for p in service.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    assert [p.name for p in service.glob("*.py")] == ["__init__.py"]


def test_imports_run_down_the_layers():
    """No module imports from a layer above its own, the library imports nothing of the service, and nothing in the
    layers imports the package's top modules (the package itself only for its version)."""
    known = modules()
    upward = []
    for name, path in sorted(known.items()):
        own = layer(name)
        if own is None:
            continue
        for target, names in imports(name, path, known):
            depth = layer(target)
            if (
                depth is None
                and not (target == "vitserve" and names == ["__version__"])
                or depth is not None
                and depth < own
            ):
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_private_name_is_imported_across_modules():
    known = modules()
    private = [
        (name, m, n)
        for name, path in known.items()
        for m, names in imports(name, path, known)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == []


def test_service_modules_and_functions_are_small():
    """Every module of the service within MAX_MODULE_LINES, every function (a method too) within
    MAX_FUNCTION_LINES."""
    large, long = [], []
    for path in sorted((PACKAGE / "service").rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(PACKAGE)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            large.append(f"{where}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    assert large == [] and long == []
