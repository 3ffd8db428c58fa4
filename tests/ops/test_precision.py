"""The loss scaler's ops against their formulas (torch.amp.GradScaler's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.errors import GradientOverflowError, OperatorError


def _run(op: OperatorDef, feeds: dict) -> None:
    for name, value in feeds.items():
        workspace.FeedBlob(name, value)
    workspace.RunNetOnce(NetDef("t", [op]))


def test_unscale_divides_every_gradient_in_its_dtype():
    workspace.ResetWorkspace()
    g32, g16 = np.array([2.0, -6.0], np.float32), torch.tensor([1024.0, 8.0], dtype=torch.float16)
    _run(OperatorDef("UnscaleGradients", ["a", "b", "s"], ["a", "b"]), {"a": g32, "b": g16, "s": np.float32(8.0)})
    np.testing.assert_array_equal(workspace.FetchBlob("a"), g32 / 8)
    assert workspace.FetchTensor("b").dtype == torch.float16
    assert workspace.FetchTensor("b").tolist() == [128.0, 1.0]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_unscale_raises_on_a_non_finite_gradient_and_writes_nothing(bad):
    workspace.ResetWorkspace()
    a = np.array([1.0, bad], np.float32)
    with pytest.raises(OperatorError, match=r"\['b'\] are inf or NaN at loss scale 4") as info:
        _run(OperatorDef("UnscaleGradients", ["a", "b", "s"], ["a", "b"]),
             {"a": np.ones(2, np.float32), "b": a, "s": np.float32(4.0)})
    assert isinstance(info.value.__cause__, GradientOverflowError)
    np.testing.assert_array_equal(workspace.FetchBlob("a"), np.ones(2, np.float32))


def test_update_and_backoff_follow_grad_scaler():
    workspace.ResetWorkspace()
    workspace.FeedBlob("s", np.float32(16.0))
    workspace.FeedBlob("n", np.int64(0))
    grow = NetDef("g", [OperatorDef("UpdateLossScale", ["s", "n"], ["s", "n"], {"growth_interval": 3})])
    seen = []
    for _ in range(4):
        workspace.RunNetOnce(grow)
        seen.append((float(workspace.FetchBlob("s")), int(workspace.FetchBlob("n"))))
    assert seen == [(16.0, 1), (16.0, 2), (32.0, 0), (32.0, 1)]
    workspace.RunNetOnce(NetDef("b", [OperatorDef("BackoffLossScale", ["s", "n"], ["s", "n"])]))
    assert (float(workspace.FetchBlob("s")), int(workspace.FetchBlob("n"))) == (16.0, 0)
