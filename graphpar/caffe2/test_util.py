"""Caffe2's `test_util`: the TestCase its tests derive from (a fresh workspace around each test)."""

from __future__ import annotations

import unittest

import numpy as np

from graphpar.runtime import workspace


def rand_array(*dims: int) -> np.ndarray:
    """Uniform float32 values in [-0.5, 0.5) of shape `dims` (a 0-d array when none are given)."""
    return np.array(np.random.rand(*dims) - 0.5).astype(np.float32)


class TestCase(unittest.TestCase):
    """Resets the current workspace before and after each test, as Caffe2's did."""

    def setUp(self) -> None:  # noqa: D102
        workspace.ResetWorkspace()

    def tearDown(self) -> None:  # noqa: D102
        workspace.ResetWorkspace()
