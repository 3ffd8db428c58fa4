"""`graphpar/core` is the bottom layer: no module of it imports the operator library, Caffe2's layer,
the executor, the passes or the workspace, not even inside a function (the package root wires operators
and protobuf conversion into core instead), and `import graphpar.core` stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import graphpar.core

CORE = Path(graphpar.core.__file__).parent
FORBIDDEN = ("graphpar.ops", "graphpar.proto", "graphpar.caffe2", "graphpar.executor", "graphpar.passes",
             "graphpar.workspace")


def _imported(tree: ast.AST) -> list[str]:
    """Every module an import statement anywhere in `tree` names (`from a import b` gives a and a.b)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_imports_no_upper_layer(path: Path) -> None:
    bad = [name for name in _imported(ast.parse(path.read_text())) if _forbidden(name)]
    assert not bad, f"graphpar/core/{path.relative_to(CORE)} imports {bad}"


def test_the_scan_sees_imports_inside_functions() -> None:
    tree = ast.parse("def f():\n    from graphpar import ops\n    import graphpar.caffe2.plan\n")
    assert [n for n in _imported(tree) if _forbidden(n)] == ["graphpar.ops", "graphpar.caffe2.plan"]


def test_import_core_is_torch_free_and_records_ops() -> None:
    code = ("import sys, graphpar.core as core; assert 'torch' not in sys.modules; "
            "assert not any(m.startswith('graphpar.ops') for m in sys.modules); "
            "n = core.Net('n'); n.Relu('x', 'y'); print(n.Proto().ops[0].type, core.Plan.__module__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Relu", "graphpar.caffe2.plan"]
