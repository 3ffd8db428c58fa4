"""The loss scaler's ops against their formulas (torch.amp.GradScaler's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Launches(TorchDispatchMode):
    """Counts the aten ops run inside the block, and the host reads among them (`.item()`, `bool()`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> int:
        return sum(op.endswith("_local_scalar_dense") for op in self.ops)


def _unscale_launches(count: int, bad: bool = False) -> _Launches:
    from graphpar.core.schema import KernelContext, get_schema, parse_args

    names = [f"g{k}" for k in range(count)]
    op = OperatorDef("UnscaleGradients", [*names, "s"], names)
    schema = get_schema(op.type)
    kernel = schema.kernel(parse_args(schema, op.args, "t"), KernelContext(op=op, device=torch.device("cpu"),
                                                                               device_of=None, random_stream=None))
    grads = [torch.ones(3) for _ in names]
    if bad:
        grads[1][0] = np.inf
    with _Launches() as launches:
        try:
            kernel(*grads, torch.tensor(8.0))
        except GradientOverflowError as exc:
            assert "['g1'] are inf or NaN" in str(exc)
    return launches


def test_unscale_launches_the_same_kernels_for_any_number_of_gradients_and_reads_one_flag():
    """ResNet-50's 161 gradients cost ~3 kernels each before, and a skipped step read each one's flag."""
    few, many = _unscale_launches(2), _unscale_launches(40)
    assert len(many.ops) == len(few.ops) <= 8 and many.host_reads == few.host_reads == 1
    assert _unscale_launches(40, bad=True).host_reads <= 3  # the flag, then which gradients (at once), the scale
