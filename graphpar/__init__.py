"""graphpar: a Caffe2-style graph-building data-parallel compiler whose operators run on PyTorch kernels.

`import graphpar` is cheap and torch-free: it loads `core` and wires the operator library into it
(loaded at the first op lookup); other submodules load on first use, so `from graphpar import brew`
and `graphpar.Parallelize` work as usual.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from graphpar import _moved

_moved.install()


def _load_operators() -> None:
    import graphpar.ops  # noqa: F401 - importing the package registers every op module


def _proto_converter() -> ModuleType:
    from graphpar.caffe2.proto import convert  # needs protobuf, so loaded on first use

    return convert


from graphpar import core  # noqa: E402 - the finder of moved modules comes first
from graphpar.caffe2 import plan as _caffe2_plan  # noqa: E402

# Core is passive: it gets the operator library, the protobuf conversion and Caffe2's execution plans here.
core.schema.set_operator_library(_load_operators)
core.ir.set_proto_converter(_proto_converter)
core.ExecutionStep, core.Plan = _caffe2_plan.ExecutionStep, _caffe2_plan.Plan

__version__ = "0.1.0"

_MODULES = ("core", "workspace", "model_helper", "brew", "optimizer", "data_parallel_model", "checkpoint",
            "data", "models", "ops", "passes", "errors", "naming", "devices", "visualize", "profiler",
            "scope", "cnn", "optimizer_context", "test_util", "hypothesis_test_util", "dyndep")
_NAMES = {
    "Parallelize": "data_parallel_model",
    "FinalizeAfterCheckpoint": "data_parallel_model",
    "GetCheckpointParams": "data_parallel_model",
    "ModelHelper": "model_helper",
}
__all__ = [*_MODULES, *_NAMES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"graphpar.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"graphpar.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'graphpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
