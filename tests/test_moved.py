"""Old import paths of moved modules give the very same module objects (graphpar/_moved.py)."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import runpy
import sys

import pytest

from graphpar import _moved
from tests.optional import installed, needs


@pytest.fixture
def old_core(monkeypatch):
    monkeypatch.setitem(_moved.MOVED, "graphpar._old_core", "graphpar.core")
    yield "graphpar._old_core"
    for name in [n for n in sys.modules if n.startswith("graphpar._old_core")]:
        del sys.modules[name]


def test_an_old_name_is_the_module_at_its_new_name(old_core):
    import graphpar.core.ir

    old = importlib.import_module(old_core)
    assert old is importlib.import_module("graphpar.core")
    assert importlib.import_module(f"{old_core}.ir") is graphpar.core.ir
    assert graphpar.core.ir.__spec__.name == "graphpar.core.ir"  # the module keeps its own spec
    assert old.__spec__.name == "graphpar.core"


def test_from_import_of_an_old_name_works(old_core):
    from graphpar._old_core.ir import NetDef
    from graphpar.core.ir import NetDef as new_netdef

    assert NetDef is new_netdef


NEED_YACS = {"graphpar.config", "graphpar.defaults"}  # yacs' CfgNode


@pytest.mark.parametrize("old", [pytest.param(old, marks=needs("yacs", old) if old in NEED_YACS else ())
                                 for old in sorted(_moved.MOVED)])
def test_every_moved_name_imports_as_its_new_module(old):
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


def test_only_the_moved_name_and_its_submodules_are_mapped(old_core):
    assert _moved.new_name("graphpar._old_core.ir.x") == "graphpar.core.ir.x"
    assert _moved.new_name("graphpar._old_coreX") is None
    assert _moved.new_name("graphpar.core") is None


def test_python_dash_m_runs_a_moved_module(monkeypatch):
    monkeypatch.setitem(_moved.MOVED, "graphpar._old_errors", "graphpar.errors")
    names = runpy.run_module("graphpar._old_errors", run_name="__main__")
    assert names["__name__"] == "__main__" and "UnknownOperatorError" in names


def test_no_moved_module_leaves_a_file_at_its_old_path():
    """The finder answers for old names first, so a module left there would never be imported."""
    root = pathlib.Path(_moved.__file__).parent.parent
    left = [old for old in _moved.MOVED if root.joinpath(*old.split(".")).with_suffix(".py").exists()
            or root.joinpath(*old.split("."), "__init__.py").exists()]
    assert left == []


def _stub(old: str, new: str) -> str:
    lines = [f'"""`{old}` for static tools: the old path of `{new}` (graphpar/_moved.py)."""', "",
             f"from {new} import *  # noqa: F403"]
    if "__getattr__" in vars(importlib.import_module(new)):  # names the module makes on first use
        lines.append(f"from {new} import __getattr__ as __getattr__")
    return "\n".join(lines) + "\n"


def _old_paths() -> dict[str, str]:
    """Every old module name (a moved package's submodules too) -> its new name."""
    paths = {}
    for old, new in _moved.MOVED.items():
        if old in NEED_YACS and not installed("yacs"):  # checked where yacs is (CI)
            continue
        paths[old] = new
        module = importlib.import_module(new)
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            paths[f"{old}.{info.name}"] = f"{new}.{info.name}"
    return paths


def test_every_old_path_has_a_stub_that_static_tools_resolve():
    """mypy, pyright and IDEs do not run the finder: a stub at each old path re-exports the new module
    (its public names, and its module `__getattr__`), so `from graphpar.workspace import FeedBlob` type-checks."""
    root = pathlib.Path(_moved.__file__).parent.parent
    wrong = {}
    for old, new in _old_paths().items():
        path = root.joinpath(*old.split("."))
        is_package = hasattr(importlib.import_module(new), "__path__")
        stub = path / "__init__.pyi" if is_package else path.with_suffix(".pyi")
        expected = _stub(old, new)
        if not stub.exists() or stub.read_text() != expected:
            wrong[str(stub.relative_to(root))] = expected
    assert wrong == {}, "write these stubs:\n" + "\n".join(f"{k}:\n{v}" for k, v in wrong.items())
    assert (root / "graphpar" / "py.typed").exists()  # PEP 561: installed graphpar's hints and stubs are read
