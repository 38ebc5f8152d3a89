"""The import graph of kvpop_hf, read from the source with `ast` (nothing is imported): no cycle among the imports
that run when a module is imported, and no module of the library imports the laboratory.

Edges. Every ``import`` / ``from ... import`` naming a kvpop_hf module, relative ones resolved. ``from P import n``
is an edge to ``P.n`` where that is a module, else to ``P``. Importing ``a.b.c`` runs the ``__init__`` of ``a.b``
first, so the packages on the way are edges too, except the importer's own packages (already running when it
runs; counting them would make every package that imports its submodules a cycle).

Which imports count. *Module-level* imports (at the top of a module, in class bodies, ``try`` and ``if`` blocks,
but not under ``if TYPE_CHECKING:``) run while the module is being imported: a cycle among them hands one module
a half-initialised other (``ImportError: cannot import name ... from partially initialized module``, depending on
which module is imported first). They must form no cycle. *Function-level* imports (inside a ``def`` or
``lambda``) run when the function is first called, after both modules have finished importing: they are the
library's way to defer an optional or heavy dependency and do not fail this test; :func:`function_level_cycles`
lists the cycles they close, for review.
"""

from __future__ import annotations

import ast
from pathlib import Path
import pytest

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvpop_hf"
LABORATORY = ("kvpop_lab", "benchmarks")  # top-level names the library must never import


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every module under ``root / package`` (a package is its
    ``__init__.py``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules) -> list[str]:
    """The absolute dotted names an import statement of ``module`` refers to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _imports(tree: ast.Module):
    """``(import node, function_level)`` for every import statement of ``tree`` outside ``if TYPE_CHECKING:``."""
    def walk(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            child_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, child_lazy
            yield from walk(child, child_lazy)

    yield from walk(tree, False)


def import_graph(root: Path = ROOT, package: str = PACKAGE):
    """``(graph, external)``: ``graph[m][t]`` is ``"module"`` or ``"function"``, how ``m`` imports the package
    module ``t`` (module level wins); ``external[m]`` the top-level names of the other packages ``m`` imports."""
    modules = package_modules(root, package)
    graph, external = {}, {}
    for module, path in modules.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges, names = graph.setdefault(module, {}), external.setdefault(module, set())
        for node, lazy in _imports(ast.parse(path.read_text(), str(path))):
            for name in _imported_names(module, path.name == "__init__.py", node, modules):
                if name.split(".")[0] != package:
                    names.add(name.split(".")[0])
                    continue
                while name not in modules:  # an attribute of a module: the module
                    name = name.rpartition(".")[0]
                parts = name.split(".")
                ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
                for target in [name] + [a for a in ancestors if a not in own]:
                    if target != module and edges.get(target) != "module":
                        edges[target] = "function" if lazy else "module"
    return graph, external


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def module_level_cycles(graph) -> list[list[str]]:
    return cycles({m: [t for t, kind in edges.items() if kind == "module"] for m, edges in graph.items()})


def function_level_cycles(graph) -> list[list[str]]:
    """The cycles that appear once function-level imports count too (not a failure: see the module docstring)."""
    strict = {tuple(c) for c in module_level_cycles(graph)}
    return [c for c in cycles({m: list(edges) for m, edges in graph.items()}) if tuple(c) not in strict]


def test_no_cycle_among_module_level_imports():
    graph, _ = import_graph()
    assert len(graph) > 50 and "kvpop_hf.cache" in graph["kvpop_hf.warm_compile"]  # the graph was read
    found = module_level_cycles(graph)
    assert not found, "import cycles among module-level imports (break them with a leaf module):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_library_imports_no_laboratory_code():
    _, external = import_graph()
    bad = sorted(f"{m} imports {n}" for m, names in external.items() for n in names if n in LABORATORY)
    assert not bad, bad


def test_the_graph_sees_cycles_relative_imports_and_packages_on_the_way(tmp_path):
    """The checker on a made-up package: a module-level cycle through a package ``__init__`` reached on the way
    is found, a function-level one is told apart, ``TYPE_CHECKING`` imports are skipped and other packages are
    listed."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .sub.b import x\nimport benchmarks.tool\n",
        "pkg/sub/__init__.py": "from ..a import y\n",  # a -> sub/__init__ (on the way to sub.b) -> a
        "pkg/sub/b.py": "from .. import c\nx = 1\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import z\n"
                    "def f():\n    from .d import z\n",
        "pkg/d.py": "from . import c\n",  # d -> c at module level, c -> d only in a function
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph, external = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.c": "module"}  # `from .. import c`: the module, not the package
    assert graph["pkg.c"] == {"pkg.d": "function"}
    assert module_level_cycles(graph) == [["pkg.a", "pkg.sub"]]
    assert function_level_cycles(graph) == [["pkg.c", "pkg.d"]]
    assert external["pkg.a"] == {"benchmarks"}


def test_the_laboratory_has_no_import_cycle():
    """kvpop_lab (benchmarks/): no cycle, module- or function-level."""
    graph, _ = import_graph(ROOT / "benchmarks", "kvpop_lab")
    assert "kvpop_lab.testbed.qkv" in graph["kvpop_lab.testbed.oracle"]  # the graph was read
    found = module_level_cycles(graph) + function_level_cycles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)
