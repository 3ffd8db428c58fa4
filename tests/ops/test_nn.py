"""nn operators against eager PyTorch (forward) and torch.autograd (gradients, float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import check_operator
from tests.ops.helpers import (
    check_gradient,
    gradient_ops,
    make_op,
    rel_err,
    run_gradient,
    run_kernel,
    run_op,
)

DTYPES = st.sampled_from([torch.float32, torch.float64])


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    tol = 1e-5 if actual.dtype == torch.float32 else 1e-12
    assert rel_err(actual, expected) < tol


# ---------------------------------------------------------------------------------------------------- FC


@given(m=st.integers(1, 6), k=st.integers(1, 7), n=st.integers(1, 5), dtype=DTYPES, seed=st.integers(0, 99))
def test_fc_forward_matches_linear(m: int, k: int, n: int, dtype: torch.dtype, seed: int) -> None:
    x, w, b = (
        _randn(seed, m, k, dtype=dtype),
        _randn(seed + 1, n, k, dtype=dtype),
        _randn(seed + 2, n, dtype=dtype),
    )
    (y,) = run_kernel("FC", [x, w, b])
    _close(y, F.linear(x, w, b))


def test_fc_flattens_at_axis() -> None:
    x, w, b = _randn(0, 2, 3, 4, 5), _randn(1, 6, 60), _randn(2, 6)
    (y,) = run_kernel("FC", [x, w, b])
    _close(y, F.linear(x.reshape(2, 60), w, b))
    w2 = _randn(3, 6, 20)
    (y2,) = run_kernel("FC", [x, w2, b], axis=2)
    assert y2.shape == (2, 3, 6)
    _close(y2, F.linear(x.reshape(6, 20), w2, b).reshape(2, 3, 6))
    (y3,) = run_kernel("FC", [x, w2.reshape(6, 4, 5), b], axis=-2, axis_w=1)
    _close(y3, y2)


def test_fc_gradient() -> None:
    x, w, b = _randn(0, 4, 2, 3), _randn(1, 5, 6), _randn(2, 5)
    check_gradient("FC", [x, w, b], lambda x, w, b: F.linear(x.reshape(4, 6), w, b), wrt=(0, 1, 2))


def _without_dx(grad_op: OperatorDef) -> OperatorDef:
    """The gradient op as autodiff rewrites it when nobody wants dX (its last output)."""
    grad_op = grad_op.copy()
    grad_op.outputs, grad_op.args = grad_op.outputs[:-1], {**grad_op.args, "no_gradient_to_input": True}
    return grad_op


def _run_gradient_ops(op: OperatorDef, blobs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the op's gradient ops (dY named `<output>_grad`) twice: as made, and without dX."""
    (grad_op,), _ = gradient_ops(op, [f"{op.outputs[0]}_grad"])
    full = dict(zip(grad_op.outputs, run_op(grad_op, [blobs[b] for b in grad_op.inputs])))
    short = _without_dx(grad_op)
    partial = dict(zip(short.outputs, run_op(short, [blobs[b] for b in short.inputs])))
    assert list(partial) == grad_op.outputs[:-1]
    return full, partial


def test_fc_gradient_without_input_gradient() -> None:
    x, w, b = _randn(0, 4, 6), _randn(1, 5, 6), _randn(2, 5)
    dy = _randn(3, 4, 5)
    full, partial = _run_gradient_ops(OperatorDef("FC", ["x", "w", "b"], ["y"]),
                                      {"x": x, "w": w, "b": b, "y_grad": dy})
    leaves = [t.clone().requires_grad_() for t in (w, b)]
    want = torch.autograd.grad(F.linear(x, *leaves), leaves, dy)
    assert set(full) == {"w_grad", "b_grad", "x_grad"} and set(partial) == {"w_grad", "b_grad"}
    for name, expected in zip(("w_grad", "b_grad"), want):
        _close(partial[name], expected)
        _close(full[name], expected)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_gradient_without_input_gradient(bias: bool) -> None:
    x, w, b, dy = _randn(0, 2, 3, 6, 5), _randn(1, 4, 3, 3, 3), _randn(2, 4), _randn(3, 2, 4, 5, 3)
    args = dict(kernel=3, pad_t=1, pad_l=0, pad_b=0, pad_r=0)  # asymmetric: F.pad before the conv
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    full, partial = _run_gradient_ops(OperatorDef("Conv", inputs, ["y"], args),
                                      {"x": x, "w": w, "b": b, "y_grad": dy})
    leaves = [t.clone().requires_grad_() for t in ((w, b) if bias else (w,))]
    want = torch.autograd.grad(F.conv2d(F.pad(x, (0, 0, 1, 0)), *leaves), leaves, dy)
    assert "x_grad" in full and "x_grad" not in partial
    for name, expected in zip(("w_grad", "b_grad"), want):
        _close(partial[name], expected)
        _close(full[name], expected)


@pytest.mark.parametrize("op_type, outputs", [("FCGradient", 3), ("ConvGradient", 3), ("ConvGradient", 1)])
def test_gradient_output_count_must_match_no_gradient_to_input(op_type: str, outputs: int) -> None:
    flag = outputs == 3  # three outputs include dX; one (a ConvGradient without bias) cannot
    op = OperatorDef(op_type, ["x", "w", "dy"], ["dw", "db", "dx"][:outputs],
                     {"no_gradient_to_input": flag, "kernel": 1} if op_type == "ConvGradient"
                     else {"no_gradient_to_input": flag})
    with pytest.raises(ValueError, match="no_gradient_to_input"):
        run_op(op, [_randn(0, 1, 2, 3, 3), _randn(1, 2, 2, 1, 1), _randn(2, 1, 2, 3, 3)])


def test_fc_rejects_bias_of_wrong_size() -> None:
    with pytest.raises(ValueError, match="bias has 1 elements"):
        run_kernel("FC", [_randn(0, 2, 3), _randn(1, 4, 3), _randn(2, 1)])


# ---------------------------------------------------------------------------------------------------- Conv


@st.composite
def conv_cases(draw: st.DrawFn) -> dict:
    group = draw(st.sampled_from([1, 2]))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dil = draw(st.integers(1, 2))
    return dict(
        n=draw(st.integers(1, 2)),
        c=group * draw(st.integers(1, 2)),
        m=group * draw(st.integers(1, 2)),
        h=draw(st.integers(dil * (kh - 1) + 1, 7)),
        w=draw(st.integers(dil * (kw - 1) + 1, 7)),
        kh=kh,
        kw=kw,
        stride=draw(st.integers(1, 2)),
        pad=draw(st.integers(0, 1)),
        dil=dil,
        group=group,
        bias=draw(st.booleans()),
        dtype=draw(DTYPES),
        seed=draw(st.integers(0, 99)),
    )


@settings(max_examples=20)
@given(case=conv_cases())
def test_conv_forward_matches_conv2d(case: dict) -> None:
    c = case
    x = _randn(c["seed"], c["n"], c["c"], c["h"], c["w"], dtype=c["dtype"])
    w = _randn(c["seed"] + 1, c["m"], c["c"] // c["group"], c["kh"], c["kw"], dtype=c["dtype"])
    b = _randn(c["seed"] + 2, c["m"], dtype=c["dtype"]) if c["bias"] else None
    inputs = [x, w] + ([b] if b is not None else [])
    (y,) = run_kernel(
        "Conv",
        inputs,
        kernel_h=c["kh"],
        kernel_w=c["kw"],
        stride=c["stride"],
        pad=c["pad"],
        dilation=c["dil"],
        group=c["group"],
    )
    _close(y, F.conv2d(x, w, b, c["stride"], c["pad"], c["dil"], c["group"]))


@pytest.mark.parametrize(
    "args",
    [
        dict(kernel=3),
        dict(kernel=3, stride=2, pad=1),
        dict(kernels=[3, 2], strides=[2, 1], pads=[1, 0, 1, 0], dilations=[1, 2]),
        dict(kernel=3, pad_t=1, pad_l=0, pad_b=2, pad_r=1),
        dict(kernel=2, group=2, stride_h=2, stride_w=1, dilation=2),
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_gradient(args: dict, bias: bool) -> None:
    group = args.get("group", 1)
    x, w, b = _randn(0, 2, 4, 7, 6), _randn(1, 6, 4 // group, *_kernel(args)), _randn(2, 6)
    stride, dilation = _pair(args, "stride"), _pair(args, "dilation")
    pads = args.get("pads") or [args.get(k, args.get("pad", 0)) for k in ("pad_t", "pad_l", "pad_b", "pad_r")]

    def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        xp = F.pad(x, (pads[1], pads[3], pads[0], pads[2]))
        return F.conv2d(xp, w, b, stride, 0, dilation, group)

    inputs = [x, w, b] if bias else [x, w]
    grads = check_gradient("Conv", inputs, reference, wrt=tuple(range(len(inputs))), **args)
    assert len(grads) == len(inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size, stride", [((1, 1), 2), ((1, 2), 3), ((2, 2), 4)])
def test_reduced_precision_conv_gradient_with_one_output_position(
    dtype: torch.dtype, size: tuple[int, int], stride: int
) -> None:
    """A strided 3x3 conv whose output is 1x1 (ResNet's last stages on small images): oneDNN's bf16 weight
    gradient returned NaN or 1e12 there in about one run of two; every run matches fp64 autograd."""
    for seed in range(8):
        x, w, dy = _randn(seed, 8, 16, *size), _randn(seed + 100, 16, 16, 3, 3), _randn(seed + 200, 8, 16, 1, 1)
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        want = torch.autograd.grad(F.conv2d(*leaves, None, stride, 1), leaves, dy)
        op = make_op("Conv", 2, kernel=3, stride=stride, pad=1)
        inputs = [x.to(dtype), w.to(dtype)]
        out = run_gradient(op, inputs, run_op(op, inputs), {0: dy.to(dtype)})
        for got, expected in zip(out, want):
            assert got.dtype == dtype
            assert (got.double() - expected).abs().max() < 0.05 * expected.abs().max()


def _kernel(args: dict) -> tuple[int, int]:
    return tuple(args["kernels"]) if "kernels" in args else (args["kernel"], args["kernel"])


def _pair(args: dict, name: str) -> tuple[int, int]:
    if f"{name}s" in args:
        return tuple(args[f"{name}s"])
    one = args.get(name, 1)
    return args.get(f"{name}_h", one), args.get(f"{name}_w", one)


def test_conv_asymmetric_pads_shape() -> None:
    x, w = _randn(0, 1, 2, 5, 5), _randn(1, 3, 2, 3, 3)
    (y,) = run_kernel("Conv", [x, w], kernel=3, pad_t=0, pad_l=1, pad_b=2, pad_r=0)
    assert y.shape == (1, 3, 5, 4)  # (5 + 0 + 2 - 3) + 1, (5 + 1 + 0 - 3) + 1
    _close(y, F.conv2d(F.pad(x, (1, 0, 0, 2)), w))


def test_conv_infers_kernel_from_filter_and_checks_it() -> None:
    x, w = _randn(0, 1, 2, 5, 5), _randn(1, 3, 2, 3, 3)
    (y,) = run_kernel("Conv", [x, w])
    _close(y, F.conv2d(x, w))
    with pytest.raises(ValueError, match="does not match kernel"):
        run_kernel("Conv", [x, w], kernel=2)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(kernel=3, kernel_h=3, kernel_w=3), "one form only"),
        (dict(kernel=3, pad=1, pads=[1, 1, 1, 1]), "one form only"),
        (dict(kernels=[3]), "kernels needs 2 values"),
        (dict(kernel=3, stride=0), "stride must be >= 1"),
        (dict(kernel=3, order="CHWN"), "NCHW only"),  # NHWC runs: tests/ops/test_nhwc.py
    ],
)
def test_conv_rejects_bad_arguments(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_kernel("Conv", [_randn(0, 1, 2, 5, 5), _randn(1, 3, 2, 3, 3)], **args)


def test_conv_gradient_maker_outputs() -> None:
    op = OperatorDef("Conv", ["x", "w", "b"], ["y"], {"kernel": 3})
    (grad,), grad_inputs = gradient_ops(op, ["y_grad"])
    assert (grad.type, grad.inputs, grad.outputs) == (
        "ConvGradient",
        ["x", "w", "y_grad"],
        ["w_grad", "b_grad", "x_grad"],
    )
    assert grad.args["kernel"] == 3 and grad_inputs == ["x_grad", "w_grad", "b_grad"]
    (grad,), _ = gradient_ops(OperatorDef("Conv", ["x", "w"], ["y"], {"kernel": 3}), ["y_grad"])
    assert grad.outputs == ["w_grad", "x_grad"]


# ---------------------------------------------------------------------------------------------------- pooling


@st.composite
def pool_cases(draw: st.DrawFn) -> dict:
    k = draw(st.integers(1, 3))
    return dict(
        k=k,
        stride=draw(st.integers(1, 3)),
        pad=draw(st.integers(0, k // 2)),
        h=draw(st.integers(k, 8)),
        w=draw(st.integers(k, 8)),
        dtype=draw(DTYPES),
        seed=draw(st.integers(0, 99)),
    )


@settings(max_examples=20)
@given(case=pool_cases())
def test_pool_forward_matches_torch(case: dict) -> None:
    c = case
    x = _randn(c["seed"], 2, 3, c["h"], c["w"], dtype=c["dtype"])
    (y,) = run_kernel("MaxPool", [x], kernel=c["k"], stride=c["stride"], pad=c["pad"])
    _close(y, F.max_pool2d(x, c["k"], c["stride"], c["pad"]))
    (y,) = run_kernel("AveragePool", [x], kernel=c["k"], stride=c["stride"], pad=c["pad"])
    _close(y, F.avg_pool2d(x, c["k"], c["stride"], c["pad"], count_include_pad=False))


def _caffe2_average_pool(
    x: torch.Tensor, k: tuple[int, int], s: tuple[int, int], pads: tuple[int, int, int, int]
) -> torch.Tensor:
    """Caffe2's CPU AveragePool loop: each window divided by its count of non-padded cells."""
    t, left, b, r = pads
    h, w = x.shape[-2:]
    oh, ow = (h + t + b - k[0]) // s[0] + 1, (w + left + r - k[1]) // s[1] + 1
    y = x.new_zeros(*x.shape[:-2], oh, ow)
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * s[0] - t, j * s[1] - left
            h1, w1 = min(h0 + k[0], h), min(w0 + k[1], w)
            y[..., i, j] = x[..., max(h0, 0) : h1, max(w0, 0) : w1].mean((-2, -1))
    return y


@pytest.mark.parametrize("pads", [(0, 1, 2, 0), (2, 2, 2, 2), (1, 0, 0, 1)])
def test_pools_with_explicit_pads(pads: tuple[int, int, int, int]) -> None:
    x = _randn(0, 2, 3, 6, 7)
    args = dict(kernels=[3, 3], strides=[2, 1], pads=list(pads))
    (y,) = run_kernel("AveragePool", [x], **args)
    _close(y, _caffe2_average_pool(x, (3, 3), (2, 1), pads))
    check_gradient("AveragePool", [x], lambda x: _caffe2_average_pool(x, (3, 3), (2, 1), pads), **args)
    t, left, b, r = pads
    reference = lambda x: F.max_pool2d(F.pad(x, (left, r, t, b), value=-math.inf), 3, (2, 1))  # noqa: E731
    (y,) = run_kernel("MaxPool", [x], **args)
    _close(y, reference(x))
    check_gradient("MaxPool", [x], reference, **args)


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize(
    "args", [dict(kernel=2, stride=2), dict(kernel=3, stride=1, pad=1), dict(global_pooling=True)]
)
def test_pool_gradient(op_type: str, args: dict) -> None:
    x = _randn(1, 2, 3, 6, 5)

    def reference(x: torch.Tensor) -> torch.Tensor:
        if args.get("global_pooling"):
            return x.amax((2, 3), keepdim=True) if op_type == "MaxPool" else x.mean((2, 3), keepdim=True)
        k, s, p = args["kernel"], args["stride"], args.get("pad", 0)
        if op_type == "MaxPool":
            return F.max_pool2d(x, k, s, p)
        return F.avg_pool2d(x, k, s, p, count_include_pad=False)

    check_gradient(op_type, [x], reference, **args)


@pytest.mark.parametrize(
    "args, pads",
    [
        (dict(kernel=2, stride=2), (0, 0, 0, 0)),
        (dict(kernel=3, stride=1, pad=1), (0, 0, 0, 0)),
        (dict(global_pooling=True), (0, 0, 0, 0)),
        (dict(kernels=[3, 3], strides=[2, 1], pads=[0, 1, 2, 0]), (1, 0, 0, 2)),  # F.pad order
    ],
)
def test_max_pool_records_indices_and_its_gradient_uses_them(args: dict, pads: tuple) -> None:
    x = _randn(1, 2, 3, 6, 5)

    def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xp = F.pad(x, pads, value=-math.inf)
        if args.get("global_pooling"):
            return F.max_pool2d(xp, xp.shape[-2:], return_indices=True)
        kernel = args.get("kernel") or args["kernels"]
        stride = args.get("stride") or args["strides"]
        return F.max_pool2d(xp, kernel, stride, args.get("pad", 0), return_indices=True)

    op = make_op("MaxPool", 1, 2, **args)
    (grad,), _ = gradient_ops(op, ["Y0_grad", None])
    assert (grad.type, grad.inputs) == ("MaxPoolWithIndexGradient", ["X0", "Y0_grad", "Y1"])
    (_, indices) = run_op(op, [x])
    assert indices.dtype == torch.int64 and torch.equal(indices, reference(x)[1])
    check_gradient("MaxPool", [x], reference, n_outputs=2, **args)


def test_max_pool_gradient_routes_dy_by_the_given_indices() -> None:
    x, dy = torch.ones(1, 1, 2, 2, dtype=torch.float64), torch.full((1, 1, 1, 1), 3.0, dtype=torch.float64)
    grad = OperatorDef("MaxPoolWithIndexGradient", ["x", "dy", "idx"], ["dx"], {"kernel": 2})
    (dx,) = run_op(grad, [x, dy, torch.tensor([[[[3]]]])])  # not the recomputed 0
    assert dx.flatten().tolist() == [0.0, 0.0, 0.0, 3.0]


def test_max_pool_gradient_ties_go_to_one_element() -> None:
    """Documented difference from Caffe2's CPU kernel: a tied max gets dY once, not per copy."""
    x = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    op = make_op("MaxPool", 1, kernel=2)
    (y,) = run_op(op, [x])
    (dx,) = run_gradient(op, [x], [y], {0: torch.ones_like(y)})
    assert dx.sum().item() == 1.0 and dx.max().item() == 1.0


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(), "needs a kernel"),
        (dict(kernel=2, pad=2), "smaller than the kernel"),
        (dict(global_pooling=True, kernel=2, stride=2), "pad must be 0 and stride 1"),
        (dict(kernel=2, order="CHWN"), "NCHW only"),
    ],
)
def test_pool_rejects_bad_arguments(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_kernel("MaxPool", [_randn(0, 1, 1, 4, 4)], **args)


# ---------------------------------------------------------------------------------------------------- activations

ACTIVATIONS = {
    "Relu": (torch.relu, {}),
    "LeakyRelu": (lambda x: F.leaky_relu(x, 0.2), {"alpha": 0.2}),
    "Sigmoid": (torch.sigmoid, {}),
    "Tanh": (torch.tanh, {}),
    "Softmax": (lambda x: torch.softmax(x.reshape(3, -1), 1).reshape(x.shape), {}),
}


@pytest.mark.parametrize("op_type", sorted(ACTIVATIONS))
@given(dtype=DTYPES, seed=st.integers(0, 99), shape=st.sampled_from([(3, 4), (3, 2, 5), (3, 1, 2, 2)]))
@settings(max_examples=8)
def test_activation_forward(op_type: str, dtype: torch.dtype, seed: int, shape: tuple) -> None:
    fn, args = ACTIVATIONS[op_type]
    x = _randn(seed, *shape, dtype=dtype)
    (y,) = run_kernel(op_type, [x], **args)
    _close(y, fn(x))


@pytest.mark.parametrize("op_type", sorted(ACTIVATIONS))
def test_activation_gradient(op_type: str) -> None:
    fn, args = ACTIVATIONS[op_type]
    check_gradient(op_type, [_randn(3, 3, 2, 5)], fn, **args)


@pytest.mark.parametrize("op_type", ["Relu", "LeakyRelu", "Sigmoid", "Tanh"])
def test_activation_in_place_gradient_reads_output(op_type: str) -> None:
    op = OperatorDef(op_type, ["x"], ["x"])
    check_operator(op)
    (grad,), grad_inputs = gradient_ops(op, ["x_grad"])
    assert (grad.inputs, grad.outputs, grad_inputs) == (["x", "x_grad"], ["x_grad"], ["x_grad"])


@pytest.mark.parametrize("axis", [2, -1, 0])
def test_softmax_axis(axis: int) -> None:
    x = _randn(4, 2, 3, 4)
    lead = math.prod(x.shape[: axis % 3])

    def ref(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.reshape(lead, -1), 1).reshape(x.shape)

    check_gradient("Softmax", [x], ref, axis=axis)


@pytest.mark.parametrize(
    "op_type, inputs, args",
    [
        ("Softmax", [_randn(0, 5)], {}),  # a 1-D input would give all ones
        ("Softmax", [_randn(0, 2, 3)], {"axis": 2}),
        ("Softmax", [_randn(0, 2, 3)], {"axis": -3}),
        ("SoftmaxGradient", [_randn(0, 2, 3), _randn(1, 2, 3)], {"axis": 2}),
        ("FC", [_randn(0, 5), _randn(1, 3, 1), _randn(2, 3)], {}),  # would be read as [5, 1]
        ("FCGradient", [_randn(0, 5), _randn(1, 3, 1), _randn(2, 5, 3)], {"n_outputs": 3}),
    ],
)
def test_axis_out_of_range_raises_naming_the_op(op_type: str, inputs: list, args: dict) -> None:
    with pytest.raises(ValueError, match=rf"{op_type}\(.*axis -?\d is out of range"):
        run_kernel(op_type, inputs, **args)


def test_leaky_relu_gradient_refuses_negative_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        run_kernel("LeakyReluGradient", [_randn(0, 3), _randn(1, 3)], alpha=-0.5)


# ---------------------------------------------------------------------------------------------------- Dropout


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.75])
def test_dropout_train(ratio: float) -> None:
    x = _randn(0, 64, 64, dtype=torch.float32)
    y, mask = run_kernel("Dropout", [x], n_outputs=2, ratio=ratio, generator=torch.Generator().manual_seed(5))
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert abs(mask.double().mean().item() - (1 - ratio)) < 0.03
    _close(y, x * mask / (1 - ratio))
    again, mask2 = run_kernel(
        "Dropout", [x], n_outputs=2, ratio=ratio, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(mask, mask2) and torch.equal(y, again)


def test_dropout_gradient_uses_the_mask() -> None:
    x = _randn(0, 5, 6)
    _, mask = run_kernel("Dropout", [x], n_outputs=2, ratio=0.4)  # same seed as check_gradient's run
    check_gradient("Dropout", [x], lambda x: (x * mask / 0.6, mask), n_outputs=2, ratio=0.4)


def test_dropout_test_mode_is_identity() -> None:
    x = _randn(0, 3, 4)
    (y,) = run_kernel("Dropout", [x], ratio=0.5, is_test=True)
    assert torch.equal(y, x)
    op = OperatorDef("Dropout", ["x"], ["y"], {"is_test": True})
    (grad,), _ = gradient_ops(op, ["y_grad"])
    assert grad.inputs == ["y_grad"]
    (dx,) = run_op(grad, [x])
    assert torch.equal(dx, x)


def test_dropout_ratio_one_drops_everything() -> None:
    y, mask = run_kernel("Dropout", [_randn(0, 4, 4)], n_outputs=2, ratio=1.0)
    assert not mask.any() and torch.equal(y, torch.zeros_like(y))


def test_dropout_training_needs_mask_output() -> None:
    with pytest.raises(ValueError, match="needs two outputs"):
        run_kernel("Dropout", [_randn(0, 3)], n_outputs=1, ratio=0.5)
