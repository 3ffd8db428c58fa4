"""What the package root gives `core` from the layers above it, which core never imports.

`graphpar/__init__.py` fills these slots without importing core (so `import graphpar` stays cheap);
core calls them when it needs what they provide:
- `load_operators()` registers the operator library (`graphpar.ops`); the registry calls it before
  its first lookup of an unknown type and before listing every type;
- `proto_converter()` returns the module converting the IR to and from Caffe2's protobuf messages;
- `caffe2_plans()` returns the module of Caffe2's execution plans (`core.Plan`, `core.ExecutionStep`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def _no_operators() -> None:
    """Before the root installs the library: only what was registered explicitly."""


def _missing(what: str) -> Callable[[], ModuleType]:
    def missing() -> ModuleType:
        raise RuntimeError(f"no {what} is installed: import graphpar (its package root installs it)")
    return missing


load_operators: Callable[[], None] = _no_operators
proto_converter: Callable[[], ModuleType] = _missing("protobuf converter")
caffe2_plans: Callable[[], ModuleType] = _missing("module of Caffe2's execution plans")
