"""The package's layers (docs/architecture.md): every import in graphpar/ goes down the table below.

Every module is read with `ast` (module-level and function-level imports, and string literals given to
`importlib.import_module`); an import under `if TYPE_CHECKING:` only names a type for an annotation and
never runs, so it is not checked. Old paths of moved modules count as their new ones (graphpar/_moved.py).
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

from graphpar import _moved

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "graphpar"

# Which layer a module is in: the longest matching prefix of its dotted name.
LAYER_OF = {
    "graphpar": "root",  # lazy re-exports of the public modules and names: may import anything
    "graphpar._moved": "base",
    "graphpar._providers": "base",
    "graphpar.errors": "base",
    "graphpar.core": "core",
    "graphpar.platform": "platform",
    "graphpar.ops": "ops",
    "graphpar.executor": "executor",
    "graphpar.passes": "passes",
    "graphpar.runtime": "runtime",
    "graphpar.model": "model",
    "graphpar.models": "models",
    "graphpar.parallel": "parallel",
    "graphpar.training": "training",
    "graphpar.examples": "examples",
    "graphpar.caffe2": "caffe2",
}

_UNDER_RUNTIME = {"base", "core", "platform", "ops", "executor", "passes"}
# What each layer may import besides itself.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "core": {"base"},  # the IR, schemas, naming, dataflow: no kernels, no execution, no Caffe2 protobufs
    "platform": {"base", "core"},  # logical devices and the process group
    "ops": {"base", "core", "platform"},  # kernels register into core's schemas
    "executor": {"base", "core", "platform"},  # runs plans; kernels come through the schema, not ops
    "passes": {"base", "core", "platform"},  # rewrite nets, never execute: no executor, runtime or ops
    "runtime": _UNDER_RUNTIME,  # workspaces, checkpoints, introspection
    "model": _UNDER_RUNTIME | {"runtime"},  # ModelHelper, brew, optimizers
    "models": _UNDER_RUNTIME | {"runtime", "model"},  # the model zoo
    "parallel": _UNDER_RUNTIME | {"runtime", "model"},  # Parallelize and its runs, processes
    "training": _UNDER_RUNTIME | {"runtime", "model", "models", "parallel"},  # feeding, the Trainer
    "examples": _UNDER_RUNTIME | {"runtime", "model", "models", "parallel", "training"},
    "caffe2": set(LAYER_OF.values()) - {"root"},  # Caffe2's surface over everything
    "root": set(LAYER_OF.values()),
}



def layer_of(module: str) -> str | None:
    module = _moved.new_name(module) or module
    prefixes = [p for p in LAYER_OF if module == p or module.startswith(p + ".")]
    return LAYER_OF[max(prefixes, key=len)] if prefixes else None


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*(_moved.new_name(name) or name).split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The graphpar modules that `node` imports (a name imported from a package counts as its submodule
    when it is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
            base = ".".join(parts + ([node.module] if node.module else []))
        return [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
    if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def _scan(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported graphpar module) of every import in `tree`, but those under `if TYPE_CHECKING:`."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        found += [(node.lineno, t) for t in _imported(node, module, is_package)
                  if t == "graphpar" or t.startswith("graphpar.")]
        stack.extend(node.orelse if _type_checking(node) else ast.iter_child_nodes(node))
    return found


def imports() -> list[tuple[str, str, int, str]]:
    """(file, importing module, line, imported graphpar module) for every import in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        found += [(str(path.relative_to(PACKAGE.parent)), module, line, target)
                  for line, target in _scan(tree, module, path.name == "__init__.py")]
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({m for _, m, _, _ in imports()} | {_module_name(p) for p in PACKAGE.rglob("*.py")})
    assert [m for m in unplaced if layer_of(m) is None] == []


def test_every_import_goes_down_the_layers() -> None:
    violations = []
    for file, module, line, target in imports():
        source, dest = layer_of(module), layer_of(target)
        if dest is None or source == dest or dest in ALLOWED[source]:
            continue
        violations.append(f"{file}:{line}: {module} ({source}) imports {target} ({dest}); "
                          f"{source} may import only {sorted(ALLOWED[source])}")
    assert not violations, "\n".join(violations)


def test_the_subpackages_import_each_other_without_cycles() -> None:
    graph = nx.DiGraph()
    for file, module, line, target in imports():
        source, dest = layer_of(module), layer_of(target)
        if source not in (dest, "root") and dest is not None:
            graph.add_edge(source, dest, where=f"{file}:{line}")
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, [[(a, b, graph.edges[a, b]["where"]) for a, b in zip(c, c[1:] + c[:1])] for c in cycles]


@pytest.mark.parametrize("rule", sorted(ALLOWED))
def test_the_table_names_only_layers(rule) -> None:
    assert ALLOWED[rule] <= set(LAYER_OF.values())


def test_the_scan_sees_function_level_and_string_imports_but_not_annotations() -> None:
    source = ("from typing import TYPE_CHECKING\nimport importlib\nif TYPE_CHECKING:\n"
              "    from graphpar.model import model_helper\n"
              "def f():\n    from graphpar.runtime import workspace\n"
              "    return importlib.import_module('graphpar.training.data')\n")
    found = _scan(ast.parse(source), "graphpar.passes.x", False)
    assert sorted(found) == [(6, "graphpar.runtime.workspace"), (7, "graphpar.training.data")]
