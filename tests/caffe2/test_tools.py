"""tools/caffe2_tests.py changes import statements only (checked on a synthetic file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.optional import needs

TOOL = Path(__file__).resolve().parents[2] / "tools" / "caffe2_tests.py"


def _tool():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("caffe2_tests", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs("google.protobuf", "rewriting `from caffe2.proto import caffe2_pb2` (a name graphpar.proto has with protobuf)")
def test_only_imports_are_rewritten_and_missing_names_dropped() -> None:
    source = (
        "from caffe2.python import core, workspace, \\\n    rnn_cell\n"
        "from caffe2.proto import caffe2_pb2\n"
        "import caffe2.python.hypothesis_test_util as hu\n"
        "from caffe2.python.modeling.initializers import (\n    Initializer, PseudoFP16Initializer)\n"
        "from caffe2.python.task import Node\n"
        "from mock import Mock\n"
        "def f():\n    from caffe2.python import brew\n    return 'from caffe2.python import x'\n"
    )
    dropped: list[str] = []
    out = _tool().rewrite(source, dropped)
    assert out.splitlines() == [
        "from graphpar import core, workspace",
        "from graphpar.proto import caffe2_pb2",
        "import graphpar.hypothesis_test_util as hu",
        "from graphpar.model_helper import Initializer, PseudoFP16Initializer",
        "pass",
        "from unittest.mock import Mock",
        "def f():",
        "    from graphpar import brew",
        "    return 'from caffe2.python import x'",
    ]
    assert dropped == ["caffe2.python.rnn_cell", "caffe2.python.task.Node"]
