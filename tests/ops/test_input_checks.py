"""Input checks (`register_op(check=...)`): no silent broadcasting in updates and batch norm, integer
counters. A broken promise is reported before the net runs when shapes are known (RunNet checks a net
created with blobs that did not fit), else when the op runs, and the workspace is left as it was."""

from __future__ import annotations

import pytest
import torch

from graphpar import core, workspace
from graphpar.errors import OperatorError
from tests.ops.helpers import randn, run_kernel

LR = torch.tensor([0.1])


def counter(value: int = 1, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([value], dtype=dtype)


def snapshot() -> dict[str, torch.Tensor]:
    ws = workspace.get_workspace()
    return {name: tensor.clone() for name, tensor in ws.blobs.items()}


def assert_unchanged(before: dict[str, torch.Tensor]) -> None:
    after = workspace.get_workspace().blobs
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert after[name].shape == value.shape and torch.equal(after[name], value), name


# Each case: op type, inputs, and a pattern of the error. Every one ran silently before the checks,
# broadcasting a [1] blob against a [3] one (or counting in float).
BROKEN = {
    "MomentumSGDUpdate: [1] grad, [3] param": (
        "MomentumSGDUpdate", lambda: [randn((1,)), randn((3,)), LR, randn((3,))], "one shape"),
    "Adam: [1] param, [3] grad": (
        "Adam", lambda: [randn((1,)), randn((1,)), randn((1,)), randn((3,)), LR, counter()], "one shape"),
    "Adagrad: [1] param, [3] grad": (
        "Adagrad", lambda: [randn((1,)), randn((1,)), randn((3,)), LR], "one shape"),
    "SpatialBN: [1] scale for 3 channels": (
        "SpatialBN", lambda: [randn((4, 3, 2, 2)), randn((1,)), randn((3,)), randn((3,)), randn((3,)).abs()],
        "one value per channel"),
    "SpatialBN: [1] running variance": (
        "SpatialBN", lambda: [randn((4, 3, 2, 2)), randn((3,)), randn((3,)), randn((3,)), randn((1,)).abs()],
        "one value per channel"),
    "SpatialBNGradient: [1] scale": (
        "SpatialBNGradient", lambda: [randn((4, 3, 2)), randn((1,)), randn((4, 3, 2)), randn((3,)), randn((3,))],
        "one value per channel"),
    "Iter: float32 counter": ("Iter", lambda: [counter(3, torch.float32)], "must be an integer"),
    "LearningRate: float64 counter": ("LearningRate", lambda: [counter(3, torch.float64)], "must be an integer"),
}
ARGS = {"SpatialBN": {"epsilon": 1e-5}, "SpatialBNGradient": {}, "LearningRate": {"base_lr": 0.1}}
OUTPUTS = {"SpatialBN": 5}


@pytest.mark.parametrize("case", list(BROKEN))
def test_kernels_refuse_what_their_schema_does_not_promise(case: str) -> None:
    op_type, inputs, pattern = BROKEN[case]
    with pytest.raises((ValueError, TypeError), match=pattern):
        run_kernel(op_type, inputs(), OUTPUTS.get(op_type), **ARGS.get(op_type, {}))


def _net(op_type: str, n_inputs: int) -> core.Net:
    from tests.ops.helpers import make_op

    net = core.Net("checked")
    op = make_op(op_type, n_inputs, OUTPUTS.get(op_type), **ARGS.get(op_type, {}))
    net.Proto().ops.append(op)
    return net


@pytest.mark.parametrize("case", list(BROKEN))
def test_run_net_reports_the_mismatch_naming_the_op_before_anything_runs(case: str) -> None:
    op_type, inputs, pattern = BROKEN[case]
    for k, value in enumerate(inputs()):
        workspace.FeedBlob(f"X{k}", value)
    before = snapshot()
    net = _net(op_type, len(inputs()))
    workspace.CreateNet(net)  # as Caffe2: the inputs are checked when the net runs
    with pytest.raises(ValueError, match=f"op #0 \\({op_type}\\)(.|\n)*{pattern}"):
        workspace.RunNet(net)
    assert_unchanged(before)


def test_a_blob_refed_with_another_shape_after_create_net_fails_at_run_and_changes_nothing() -> None:
    for k, value in enumerate([randn((3,)), randn((3,)), LR, randn((3,))]):
        workspace.FeedBlob(f"X{k}", value)
    net = _net("MomentumSGDUpdate", 4)
    workspace.CreateNet(net)
    workspace.FeedBlob("X3", randn((1,)))  # a [1] param: its update would become [3]
    before = snapshot()
    # the in-place state check (StateChanged) or the input check (one shape) stops it before any write
    with pytest.raises(OperatorError, match="MomentumSGDUpdate(.|\n)*(one shape|StateChanged)"):
        workspace.RunNet(net)
    assert_unchanged(before)


def test_multi_tensor_updates_check_each_params_blobs() -> None:
    g, m, p = [randn((3,)), randn((2,))], [randn((3,)), randn((2,))], [randn((3,)), randn((1,))]
    with pytest.raises(ValueError, match="one shape"):
        run_kernel("MultiTensorMomentumSGDUpdate", [*g, *m, *p, LR], 6)
    with pytest.raises(ValueError, match="one shape"):
        run_kernel("MultiTensorAdam", [*p, *m, *m, *g, LR, counter()], 6)
    with pytest.raises(TypeError, match="must be an integer"):
        run_kernel("MultiTensorAdam", [*m, *m, *m, *m, LR, counter(1, torch.float32)], 6)


def test_sparse_updates_refuse_slices_that_would_broadcast() -> None:
    param, moment, indices = randn((5, 3)), randn((5, 3)), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="one row per index"):
        run_kernel("SparseMomentumSGDUpdate", [randn((2, 1)), moment, LR, param, indices])
    with pytest.raises(ValueError, match="one shape"):
        run_kernel("SparseMomentumSGDUpdate", [randn((2, 3)), randn((5, 1)), LR, param, indices])


def test_matching_inputs_still_run() -> None:
    run_kernel("MomentumSGDUpdate", [randn((3,)), randn((3,)), LR, randn((3,))])
    run_kernel("SpatialBN", [randn((4, 3, 2)), randn((3,)), randn((3,)), randn((3,)), randn((3,)).abs()], 5)
    (it,) = run_kernel("Iter", [counter(3, torch.int32)])
    assert it.tolist() == [4]
