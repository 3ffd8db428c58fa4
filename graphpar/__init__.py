"""graphpar: a Caffe2-style graph-building data-parallel compiler whose operators run on PyTorch kernels.

`import graphpar` is cheap and torch-free: it installs the finder of moved modules and the providers
core calls for the operator library and Caffe2's protobufs and plans; submodules load on first use,
so `from graphpar import brew` and `graphpar.Parallelize` work as usual.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from graphpar import _moved, _providers

_moved.install()


def _load_operators() -> None:
    import graphpar.ops  # noqa: F401 - importing the package registers every op module


def _proto_converter() -> ModuleType:
    from graphpar.caffe2.proto import convert  # needs protobuf, so loaded on first use

    return convert


def _caffe2_plans() -> ModuleType:
    from graphpar.caffe2 import plan

    return plan


# Core imports no layer above it: it gets the operator library, the protobuf conversion and Caffe2's
# execution plans through these slots, all loaded on first use.
_providers.load_operators = _load_operators
_providers.proto_converter = _proto_converter
_providers.caffe2_plans = _caffe2_plans

__version__ = "0.1.0"

_MODULES = ("core", "workspace", "model_helper", "brew", "optimizer", "data_parallel_model", "checkpoint",
            "data", "models", "ops", "passes", "errors", "naming", "devices", "visualize", "profiler",
            "scope", "cnn", "optimizer_context", "test_util", "hypothesis_test_util", "dyndep", "utils")
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
