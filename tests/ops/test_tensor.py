"""Tensor ops: kernels against eager PyTorch, gradients against torch.autograd (float64, rel. err < 1e-6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphpar.core.ir import CPU, CUDA, DeviceOption, OperatorDef
from graphpar.core.schema import NO_GRADIENT, check_operator, get_schema
from graphpar.errors import GradientError
from tests.ops.helpers import check_gradient, gradient_ops, make_op, randn, rel_err, run_gradient, run_kernel

DTYPES = st.sampled_from([torch.float32, torch.float64])
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple)
SEEDS = st.integers(0, 2**16)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert rel_err(got, want) < (1e-5 if want.dtype == torch.float32 else 1e-12)


# --------------------------------------------------------------------------------------------- unary

UNARY = {
    "Sqr": (lambda x: x * x, False),
    "Sqrt": (torch.sqrt, True),
    "Exp": (torch.exp, False),
    "Log": (torch.log, True),
    "Abs": (torch.abs, False),
    "Negative": (torch.neg, False),
}


@pytest.mark.parametrize("op_type", sorted(UNARY))
@given(shape=SHAPES, dtype=DTYPES, seed=SEEDS)
def test_unary_forward(op_type: str, shape: tuple, dtype: torch.dtype, seed: int) -> None:
    fn, positive = UNARY[op_type]
    x = randn(shape, dtype, seed)
    x = x.abs() + 0.1 if positive else x
    (y,) = run_kernel(op_type, [x])
    close(y, fn(x))
    assert torch.equal(x, randn(shape, dtype, seed).abs() + 0.1 if positive else randn(shape, dtype, seed))


@pytest.mark.parametrize("op_type", sorted(UNARY))
@given(shape=SHAPES, seed=SEEDS)
def test_unary_gradient(op_type: str, shape: tuple, seed: int) -> None:
    fn, positive = UNARY[op_type]
    x = randn(shape, torch.float64, seed)
    check_gradient(op_type, [x.abs() + 0.1 if positive else x], fn)


@given(shape=SHAPES, dtype=DTYPES, seed=SEEDS, scale=st.floats(-3, 3))
def test_scale(shape: tuple, dtype: torch.dtype, seed: int, scale: float) -> None:
    x = randn(shape, dtype, seed)
    close(run_kernel("Scale", [x], scale=scale)[0], x * scale)
    check_gradient("Scale", [x.double()], lambda v: v * scale, scale=scale)


@given(shape=SHAPES, dtype=DTYPES, seed=SEEDS, lo=st.floats(-1, 0), width=st.floats(0.1, 2))
def test_clip(shape: tuple, dtype: torch.dtype, seed: int, lo: float, width: float) -> None:
    x = randn(shape, dtype, seed)
    close(run_kernel("Clip", [x], min=lo, max=lo + width)[0], torch.clamp(x, lo, lo + width))
    check_gradient("Clip", [x.double()], lambda v: torch.clamp(v, lo, lo + width), min=lo, max=lo + width)


def test_clip_defaults_are_unbounded() -> None:
    x = randn((5,)) * 1e30
    assert torch.equal(run_kernel("Clip", [x])[0], x)


# -------------------------------------------------------------------------------------------- binary

BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}


@st.composite
def broadcast_pair(draw: st.DrawFn) -> tuple[tuple, tuple]:
    """Two NumPy-broadcastable shapes (either side may carry the 1s or the extra leading dims)."""
    out = draw(st.lists(st.integers(1, 4), min_size=0, max_size=4))
    a = [d if draw(st.booleans()) else 1 for d in out]
    b = [d if draw(st.booleans()) else 1 for d in out]
    return tuple(a[draw(st.integers(0, len(a))):]), tuple(b[draw(st.integers(0, len(b))):])


@pytest.mark.parametrize("op_type", sorted(BINARY))
@given(shapes=broadcast_pair(), dtype=DTYPES, seed=SEEDS)
def test_binary_numpy_broadcast(op_type: str, shapes: tuple, dtype: torch.dtype, seed: int) -> None:
    a, b = randn(shapes[0], dtype, seed), randn(shapes[1], dtype, seed + 1).abs() + 0.5
    close(run_kernel(op_type, [a, b])[0], BINARY[op_type](a, b))
    check_gradient(op_type, [a.double(), b.double()], BINARY[op_type], wrt=(0, 1))


@st.composite
def legacy_pair(draw: st.DrawFn) -> tuple[tuple, tuple, int]:
    """A's shape, B's shape (a contiguous run of A's dims) and Caffe2's `axis` (-1 = trailing)."""
    a = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    start = draw(st.integers(0, len(a) - 1))
    stop = draw(st.integers(start, len(a)))
    axis = -1 if stop == len(a) and draw(st.booleans()) else start
    return tuple(a), tuple(a[start:stop]), axis


@pytest.mark.parametrize("op_type", sorted(BINARY))
@given(shapes=legacy_pair(), dtype=DTYPES, seed=SEEDS)
def test_binary_legacy_broadcast(op_type: str, shapes: tuple, dtype: torch.dtype, seed: int) -> None:
    a_shape, b_shape, axis = shapes
    a, b = randn(a_shape, dtype, seed), randn(b_shape, dtype, seed + 1).abs() + 0.5
    start = len(a_shape) - len(b_shape) if axis == -1 else axis
    view = b_shape + (1,) * (len(a_shape) - start - len(b_shape))

    def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return BINARY[op_type](x, y.reshape(view))

    close(run_kernel(op_type, [a, b], broadcast=1, axis=axis)[0], reference(a, b))
    check_gradient(op_type, [a.double(), b.double()], reference, wrt=(0, 1), broadcast=1, axis=axis)


def test_legacy_broadcast_rejects_misaligned_b() -> None:
    with pytest.raises(ValueError, match="cannot broadcast at axis 2"):
        run_kernel("Add", [randn((2, 3)), randn((3,))], broadcast=1, axis=2)


def test_binary_in_place_rules() -> None:
    check_operator(OperatorDef("Add", ["a", "b"], ["a"]))
    check_operator(OperatorDef("Mul", ["a", "b"], ["b"]))
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("Div", ["a", "b"], ["b"]))


# ---------------------------------------------------------------------------------------- Sum, copies


@given(n=st.integers(1, 5), shape=SHAPES, dtype=DTYPES, seed=SEEDS)
def test_sum(n: int, shape: tuple, dtype: torch.dtype, seed: int) -> None:
    xs = [randn(shape, dtype, seed + i) for i in range(n)]
    want = xs[0].clone()
    for x in xs[1:]:
        want = want + x
    close(run_kernel("Sum", xs)[0], want)
    op = make_op("Sum", n)
    grad_ops, grads = gradient_ops(op, ["Y0_grad"])
    assert grad_ops == [] and grads == ["Y0_grad"] * n


def test_sum_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="input 1 has shape"):
        run_kernel("Sum", [randn((2, 3)), randn((3,))])


def test_sum_moves_inputs_to_the_op_device() -> None:
    (y,) = run_kernel("Sum", [randn((2,))], device="meta")  # one input: meta-device adds load slowly
    assert y.device.type == "meta"


@pytest.mark.parametrize("op_type", ["Copy", "CopyCPUToGPU", "Alias", "StopGradient"])
def test_identities(op_type: str) -> None:
    x = randn((2, 3), torch.float32)
    (y,) = run_kernel(op_type, [x])
    assert torch.equal(y, x) and y.dtype == x.dtype


def test_copies_place_outputs() -> None:
    x = randn((3,))
    assert run_kernel("Copy", [x], device="meta")[0].device.type == "meta"
    assert run_kernel("CopyCPUToGPU", [x], device="meta")[0].device.type == "meta"
    assert run_kernel("CopyGPUToCPU", [x], device="meta")[0].device.type == "cpu"
    like = torch.empty(1, device="meta")
    assert run_kernel("CopyOnDeviceLike", [x, like])[0].device.type == "meta"


def test_copy_gradients() -> None:
    x = randn((4, 2))
    for op_type, grad_type in (("Copy", "CopyOnDeviceLike"), ("CopyCPUToGPU", "CopyGPUToCPU"),
                               ("CopyGPUToCPU", "CopyCPUToGPU")):
        grad_ops, _ = gradient_ops(make_op(op_type, 1), ["Y0_grad"])
        assert [g.type for g in grad_ops] == [grad_type]
        check_gradient(op_type, [x], lambda v: v.clone())
    check_gradient("Alias", [x], lambda v: v.clone())
    assert gradient_ops(make_op("Alias", 1), ["Y0_grad"]) == ([], ["Y0_grad"])
    assert get_schema("StopGradient").gradient is NO_GRADIENT


def test_device_inference() -> None:
    gpu1, gpu0 = DeviceOption(CUDA, 1), DeviceOption(CUDA, 0)
    host = DeviceOption(CPU, 0)
    infer = {t: get_schema(t).device_inference for t in ("Copy", "CopyCPUToGPU", "CopyGPUToCPU", "Sum",
                                                        "Reshape", "Concat")}
    assert infer["Copy"](OperatorDef("Copy", ["gpu_0/x"], ["gpu_1/x"], {"input_device_ids": [0]}), gpu1) == \
        ([gpu0], [gpu1])
    assert infer["Copy"](OperatorDef("Copy", ["gpu_0/x"], ["gpu_1/x"]), gpu1) == ([gpu1], [gpu1])  # not by name
    assert infer["CopyCPUToGPU"](OperatorDef("CopyCPUToGPU", ["x"], ["y"]), gpu1) == ([host], [gpu1])
    assert infer["CopyGPUToCPU"](OperatorDef("CopyGPUToCPU", ["x"], ["y"]), gpu1) == ([gpu1], [host])
    assert infer["Sum"](OperatorDef("Sum", ["a", "b"], ["a"], {"input_device_ids": [-1, 1]}), gpu0) == \
        ([gpu0, gpu1], [gpu0])
    assert infer["Reshape"](OperatorDef("Reshape", ["x"], ["y", "s"]), gpu1) == ([gpu1], [gpu1, host])
    assert infer["Concat"](OperatorDef("Concat", ["a", "b"], ["y", "s"]), gpu1) == ([gpu1, gpu1], [gpu1, host])


# ---------------------------------------------------------------------------------------------- shape


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple), dtype=DTYPES, seed=SEEDS)
def test_reshape(shape: tuple, dtype: torch.dtype, seed: int) -> None:
    x = randn(shape, dtype, seed)
    spec = [0, -1] if len(shape) > 1 else [-1]
    want = x.reshape(shape[0], -1) if len(shape) > 1 else x.reshape(-1)
    y, old = run_kernel("Reshape", [x], shape=spec)
    close(y, want)
    assert old.dtype == torch.int64 and old.tolist() == list(shape)
    y2, _ = run_kernel("Reshape", [x, torch.tensor(list(want.shape))])
    close(y2, want)
    check_gradient("Reshape", [x.double()], lambda v: (v.reshape(want.shape), old), shape=spec)


def test_reshape_gradient_does_not_copy_args() -> None:
    grad_ops, grads = gradient_ops(make_op("Reshape", 1, shape=[-1]), ["Y0_grad", None])
    assert grad_ops[0].type == "Reshape" and grad_ops[0].inputs == ["Y0_grad", "Y1"]
    assert "shape" not in grad_ops[0].args and grads == ["X0_grad"]


def test_reshape_needs_exactly_one_shape() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        run_kernel("Reshape", [randn((2, 2))])
    with pytest.raises(ValueError, match="exactly one"):
        run_kernel("Reshape", [randn((2, 2)), torch.tensor([4])], shape=[4])


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple), data=st.data(), seed=SEEDS)
def test_flatten(shape: tuple, data: st.DataObject, seed: int) -> None:
    axis = data.draw(st.integers(0, len(shape)))
    x = randn(shape, torch.float64, seed)
    outer = 1
    for d in shape[:axis]:
        outer *= d
    check_gradient("Flatten", [x], lambda v: v.reshape(outer, -1), axis=axis)
    check_gradient("FlattenToVec", [x], lambda v: v.reshape(-1))
    check_gradient("ResizeLike", [x, torch.empty(x.numel())], lambda v, like: v.reshape(-1))
    close(run_kernel("Flatten", [x.float()], axis=axis)[0], x.float().reshape(outer, -1))


@given(n=st.integers(1, 4), shape=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
       data=st.data(), dtype=DTYPES, seed=SEEDS)
def test_concat(n: int, shape: tuple, data: st.DataObject, dtype: torch.dtype, seed: int) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    xs = []
    for i, size in enumerate(sizes):
        s = list(shape)
        s[axis] = size
        xs.append(randn(s, dtype, seed + i))
    y, info = run_kernel("Concat", xs, axis=axis)
    close(y, torch.cat(xs, axis))
    assert info.dtype == torch.int32 and info.tolist() == sizes
    check_gradient("Concat", [x.double() for x in xs], lambda *v: (torch.cat(v, axis), info),
                   wrt=range(n), axis=axis)


def test_concat_add_axis_and_order() -> None:
    xs = [randn((2, 3), seed=i) for i in range(3)]
    y, info = run_kernel("Concat", xs, axis=1, add_axis=1)
    assert torch.equal(y, torch.stack(xs, 1)) and info.tolist() == [1, 1, 1]
    check_gradient("Concat", xs, lambda *v: (torch.stack(v, 1), info), wrt=(0, 1, 2), axis=1, add_axis=1)
    imgs = [randn((1, 2, 2, 3), seed=i) for i in range(2)]
    assert torch.equal(run_kernel("Concat", imgs, order="NHWC")[0], torch.cat(imgs, 3))
    with pytest.raises(ValueError, match="not both"):
        run_kernel("Concat", imgs, order="NHWC", axis=3)


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), data=st.data(), dtype=DTYPES,
       seed=SEEDS)
def test_split(shape: tuple, data: st.DataObject, dtype: torch.dtype, seed: int) -> None:
    axis = data.draw(st.integers(0, len(shape) - 1))
    cuts = sorted(data.draw(st.lists(st.integers(0, shape[axis]), min_size=0, max_size=3)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[axis]])]
    x = randn(shape, dtype, seed)
    want = torch.split(x, sizes, axis)
    for got, ref in zip(run_kernel("Split", [x], n_outputs=len(sizes), axis=axis, split=sizes), want):
        close(got, ref)
    by_input = run_kernel("Split", [x, torch.tensor(sizes)], n_outputs=len(sizes), axis=axis)
    assert all(torch.equal(g, r) for g, r in zip(by_input, want))
    with_grad = data.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1, unique=True))
    check_gradient("Split", [x.double()], lambda v: tuple(torch.split(v, sizes, axis)),
                   grad_outputs=with_grad, n_outputs=len(sizes), axis=axis, split=sizes)


def test_split_defaults_and_errors() -> None:
    x = randn((6, 4))
    a, b = run_kernel("Split", [x], n_outputs=2, axis=0)
    assert torch.equal(a, x[:3]) and torch.equal(b, x[3:])
    parts = run_kernel("Split", [x], n_outputs=4, axis=1, add_axis=1)
    assert all(torch.equal(p, x[:, i]) for i, p in enumerate(parts))
    with pytest.raises(ValueError, match="does not split"):
        run_kernel("Split", [x], n_outputs=4, axis=0)
    with pytest.raises(ValueError, match="do not cut"):
        run_kernel("Split", [x], n_outputs=2, axis=0, split=[1, 2])


def test_slice_takes_caffe2_bounds_and_its_gradient_matches_autograd() -> None:
    x = randn((4, 6))
    (y,) = run_kernel("Slice", [x], starts=[1, 2], ends=[3, -1])
    assert torch.equal(y, x[1:3, 2:])
    (y,) = run_kernel("Slice", [x], starts=[-3], ends=[-1])  # dim + 1 + bound: rows 2..3
    assert torch.equal(y, x[2:])
    (y,) = run_kernel("Slice", [x.reshape(-1)], starts=[7], ends=[7])
    assert y.shape == (0,)
    check_gradient("Slice", [x.double()], lambda v: v[1:3, 2:], starts=[1, 2], ends=[3, -1])
    for starts, ends, message in (([1], [2, 3], "one bound per dim"), ([0, 0, 0], [1, 1, 1], "at most 2"),
                                  ([3], [2], r"no slice \[3, 2\)"), ([0], [5], r"no slice \[0, 5\)")):
        with pytest.raises(ValueError, match=message):
            run_kernel("Slice", [x], starts=starts, ends=ends)


def test_split_gradient_fills_missing_output_grads_with_zeros() -> None:
    op = make_op("Split", 1, 3, axis=0)
    grad_ops, _ = gradient_ops(op, [None, "Y1_grad", None])
    assert [g.type for g in grad_ops] == ["ConstantFill", "ConstantFill", "Concat"]
    x = randn((6, 2))
    outs = run_kernel("Split", [x], n_outputs=3, axis=0)
    dy = randn((2, 2), seed=5)
    (dx,) = run_gradient(op, [x], outs, {1: dy})
    assert torch.equal(dx, torch.cat([torch.zeros(2, 2, dtype=x.dtype), dy, torch.zeros(2, 2, dtype=x.dtype)]))


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple), data=st.data(), dtype=DTYPES,
       seed=SEEDS)
def test_transpose(shape: tuple, data: st.DataObject, dtype: torch.dtype, seed: int) -> None:
    axes = data.draw(st.permutations(range(len(shape))))
    x = randn(shape, dtype, seed)
    close(run_kernel("Transpose", [x], axes=axes)[0], x.permute(*axes))
    close(run_kernel("Transpose", [x])[0], x.permute(*reversed(range(len(shape)))))
    check_gradient("Transpose", [x.double()], lambda v: v.permute(*axes), axes=axes)
    check_gradient("Transpose", [x.double()], lambda v: v.permute(*reversed(range(v.ndim))))


def test_transpose_rejects_bad_axes() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        run_kernel("Transpose", [randn((2, 3))], axes=[0, 0])


@given(shape=st.lists(st.integers(1, 3), min_size=3, max_size=5).map(tuple), dtype=DTYPES, seed=SEEDS)
def test_layout(shape: tuple, dtype: torch.dtype, seed: int) -> None:
    x = randn(shape, dtype, seed)
    nd = len(shape)
    to_nchw, to_nhwc = (0, nd - 1, *range(1, nd - 1)), (0, *range(2, nd), 1)
    close(run_kernel("NHWC2NCHW", [x])[0], x.permute(*to_nchw))
    close(run_kernel("NCHW2NHWC", [x])[0], x.permute(*to_nhwc))
    check_gradient("NHWC2NCHW", [x.double()], lambda v: v.permute(*to_nchw))
    check_gradient("NCHW2NHWC", [x.double()], lambda v: v.permute(*to_nhwc))


@pytest.mark.parametrize("to,dtype", [(1, torch.float32), ("float64", torch.float64), ("DOUBLE", torch.float64),
                                      (10, torch.int64), ("int32", torch.int32), (torch.float16, torch.float16)])
def test_cast(to: object, dtype: torch.dtype) -> None:
    x = randn((3, 2), torch.float32) * 10
    (y,) = run_kernel("Cast", [x], to=to)
    assert y.dtype == dtype and torch.equal(y, x.to(dtype))


def test_cast_gradient_casts_back() -> None:
    grads = check_gradient("Cast", [randn((3, 2), torch.float32)], lambda v: v.double(), to="double")
    assert grads[0].dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype"):
        run_kernel("Cast", [randn((2,))], to="complex")


# ----------------------------------------------------------------------------------------- reductions


@given(shape=SHAPES, dtype=DTYPES, seed=SEEDS, average=st.booleans())
def test_sum_elements(shape: tuple, dtype: torch.dtype, seed: int, average: bool) -> None:
    x = randn(shape, dtype, seed)
    (y,) = run_kernel("SumElements", [x], average=average)
    assert y.shape == ()
    close(y, x.mean() if average else x.sum())
    close(run_kernel("SumSqrElements", [x], average=average)[0], (x * x).mean() if average else (x * x).sum())
    xd = x.double()
    check_gradient("SumElements", [xd], lambda v: v.mean() if average else v.sum(), average=average)
    check_gradient("SumSqrElements", [xd], lambda v: (v * v).mean() if average else (v * v).sum(),
                   average=average)


@given(shape=SHAPES, dtype=DTYPES, seed=SEEDS)
def test_averaged_loss(shape: tuple, dtype: torch.dtype, seed: int) -> None:
    x = randn(shape, dtype, seed)
    (y,) = run_kernel("AveragedLoss", [x])
    assert y.shape == ()
    close(y, x.mean())
    check_gradient("AveragedLoss", [x.double()], torch.mean)


@given(n=st.integers(1, 4), shape=SHAPES, dtype=DTYPES, seed=SEEDS)
def test_weighted_sum(n: int, shape: tuple, dtype: torch.dtype, seed: int) -> None:
    xs = [randn(shape, dtype, seed + i) for i in range(n)]
    ws = [randn((1,), dtype, seed + 100 + i) for i in range(n)]
    inputs = [t for pair in zip(xs, ws) for t in pair]

    def reference(*xw: torch.Tensor) -> torch.Tensor:
        out = xw[0] * xw[1].reshape(())
        for i in range(2, len(xw), 2):
            out = out + xw[i] * xw[i + 1].reshape(())
        return out

    close(run_kernel("WeightedSum", inputs)[0], reference(*inputs))
    doubles = [t.double() for t in inputs]
    grads = check_gradient("WeightedSum", doubles, reference, wrt=range(0, 2 * n, 2))
    assert grads[1::2] == [None] * n
    check_gradient("WeightedSum", doubles, reference, wrt=range(2 * n), grad_on_w=True)


def test_weighted_sum_keeps_dtype_and_checks_pairs() -> None:
    x, w = randn((3,), torch.float32), torch.tensor([2.0], dtype=torch.float64)
    assert run_kernel("WeightedSum", [x, w])[0].dtype == torch.float32
    with pytest.raises(ValueError, match="pairs"):
        run_kernel("WeightedSum", [x, w, x])
    with pytest.raises(ValueError, match=r"X1 has shape \(3,\), X0 has \(2, 3\)"):  # no silent broadcast
        run_kernel("WeightedSum", [randn((2, 3)), w, x, w])


def test_weighted_sum_grad_on_w_in_place_raises() -> None:
    op = OperatorDef("WeightedSum", ["x", "w", "y", "v"], ["x"], {"grad_on_w": True})
    with pytest.raises(GradientError, match="in place"):
        gradient_ops(op, ["x_grad"])
