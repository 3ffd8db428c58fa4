"""order="NHWC" (Caffe2's CPU layout) for Conv, pooling and SpatialBN equals NCHW bit for bit,
forward and backward: the reference is the same net in NCHW on transposed data."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import core, workspace

BLOBS = ["y", "z", "p", "q", "g", "x_grad", "w_grad", "b_grad", "s_grad", "bb_grad", "rm", "rv"]


def _nhwc(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if a.ndim == 4 else a


def _run(order: str, feeds: dict[str, np.ndarray], pads: dict[str, int]) -> dict[str, np.ndarray]:
    workspace.ResetWorkspace()
    for name, value in feeds.items():
        workspace.FeedBlob(name, _nhwc(value) if order == "NHWC" else value)
    net = core.Net(f"nhwc_{order}")
    net.Conv(["x", "w", "b"], "y", stride=2, order=order, **pads)
    net.SpatialBN(["y", "s", "bb", "rm", "rv"], ["z", "rm", "rv", "sm", "sv"], order=order)
    net.MaxPool("z", ["p", "p_index"], kernel=2, order=order)
    net.AveragePool("p", "q", kernel=2, stride=1, order=order)
    net.AveragePool("p", "g", global_pooling=True, order=order)
    total = net.Sum([net.SumSqrElements(["q"], "lq"), net.SumSqrElements(["g"], "lg")], "loss")
    net.AddGradientOperators([total])
    workspace.RunNetOnce(net)
    back = (lambda a: a.transpose(0, 3, 1, 2)) if order == "NHWC" else (lambda a: a)
    return {b: (back(v) if v.ndim == 4 else v) for b in BLOBS for v in [workspace.FetchBlob(b)]}


@pytest.mark.parametrize("pads", [{"pad": 1}, {"pad_t": 1, "pad_l": 0, "pad_b": 2, "pad_r": 1}])
def test_nhwc_equals_nchw_forward_and_backward(pads: dict[str, int]) -> None:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 9, 8)).astype(np.float32),
             "w": rng.standard_normal((4, 3, 3, 2)).astype(np.float32),  # NHWC filter: [M, kh, kw, C]
             "b": rng.standard_normal(4).astype(np.float32),
             "s": rng.uniform(0.5, 1.5, 4).astype(np.float32), "bb": rng.standard_normal(4).astype(np.float32),
             "rm": np.zeros(4, np.float32), "rv": np.ones(4, np.float32)}
    nchw, nhwc = _run("NCHW", feeds, pads), _run("NHWC", feeds, pads)
    for blob in BLOBS:
        np.testing.assert_array_equal(nhwc[blob], nchw[blob], err_msg=blob)


def test_other_orders_are_refused() -> None:
    workspace.FeedBlob("x", np.zeros((1, 1, 4, 4), np.float32))
    net = core.Net("bad_order")
    net.MaxPool("x", "y", kernel=2, order="CHWN")
    with pytest.raises(ValueError, match="order='CHWN' is not supported"):
        workspace.RunNetOnce(net)
