"""Fill ops: shapes, dtypes, device placement, reproducibility, and the statistics of random fills."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphpar.core.schema import NO_GRADIENT, get_schema
from graphpar.ops.fill import DataType, to_torch_dtype
from tests.ops.helpers import randn, run_kernel

SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
FILLS = ["ConstantFill", "UniformFill", "GaussianFill", "XavierFill", "MSRAFill", "GivenTensorFill",
         "GivenTensorDoubleFill", "GivenTensorIntFill", "GivenTensorInt64Fill", "GivenTensorBoolFill"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("op_type", FILLS)
def test_fills_have_no_gradient(op_type: str) -> None:
    assert get_schema(op_type).gradient is NO_GRADIENT


@pytest.mark.parametrize("value,dtype", [(1.5, torch.float32), (3, torch.int64), (True, torch.bool),
                                         (0.0, torch.float32)])
def test_constant_fill_infers_dtype_from_value(value: object, dtype: torch.dtype) -> None:
    (y,) = run_kernel("ConstantFill", [], shape=[2, 3], value=value)
    assert y.dtype == dtype and y.shape == (2, 3)
    assert torch.equal(y, torch.full((2, 3), value, dtype=dtype))


@pytest.mark.parametrize("dtype,want", [(DataType.FLOAT, torch.float32), (1, torch.float32),
                                        (DataType.INT64, torch.int64), (2, torch.int32), (13, torch.float64),
                                        ("double", torch.float64), ("Float64", torch.float64),
                                        ("INT32", torch.int32), ("bool", torch.bool), (torch.int16, torch.int16)])
def test_constant_fill_dtype_argument(dtype: object, want: torch.dtype) -> None:
    (y,) = run_kernel("ConstantFill", [], shape=[4], value=1.0, dtype=dtype)
    assert y.dtype == want and torch.equal(y, torch.ones(4, dtype=want))


def test_to_torch_dtype_rejects_unknown() -> None:
    for bad in (4, "string", 99, None, True):
        with pytest.raises(ValueError, match="unsupported dtype"):
            to_torch_dtype(bad)


@given(shape=SHAPES, extra=SHAPES, value=st.floats(-10, 10))
def test_constant_fill_shapes(shape: tuple, extra: tuple, value: float) -> None:
    (y,) = run_kernel("ConstantFill", [], shape=shape, extra_shape=extra, value=value)
    assert torch.equal(y, torch.full(shape + extra, value, dtype=torch.float32))
    like = randn(shape, torch.float64)
    (y,) = run_kernel("ConstantFill", [like], extra_shape=extra, value=value)
    assert torch.equal(y, torch.full(shape + extra, value, dtype=torch.float64))
    (y,) = run_kernel("ConstantFill", [torch.tensor(shape, dtype=torch.int64)], input_as_shape=1, value=value)
    assert torch.equal(y, torch.full(shape, value, dtype=torch.float32))


def test_constant_fill_with_input_dtype_rules() -> None:
    ints = torch.zeros(2, 2, dtype=torch.int32)
    assert run_kernel("ConstantFill", [ints], value=1.0)[0].dtype == torch.float32
    assert run_kernel("ConstantFill", [ints], value=7)[0].dtype == torch.int64
    assert run_kernel("ConstantFill", [randn((2,), torch.float64)], value=1.0, dtype="float")[0].dtype == \
        torch.float32


def test_constant_fill_errors() -> None:
    with pytest.raises(ValueError, match="not both"):
        run_kernel("ConstantFill", [randn((2,))], shape=[2])
    with pytest.raises(ValueError, match="needs a shape input"):
        run_kernel("ConstantFill", [], input_as_shape=True)
    with pytest.raises(TypeError, match="must be a number"):
        run_kernel("ConstantFill", [], shape=[1], value="one")
    with pytest.raises(ValueError, match="unsupported dtype"):
        run_kernel("ConstantFill", [], shape=[1], dtype="string")


@pytest.mark.parametrize("op_type", ["ConstantFill", "UniformFill", "GaussianFill", "XavierFill", "MSRAFill"])
def test_fills_land_on_the_op_device(op_type: str) -> None:
    (y,) = run_kernel(op_type, [], device="meta", shape=[3, 4])
    assert y.device.type == "meta" and y.shape == (3, 4)


@pytest.mark.cuda
@pytest.mark.parametrize("op_type", ["UniformFill", "GaussianFill", "XavierFill", "MSRAFill"])
def test_random_fills_identical_on_cpu_and_cuda(op_type: str) -> None:
    (cpu,) = run_kernel(op_type, [], generator=gen(3), shape=[8, 5])
    (cuda,) = run_kernel(op_type, [], generator=gen(3), device="cuda", shape=[8, 5])
    assert cuda.is_cuda and torch.equal(cuda.cpu(), cpu)


@given(shape=SHAPES, seed=st.integers(0, 2**31), lo=st.floats(-5, 5), width=st.floats(0.1, 5),
       dtype=st.sampled_from(["float", "double"]))
def test_uniform_fill_matches_a_cpu_draw(shape: tuple, seed: int, lo: float, width: float, dtype: str) -> None:
    (y,) = run_kernel("UniformFill", [], generator=gen(seed), shape=shape, min=lo, max=lo + width, dtype=dtype)
    want = torch.empty(shape, dtype=to_torch_dtype(dtype)).uniform_(lo, lo + width, generator=gen(seed))
    assert torch.equal(y, want)
    assert bool(((y >= lo) & (y <= lo + width)).all())


@given(shape=SHAPES, seed=st.integers(0, 2**31), mean=st.floats(-5, 5), std=st.floats(0.1, 5))
def test_gaussian_fill_matches_a_cpu_draw(shape: tuple, seed: int, mean: float, std: float) -> None:
    (y,) = run_kernel("GaussianFill", [], generator=gen(seed), shape=shape, mean=mean, std=std)
    assert y.dtype == torch.float32
    assert torch.equal(y, torch.empty(shape).normal_(mean, std, generator=gen(seed)))


@pytest.mark.parametrize("op_type", ["UniformFill", "GaussianFill", "XavierFill", "MSRAFill"])
def test_random_fills_are_reproducible(op_type: str) -> None:
    a = run_kernel(op_type, [], generator=gen(7), shape=[16, 4])[0]
    b = run_kernel(op_type, [], generator=gen(7), shape=[16, 4])[0]
    c = run_kernel(op_type, [], generator=gen(8), shape=[16, 4])[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    shared = gen(7)
    first, second = run_kernel(op_type, [], generator=shared, shape=[16, 4])[0], \
        run_kernel(op_type, [], generator=shared, shape=[16, 4])[0]
    assert not torch.equal(first, second)


def test_gaussian_fill_statistics() -> None:
    (y,) = run_kernel("GaussianFill", [], generator=gen(0), shape=[200, 500], mean=2.0, std=3.0)
    assert abs(y.mean().item() - 2.0) < 0.03 and abs(y.std().item() - 3.0) < 0.03


def test_xavier_fill_bounds_and_statistics() -> None:
    shape = [64, 3, 5, 5]
    (y,) = run_kernel("XavierFill", [], generator=gen(0), shape=shape)
    bound = math.sqrt(3.0 / 75)  # fan_in = numel / shape[0]
    assert y.abs().max().item() <= bound and y.abs().max().item() > 0.95 * bound
    assert abs(y.std().item() - bound / math.sqrt(3)) < 0.03 * bound
    assert abs(y.mean().item()) < 0.02 * bound


def test_msra_fill_statistics() -> None:
    shape = [256, 32, 3, 3]
    (y,) = run_kernel("MSRAFill", [], generator=gen(0), shape=shape)
    std = math.sqrt(2.0 / (256 * 9))  # fan_out = numel / shape[1]
    assert abs(y.std().item() - std) < 0.02 * std and abs(y.mean().item()) < 0.02 * std


def test_fills_shaped_by_an_input() -> None:
    (y,) = run_kernel("XavierFill", [randn((10, 20))], generator=gen(1))
    assert y.shape == (10, 20) and y.abs().max().item() <= math.sqrt(3.0 / 20)
    (y,) = run_kernel("UniformFill", [torch.tensor([3, 2])], input_as_shape=True, extra_shape=[4])
    assert y.shape == (3, 2, 4)


def test_random_fill_errors() -> None:
    with pytest.raises(ValueError, match="at least 2 dims"):
        run_kernel("MSRAFill", [], shape=[5])
    with pytest.raises(ValueError, match="floating-point"):
        run_kernel("GaussianFill", [], shape=[5], dtype="int64")
    assert run_kernel("MSRAFill", [], shape=[0, 3])[0].shape == (0, 3)


@pytest.mark.parametrize("op_type,dtype,values", [
    ("GivenTensorFill", torch.float32, [0.5, 1.5, -2.0, 3.0, 4.0, 5.25]),
    ("GivenTensorDoubleFill", torch.float64, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
    ("GivenTensorIntFill", torch.int32, [1, 2, 3, 4, 5, 6]),
    ("GivenTensorInt64Fill", torch.int64, [2**40, 2, 3, 4, 5, 6]),
    ("GivenTensorBoolFill", torch.bool, [1, 0, 1, 1, 0, 0]),
])
def test_given_tensor_fills(op_type: str, dtype: torch.dtype, values: list) -> None:
    (y,) = run_kernel(op_type, [], values=values, shape=[2, 3])
    assert y.dtype == dtype and torch.equal(y, torch.tensor(values, dtype=dtype).reshape(2, 3))


def test_given_tensor_fill_returns_a_fresh_tensor_per_run() -> None:
    from graphpar.core.schema import KernelContext, parse_args
    from tests.ops.helpers import make_op

    op = make_op("GivenTensorFill", 0, values=[1.0, 2.0], shape=[2])
    schema = get_schema("GivenTensorFill")
    fn = schema.kernel(parse_args(schema, op.args), KernelContext(op, torch.device("cpu"), None, None))
    first = fn()
    first.zero_()
    assert fn().tolist() == [1.0, 2.0]


def test_given_tensor_fill_checks_the_count() -> None:
    with pytest.raises(ValueError, match="do not fill shape"):
        run_kernel("GivenTensorFill", [], values=[1.0, 2.0, 3.0], shape=[2, 2])
