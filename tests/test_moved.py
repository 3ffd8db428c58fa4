"""Old import paths of moved modules give the very same module objects (graphpar/_moved.py)."""

from __future__ import annotations

import importlib
import pathlib
import runpy
import sys

import pytest

from graphpar import _moved
from tests.optional import needs


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
    """The finder answers for old names first, so a file left there would never be imported."""
    root = pathlib.Path(_moved.__file__).parent.parent
    left = [old for old in _moved.MOVED
            if root.joinpath(*old.split(".")).with_suffix(".py").exists() or root.joinpath(*old.split(".")).is_dir()]
    assert left == []
