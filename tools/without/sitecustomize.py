"""Makes the modules named in GRAPHPAR_WITHOUT unimportable, as on a machine that lacks them.

    GRAPHPAR_WITHOUT=yacs,sklearn,tqdm,matplotlib,google.protobuf PYTHONPATH=tools/without:$PWD python3 -m pytest

Python imports `sitecustomize` from the path at start-up, so every process started with this path (a
test's subprocesses too) lacks them: each name is None in `sys.modules`, so importing it (or one of
its submodules) raises ModuleNotFoundError and `importlib.util.find_spec` says None, as for a package
that is not installed.
"""

from __future__ import annotations

import os
import sys

for _name in os.environ.get("GRAPHPAR_WITHOUT", "").replace(" ", "").split(","):
    if _name:
        sys.modules[_name] = None  # type: ignore[assignment]
