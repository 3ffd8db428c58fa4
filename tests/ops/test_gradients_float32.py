"""Every gradient maker in float32 against torch.autograd (SPEC §4: relative error < 1e-3 in float32).

The per-module tests check each op in float64 with tight bounds; this file runs every differentiable
operator once more in float32, where a kernel that silently computes in float64 (or returns the wrong
dtype) shows up, and checks that no registered gradient maker is left out.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from graphpar.core.schema import NO_GRADIENT, NOT_DIFFERENTIABLE, get_schema, registered_types
from tests.ops.helpers import check_gradient, randn, run_kernel

F32 = torch.float32
_IDX = torch.tensor([4, 1, 4, 0, 2], dtype=torch.int32)
_LENGTHS = torch.tensor([2, 0, 3], dtype=torch.int32)
_OFFSETS = torch.tensor([0, 2, 2])


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return randn(shape, F32, seed)


def _positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return _x(*shape, seed=seed).abs() + 0.5


def _probabilities(n: int, d: int) -> torch.Tensor:
    return torch.softmax(_x(n, d, seed=7), 1)


def _bag(mode: str) -> Callable[..., torch.Tensor]:
    return lambda d, i, _lengths: F.embedding_bag(i.long(), d, _OFFSETS, mode=mode)


def _sparse_cases() -> dict[str, tuple]:
    return {
        "Gather": ([_x(5, 3), _IDX], lambda d, i: F.embedding(i.long(), d), {}),
        "SparseLengthsSum": ([_x(5, 3), _IDX, _LENGTHS], _bag("sum"), {}),
        "SparseLengthsMean": ([_x(5, 3), _IDX, _LENGTHS], _bag("mean"), {}),
        "SparseLengthsWeightedSum": (
            [_x(5, 3), _x(5, seed=1), _IDX, _LENGTHS],
            lambda d, w, i, _lengths: F.embedding_bag(i.long(), d, _OFFSETS, mode="sum", per_sample_weights=w),
            {"wrt": (0, 1), "grad_on_weights": 1}),
        "SparseToDense": ([_IDX, _x(5, 3), _x(6, 2)],
                          lambda i, v, _like: torch.zeros(6, 3).index_add(0, i.long(), v), {"wrt": (1,)}),
    }


def _bn_reference(x, scale, bias, rm, rv):  # noqa: ANN001, ANN202 - torch's training batch norm
    rm, rv = rm.detach().clone(), rv.detach().clone()
    y = F.batch_norm(x, rm, rv, scale, bias, True, 0.1, 1e-5)
    dims = [0, *range(2, x.dim())]
    return y, rm, rv, x.mean(dims), (x.var(dims, unbiased=False) + 1e-5).rsqrt()


LABELS = torch.tensor([0, 2, 1, 2], dtype=torch.int32)
_DROPOUT_MASK = run_kernel("Dropout", [_x(4, 5)], n_outputs=2, ratio=0.3)[1]  # check_gradient's seed

# op type -> (inputs, reference, check_gradient keyword arguments)
SPARSE_CASES = _sparse_cases()
CASES: dict[str, tuple[list[torch.Tensor], Callable, dict]] = {
    "Abs": ([_x(3, 4)], torch.abs, {}),
    "Add": ([_x(3, 4), _x(4, seed=1)], torch.add, {"wrt": (0, 1)}),
    "Alias": ([_x(3, 4)], lambda x: x.clone(), {}),
    "AveragePool": ([_x(2, 3, 6, 5)], lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                    {"kernel": 3, "stride": 2, "pad": 1}),
    "AveragedLoss": ([_x(3, 4)], torch.mean, {}),
    "Cast": ([_x(3, 4)], lambda x: x.double(), {"to": "double"}),
    "Clip": ([_x(3, 4)], lambda x: x.clamp(-0.5, 0.7), {"min": -0.5, "max": 0.7}),
    "FloatToHalf": ([_x(3, 4)], lambda x: x.half(), {}),
    "ChannelsLast": ([_x(2, 3, 4, 5)], lambda x: x.contiguous(memory_format=torch.channels_last), {}),
    "HalfToFloat": ([_x(3, 4).half()], lambda x: x.float(), {}),
    "Concat": ([_x(2, 3), _x(2, 2, seed=1)],
               lambda a, b: (torch.cat([a, b], 1), torch.tensor([3, 2], dtype=torch.int32)), {"wrt": (0, 1)}),
    "Conv": ([_x(2, 3, 6, 5), _x(4, 3, 3, 3, seed=1), _x(4, seed=2)],
             lambda x, w, b: F.conv2d(x, w, b, 2, 1), {"wrt": (0, 1, 2), "kernel": 3, "stride": 2, "pad": 1}),
    "Copy": ([_x(3, 4)], lambda x: x.clone(), {}),
    "CopyCPUToGPU": ([_x(3, 4)], lambda x: x.clone(), {}),
    "CopyGPUToCPU": ([_x(3, 4)], lambda x: x.clone(), {}),
    "CrossEntropy": ([_probabilities(4, 3), _probabilities(4, 3).flip(1)],
                     lambda x, t: -(t * x.log()).sum(1), {}),
    "Div": ([_x(3, 4), _positive(4, seed=1)], torch.div, {"wrt": (0, 1)}),
    "Dropout": ([_x(4, 5)], lambda x: (x * _DROPOUT_MASK / 0.7, _DROPOUT_MASK), {"n_outputs": 2, "ratio": 0.3}),
    "Exp": ([_x(3, 4)], torch.exp, {}),
    "FC": ([_x(4, 2, 3), _x(5, 6, seed=1), _x(5, seed=2)], lambda x, w, b: F.linear(x.reshape(4, 6), w, b),
           {"wrt": (0, 1, 2)}),
    "Flatten": ([_x(2, 3, 4)], lambda x: x.reshape(2, 12), {}),
    "FlattenToVec": ([_x(2, 3, 4)], lambda x: x.reshape(-1), {}),
    "LabelCrossEntropy": ([_probabilities(4, 3), LABELS], lambda x, label: -x[range(4), label.long()].log(), {}),
    "LeakyRelu": ([_x(3, 4)], lambda x: F.leaky_relu(x, 0.2), {"alpha": 0.2}),
    "Log": ([_positive(3, 4)], torch.log, {}),
    "Max": ([_x(3, 4), _x(4, seed=1), _x(3, 1, seed=2)], lambda a, b, c: torch.maximum(torch.maximum(a, b), c),
            {"wrt": (0, 1, 2)}),
    "MaxPool": ([_x(2, 3, 6, 5)], lambda x: F.max_pool2d(x, 2, 2), {"kernel": 2, "stride": 2}),
    "Mul": ([_x(3, 4), _x(4, seed=1)], torch.mul, {"wrt": (0, 1)}),
    "NCHW2NHWC": ([_x(2, 3, 4, 5)], lambda x: x.permute(0, 2, 3, 1), {}),
    "NHWC2NCHW": ([_x(2, 4, 5, 3)], lambda x: x.permute(0, 3, 1, 2), {}),
    "Negative": ([_x(3, 4)], torch.neg, {}),
    "Relu": ([_x(3, 4)], torch.relu, {}),
    "Reshape": ([_x(2, 3, 4)], lambda x: (x.reshape(6, 4), torch.tensor([2, 3, 4])), {"shape": [-1, 4]}),
    "ResizeLike": ([_x(2, 6), torch.empty(3, 4)], lambda x, like: x.reshape(3, 4), {}),
    "Scale": ([_x(3, 4)], lambda x: x * 0.3, {"scale": 0.3}),
    "Sigmoid": ([_x(3, 4)], torch.sigmoid, {}),
    "SigmoidCrossEntropyWithLogits": (
        [_x(3, 4), torch.rand(3, 4, generator=torch.Generator().manual_seed(0))],
        lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction="none").mean(-1), {}),
    "Softmax": ([_x(3, 4)], lambda x: torch.softmax(x, 1), {}),
    "SoftmaxWithLoss": ([_x(4, 3), LABELS],
                        lambda x, label: (torch.softmax(x, 1), F.cross_entropy(x, label.long())),
                        {"grad_outputs": (1,)}),
    "SpatialBN": ([_x(4, 3, 2, 2), _positive(3, seed=1), _x(3, seed=2), _x(3, seed=3), _positive(3, seed=4)],
                  _bn_reference, {"wrt": (0, 1, 2), "n_outputs": 5}),
    "Slice": ([_x(4, 5)], lambda x: x[1:3, 2:], {"starts": [1, 2], "ends": [3, -1]}),
    "Split": ([_x(5, 3)], lambda x: tuple(torch.split(x, [2, 3])), {"n_outputs": 2, "grad_outputs": (0, 1),
                                                                     "axis": 0, "split": [2, 3]}),
    "Sqr": ([_x(3, 4)], lambda x: x * x, {}),
    "Sqrt": ([_positive(3, 4)], torch.sqrt, {}),
    "SquaredL2Distance": ([_x(3, 4), _x(3, 4, seed=1)], lambda a, b: 0.5 * (a - b).square().sum(1),
                          {"wrt": (0, 1)}),
    "Sub": ([_x(3, 4), _x(4, seed=1)], torch.sub, {"wrt": (0, 1)}),
    "Sum": ([_x(3, 4), _x(3, 4, seed=1), _x(3, 4, seed=2)], lambda a, b, c: a + b + c, {"wrt": (0, 1, 2)}),
    "ReduceFrontSum": ([_x(2, 3, 4)], lambda x: x.sum((0, 1)), {"num_reduce_dim": 2}),
    "SumElements": ([_x(3, 4)], torch.sum, {}),
    "SumSqrElements": ([_x(3, 4)], lambda x: x.square().sum(), {}),
    "Tanh": ([_x(3, 4)], torch.tanh, {}),
    **SPARSE_CASES,
    "Transpose": ([_x(2, 3, 4)], lambda x: x.permute(1, 2, 0), {"axes": [1, 2, 0]}),
    "WeightedSum": ([_x(3, 4), _x(1, seed=1), _x(3, 4, seed=2), _x(1, seed=3)],
                    lambda a, wa, b, wb: a * wa + b * wb, {"wrt": (0, 2)}),
}


def _differentiable(op_type: str) -> bool:
    gradient = get_schema(op_type).gradient
    return gradient is not None and gradient is not NO_GRADIENT and gradient is not NOT_DIFFERENTIABLE


def test_every_gradient_maker_is_covered() -> None:
    """Every graphpar op with a gradient maker has a case (test modules register `_Test*` ops)."""
    own = [t for t in registered_types() if not t.startswith("_")]
    assert sorted(t for t in own if _differentiable(t)) == sorted(CASES)


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_float32_gradient_matches_autograd(op_type: str) -> None:
    inputs, reference, kwargs = CASES[op_type]
    grads = check_gradient(op_type, inputs, reference, rtol=1e-3, **kwargs)  # also checks each dX dtype
    assert all(g is None or g.dtype == x.dtype for g, x in zip(grads, inputs))
