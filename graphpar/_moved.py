"""Today's import paths for modules that moved into the layer subpackages.

`MOVED` maps an old dotted name to its new home; `import graphpar.workspace` (or
`from graphpar import workspace`) then gives the very module object `graphpar.runtime.workspace`,
so state, identity checks and monkeypatching are shared; `python -m <old name>` runs the new module. A moved package's submodules follow it
(`graphpar.proto.caffe2_pb2` is `graphpar.caffe2.proto.caffe2_pb2`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "graphpar.naming": "graphpar.core.naming",
    "graphpar.devices": "graphpar.platform.devices",
    "graphpar.distributed": "graphpar.platform.distributed",
    "graphpar.workspace": "graphpar.runtime.workspace",
    "graphpar.resume": "graphpar.runtime.resume",
    "graphpar.checkpoint": "graphpar.runtime.checkpoint",
    "graphpar.profiler": "graphpar.runtime.profiler",
    "graphpar.visualize": "graphpar.runtime.visualize",
    "graphpar.model_helper": "graphpar.model.model_helper",
    "graphpar.brew": "graphpar.model.brew",
    "graphpar.optimizer": "graphpar.model.optimizer",
    "graphpar.optimizer_context": "graphpar.model.optimizer_context",
    "graphpar.data_parallel_model": "graphpar.parallel.data_parallel_model",
    "graphpar.feeds": "graphpar.parallel.feeds",
    "graphpar.launch": "graphpar.parallel.launch",
    "graphpar.comm": "graphpar.parallel.comm",
    "graphpar.data": "graphpar.training.data",
    "graphpar.feeder": "graphpar.training.feeder",
    "graphpar.engine": "graphpar.training.engine",
    "graphpar.loaders": "graphpar.training.loaders",
    "graphpar.evaluation": "graphpar.training.evaluation",
    "graphpar.config": "graphpar.training.config",
    "graphpar.defaults": "graphpar.training.defaults",
    # Caffe2-only surface, in graphpar/caffe2/
    "graphpar.proto": "graphpar.caffe2.proto",
    "graphpar.predictor": "graphpar.caffe2.predictor",
    "graphpar.predictor_constants": "graphpar.caffe2.predictor_constants",
    "graphpar.dyndep": "graphpar.caffe2.dyndep",
    "graphpar.test_util": "graphpar.caffe2.test_util",
    "graphpar.hypothesis_test_util": "graphpar.caffe2.hypothesis_test_util",
    "graphpar.experiment_util": "graphpar.caffe2.experiment_util",
    "graphpar.timeout_guard": "graphpar.caffe2.timeout_guard",
    "graphpar.cnn": "graphpar.caffe2.cnn",
    "graphpar.scope": "graphpar.caffe2.scope",
    "graphpar.utils": "graphpar.caffe2.utils",
    "graphpar.core.plan": "graphpar.caffe2.plan",
}


def new_name(old: str) -> str | None:
    """Where the module once called `old` lives now, or None when it did not move."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the already-imported module at its new one."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's spec; the module keeps its own

    def get_code(self, fullname: str) -> object:
        """The new module's code, so `python -m <old name>` keeps working."""
        spec = importlib.util.find_spec(self.target)
        loader = None if spec is None else spec.loader
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"{self.target} has no code to run")
        return loader.get_code(self.target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
