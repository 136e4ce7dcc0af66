"""Private torch internals are reached through :mod:`graphckpt.torch_compat` alone.

Every module under ``graphckpt/`` is read (not imported) and each use of a private torch
name outside the compat module fails the test, naming ``file:line``. A use is: importing a
torch module with a private part (``torch._dynamo``, ``torch.utils._pytree``) or a private
name from torch (``_NormBase``); a private attribute (``_x``, not dunders) of something
imported from torch (``torch._ops``); a private attribute the project does not define
itself (``module._modules``, ``tensor.untyped_storage()._cdata``), also through
``getattr``; and the few attributes private to torch that do not start with ``_``
(``SymNode.hint``, the profiler's event internals).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import graphckpt

PACKAGE = Path(graphckpt.__file__).parent
ROOT = PACKAGE.parent
COMPAT = set((PACKAGE / "torch_compat").glob("*.py"))

# Torch-private attributes that are always flagged, whatever the project defines.
PRIVATE_TORCH_ATTRIBUTES = frozenset({
    "_cdata", "_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_codegen", "_schema",
    "_is_profiler_enabled", "_memory_profile",
})
# Attributes private to torch's internals although their names look public.
INTERNAL_ATTRIBUTES = frozenset({"hint", "require_hint", "kineto_results", "experimental_event_tree",
                                 "extra_fields", "alloc_size"})
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_private(part) for part in parts)


def _project_names(files: list[Path]) -> set[str]:
    """Private names the project defines (functions, classes, attributes it assigns,
    arguments): reaching one of these is not reaching into torch."""
    names: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {name for name in names if _private(name)} - PRIVATE_TORCH_ATTRIBUTES


def _torch_names(tree: ast.AST) -> set[str]:
    """Local names bound to torch or something imported from it (``torch``, ``fx``, ``nn``)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            bound.update(a.asname or a.name for a in node.names)
    return bound


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _offending_attribute(name: str, own: set[str]) -> bool:
    return name in PRIVATE_TORCH_ATTRIBUTES or name in INTERNAL_ATTRIBUTES or (_private(name) and name not in own)


def private_uses(source: str, own: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each use of a private torch name in ``source``; ``own`` are the
    private names the project defines itself."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if _private_module(node.module or ""):
                yield node.lineno, f"from {node.module} import ..."
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Attribute):
            if (_private(node.attr) and _root(node) in torch_names) or _offending_attribute(node.attr, own):
                yield node.lineno, f"attribute .{node.attr} ({ast.unparse(node)})"
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            literal = node.args[1] if name in ATTRIBUTE_FUNCTIONS and len(node.args) > 1 else \
                node.args[0] if name in ("import_module", "__import__") and node.args else None
            if not (isinstance(literal, ast.Constant) and isinstance(literal.value, str)):
                continue
            if name in ATTRIBUTE_FUNCTIONS and _offending_attribute(literal.value, own):
                yield node.lineno, f"{name}(..., {literal.value!r})"
            elif name not in ATTRIBUTE_FUNCTIONS and _private_module(literal.value):
                yield node.lineno, f"{name}({literal.value!r})"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_only_the_compat_module_touches_private_torch_names() -> None:
    files = _modules()
    own = _project_names([*files, *sorted((ROOT / "passes").glob("*.py"))])
    found = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in files if path not in COMPAT
             for line, what in sorted(private_uses(path.read_text(), own))]
    assert not found, ("private torch names used outside graphckpt/torch_compat/ (add a named function "
                       "there, with the torch versions it was checked on):\n" + "\n".join(found))


def test_the_compat_module_exists_and_uses_private_names() -> None:
    """The scan sees what it is meant to see: the compat package is full of them, in each module."""
    assert len(COMPAT) >= 2
    uses = {path.name: len(list(private_uses(path.read_text(), set()))) for path in COMPAT}
    assert sum(uses.values()) >= 10 and all(uses.values()), uses


def test_the_scan_catches_each_kind_of_use() -> None:
    own = {"_follow"}
    flagged = {
        "import torch._dynamo": 1,
        "from torch._subclasses.fake_tensor import FakeTensor": 1,
        "from torch.nn.modules.batchnorm import _NormBase": 1,
        "import torch\nx = torch._ops.OpOverload": 1,
        "from torch import fx\nfx.Graph()._codegen": 1,
        "def f(t):\n    return t.untyped_storage()._cdata": 1,
        "def f(m):\n    return m._modules": 1,
        "def f(v):\n    return v.node.hint": 1,
        "def f(m):\n    return getattr(m, '_buffers')": 1,
        "def f(prof):\n    return prof.profiler.kineto_results": 1,
        "import importlib\nimportlib.import_module('torch._functorch.config')": 1,
    }
    for source, count in flagged.items():
        assert len(list(private_uses(source, own))) == count, source
    clean = ["import torch\nx = torch.nn.Linear(2, 2)\nv = torch.__version__",
             "class A:\n    def _follow(self):\n        return self._follow()",
             "from torch.utils.checkpoint import checkpoint",
             "def f(m):\n    return getattr(m, 'inplace', False)"]
    for source in clean:
        assert not list(private_uses(source, own)), source
