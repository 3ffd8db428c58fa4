"""The part of Caffe2's `hypothesis_test_util` that its module tests use: strategies for tensors and
device options, and HypothesisTestCase. The operator-check helpers (`assertGradientChecks`, ...) are not
here: graphpar tests each kernel against torch.autograd instead (tests/ops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np

from graphpar import core
from graphpar.caffe2 import test_util
from graphpar.runtime import workspace

cpu_do = core.DeviceOption(core.CPU)
gpu_do = core.DeviceOption(core.CUDA)
device_options = [cpu_do] + ([gpu_do] if workspace.has_gpu_support else [])
gcs = {"gc": st.sampled_from(device_options), "dc": st.just(device_options)}
gcs_cpu_only = {"gc": st.sampled_from([cpu_do]), "dc": st.just([cpu_do])}


def dims(min_value: int = 1, max_value: int = 5) -> st.SearchStrategy[int]:
    """One dimension's size."""
    return st.integers(min_value=min_value, max_value=max_value)


def elements_of_type(dtype: type = np.float32, filter_: Callable[[Any], Any] | None = None) -> st.SearchStrategy:
    """Finite values of `dtype` (floats in [-1, 1], as Caffe2's)."""
    elems: st.SearchStrategy
    if np.issubdtype(dtype, np.floating):
        width: Any = np.dtype(dtype).itemsize * 8  # 16, 32 or 64
        elems = st.floats(min_value=-1.0, max_value=1.0, width=width)
    elif dtype is bool or dtype is np.bool_:
        elems = st.booleans()
    else:
        elems = st.integers(min_value=np.iinfo(dtype).min, max_value=np.iinfo(dtype).max)
    return elems if filter_ is None else elems.filter(filter_)


def arrays(shape: list[int] | tuple[int, ...], dtype: Any = np.float32, elements: st.SearchStrategy | None = None,
           unique: bool = False) -> st.SearchStrategy[np.ndarray]:
    """Arrays of `shape` and `dtype`."""
    return hnp.arrays(dtype, tuple(shape), elements=elements or elements_of_type(dtype), unique=unique)


def tensor(min_dim: int = 1, max_dim: int = 4, dtype: type = np.float32, elements: st.SearchStrategy | None = None,
           **kwargs: int) -> st.SearchStrategy[np.ndarray]:
    """Arrays of `min_dim`..`max_dim` dimensions, each of `dims(**kwargs)` size."""
    shapes = st.lists(dims(**kwargs), min_size=min_dim, max_size=max_dim)
    return shapes.flatmap(lambda shape: arrays(shape, dtype, elements))


class HypothesisTestCase(test_util.TestCase):
    """Caffe2's base class for hypothesis-driven tests (a `test_util.TestCase`)."""
