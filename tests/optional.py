"""Optional packages: a test that needs one skips, naming it, where it is not installed.

graphpar itself needs torch, numpy, networkx and safetensors; yacs (graphpar.config), scikit-learn (the
digits example), tqdm (its progress bar), matplotlib (`--plot`) and protobuf (Caffe2's protos) are
optional. `tools/without` makes a machine lack some (tests/test_bare_machine.py).
"""

from __future__ import annotations

import importlib.util

import pytest


def installed(module: str) -> bool:
    """Whether `module` can be imported (its parent packages too)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def needs(module: str, what: str) -> pytest.MarkDecorator:
    """Skip unless `module` is installed; the reason says what needs it."""
    return pytest.mark.skipif(not installed(module), reason=f"{what} needs the {module} package (not installed)")


DIGITS = needs("sklearn", "the digits example (scikit-learn's dataset)")
