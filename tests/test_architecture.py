"""The shape of the code, checked: no import circle, ``passes`` free of torch, one home per name.

Read from the source with :mod:`ast` (imports inside functions included), so a lazy import
cannot hide a circle and nothing here depends on what happens to be imported already.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("passes", "graphckpt")

# Public names known to clash while a rename is under way (none today).
TODO_CLASHES: set[str] = set()


def modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` an import statement in ``module`` loads by name: ``from a
    import b`` loads the module ``a.b`` when there is one, else takes ``b`` from ``a``."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & set(known)
    base = node.module or ""
    if node.level:  # relative: from the package holding ``module``
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names} & set(known)


def import_graph() -> nx.DiGraph:
    """Module -> module it imports, for every import statement anywhere in the packages
    (the packages a module sits in are not counted: importing one runs them first anyway)."""
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph.add_edges_from((module, target) for target in _imported(module, path, node, known)
                                     if target != module)
    return graph


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert graph.number_of_edges() > 20, "the import graph looks empty: is the scan broken?"
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, "import cycle(s): " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_passes_never_import_torch() -> None:
    passes = sorted(name for name in modules() if name.split(".")[0] == "passes")
    code = (f"import importlib, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            f"for name in {passes!r}:\n    importlib.import_module(name)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(','.join(loaded))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, f"importing the passes failed: {result.stderr[-2000:]}"
    assert result.stdout.strip() == "", f"importing passes loaded torch: {result.stdout.strip()[:200]}"


def public_definitions() -> dict[str, list[str]]:
    """Public (no leading underscore) top-level functions, classes and assigned names, with
    the modules defining each."""
    defined: dict[str, list[str]] = defaultdict(list)
    for module, path in modules().items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [target.id for target in node.targets if isinstance(target, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                names = []
            for name in names:
                if not name.startswith("_"):
                    defined[name].append(module)
    return defined


def test_no_public_name_is_defined_twice() -> None:
    twice = {name: where for name, where in public_definitions().items() if len(where) > 1}
    clashes = {name: where for name, where in twice.items() if name not in TODO_CLASHES}
    assert not clashes, "defined in several modules: " + "; ".join(
        f"{name} in {', '.join(where)}" for name, where in sorted(clashes.items()))
    stale = TODO_CLASHES - set(twice)
    assert not stale, f"no longer clashing, remove from TODO_CLASHES: {sorted(stale)}"
