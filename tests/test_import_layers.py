"""The layers of kvpop_hf, read from the source with `ast` (nothing is imported; the parser is
tests/test_import_graph.py's): every import statement at any depth (module level, in functions, in ``try``/``if``
blocks; relative ones resolved) counts, and so does a string naming a baseline module (``import_module`` paths, a
lazy-name table, a ``"module:Class"`` registry entry).

* ``ops/`` (the kernels and their torch references) is the bottom layer: it imports nothing from ``trainer/``,
  ``scorers/``, ``baselines/`` or ``integrations/``, neither directly nor through the modules it imports.
* The baselines are plugins: nothing outside ``baselines/`` imports a baseline module, except the offenders named in
  :data:`BASELINE_IMPORTERS` (issue 68 item 2 removes them; a new one fails the test, and so does an entry that no
  longer holds, so the list only shrinks).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from test_import_graph import ROOT, _imported_names, _imports, import_graph, package_modules

pytestmark = pytest.mark.tier("unit")

PACKAGE = "kvpop_hf"
OPS = "ops"
ABOVE_OPS = ("trainer", "scorers", "baselines", "integrations")
BASELINES = "baselines"

# (importer, baseline module it imports): today's imports of a baseline from outside kvpop_hf/baselines/
BASELINE_IMPORTERS = {
    ("kvpop_hf", "kvpop_hf.baselines"): "`from . import baselines` registers the baselines' scorer names",
    ("kvpop_hf", "kvpop_hf.baselines.dms"): "the lazy public name DMSCache ('.baselines.dms' in _LAZY)",
    ("kvpop_hf.cli.train_dms", "kvpop_hf.baselines.dms"): "kvpop-train-dms: target_eviction_rate",
    ("kvpop_hf.cli.train_dms", "kvpop_hf.baselines.dms.trainer"): "kvpop-train-dms: DMSTrainer",
    ("kvpop_hf.policies", "kvpop_hf.baselines.dms"): "the 'dms' policy builds and loads a DMSCache",
}

_MODULE_STRING = re.compile(r"(\.*)([A-Za-z_]\w*(?:\.\w+)*)(?::\w+)?")  # [dots] dotted.name [:attr]


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def direct_imports(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """``module -> {package module it imports}`` (an imported attribute counts as its module), from every import
    statement of the module, wherever it stands, and from every string constant that reads as a module path of the
    package (absolute, or relative to the module's package, with an optional ``:attr``)."""
    modules = package_modules(root, package)
    found = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        names = [n for node, _ in _imports(tree) for n in _imported_names(module, is_package, node, modules)]
        for node in ast.walk(tree):  # a string counts where it names a module exactly
            match = isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                _MODULE_STRING.fullmatch(node.value)
            if match:
                dots, rest = match.groups()
                if dots:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    rest = ".".join(parts[:len(parts) - (len(dots) - 1)] + [rest])
                if rest in modules:
                    names.append(rest)
        targets = found.setdefault(module, set())
        for name in names:
            if not _in(name, package):
                continue
            while name not in modules and "." in name:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name in modules and name != module:
                targets.add(name)
    return found


def _reachable(graph: dict[str, dict[str, str]], start: str) -> dict[str, str | None]:
    """Every module ``start`` imports directly or through others (module- and function-level imports) ->
    the module it is imported from."""
    came_from, stack = {start: None}, [start]
    while stack:
        node = stack.pop()
        for target in graph.get(node, ()):
            if target not in came_from:
                came_from[target] = node
                stack.append(target)
    return came_from


def ops_violations(root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    """``ops/``'s imports of a higher layer: direct ones, then indirect ones with the chain that leads there."""
    ops, above = f"{package}.{OPS}", [f"{package}.{name}" for name in ABOVE_OPS]
    bad = [f"{m} imports {t}" for m, targets in sorted(direct_imports(root, package).items()) if _in(m, ops)
           for t in sorted(targets) if any(_in(t, a) for a in above)]
    graph, _ = import_graph(root, package)
    for module in sorted(m for m in graph if _in(m, ops)):
        came_from = _reachable(graph, module)
        for target in sorted(t for t in came_from if any(_in(t, a) for a in above)):
            chain = [target]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            # the first module of a higher layer on the way (an ops module's own import is listed above)
            if not _in(chain[1], ops) and not any(_in(n, a) for n in chain[1:-1] for a in above):
                bad.append(" -> ".join(reversed(chain)))
    return bad


def baseline_importers(root: Path = ROOT, package: str = PACKAGE) -> set[tuple[str, str]]:
    """``(importer, baseline module)`` for every import of ``baselines/`` from outside it."""
    baselines = f"{package}.{BASELINES}"
    return {(m, t) for m, targets in direct_imports(root, package).items() if not _in(m, baselines)
            for t in targets if _in(t, baselines)}


def test_ops_imports_no_higher_layer():
    modules = package_modules()
    assert "kvpop_hf.ops.sparse_attention" in modules and "kvpop_hf.ops.mlstm_decode" in modules  # the tree was read
    bad = ops_violations()
    assert not bad, "kvpop_hf/ops/ must import nothing from " + ", ".join(f"{n}/" for n in ABOVE_OPS) + \
        " (move the piece it needs down into ops/):\n" + "\n".join(bad)


def test_no_kernel_module_outside_ops():
    """The kernel modules moved into ops/ (issue 68) have no namesake left in the trainer or the scorers."""
    modules = package_modules()
    old = ["kvpop_hf.trainer.sparse_attention", "kvpop_hf.trainer.block_masks", "kvpop_hf.trainer.interval_layout",
           "kvpop_hf.scorers.mlstm_decode_triton", "kvpop_hf.scorers.mlstm_ops"]
    assert not [m for m in old if m in modules]


def test_only_the_named_offenders_import_a_baseline_from_outside_baselines():
    found = baseline_importers()
    new = sorted(found - set(BASELINE_IMPORTERS))
    assert not new, ("the baselines are plugins: nothing outside kvpop_hf/baselines/ may import one (reach it "
                     "through a registry, by name):\n" + "\n".join(f"{m} imports {t}" for m, t in new))
    gone = sorted(set(BASELINE_IMPORTERS) - found)
    assert not gone, "no longer imported; remove from BASELINE_IMPORTERS: " + ", ".join(map(str, gone))


def test_the_checker_sees_lazy_relative_indirect_and_string_imports(tmp_path):
    """The checker on a made-up package: a function-level relative import from ops/ into the trainer, an indirect
    one through a module outside ops/, and baseline imports by statement and by string are all found."""
    files = {
        "pkg/__init__.py": "from importlib import import_module\nLAZY = {'Cache': '.baselines.dms'}\n",
        "pkg/ops/__init__.py": "",
        "pkg/ops/a.py": "def f():\n    from ..trainer.loss import g\n",
        "pkg/ops/b.py": "from .. import helpers\n",
        "pkg/helpers.py": "import pkg.scorers.mlp\n",
        "pkg/trainer/__init__.py": "",
        "pkg/trainer/loss.py": "g = 1\n",
        "pkg/scorers/__init__.py": "",
        "pkg/scorers/mlp.py": "REG = 'pkg.baselines.dms:DMSCache'\n",
        "pkg/baselines/__init__.py": "from .dms import DMSCache\n",
        "pkg/baselines/dms.py": "DMSCache = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert ops_violations(tmp_path, "pkg") == ["pkg.ops.a imports pkg.trainer.loss",
                                               "pkg.ops.b -> pkg.helpers -> pkg.scorers",
                                               "pkg.ops.b -> pkg.helpers -> pkg.scorers.mlp"]
    assert baseline_importers(tmp_path, "pkg") == {("pkg", "pkg.baselines.dms"), ("pkg.scorers.mlp", "pkg.baselines.dms")}
