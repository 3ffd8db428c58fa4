"""Neural-network operators: FC, Conv, pooling, activations, Softmax and Dropout (layout NCHW).

Each op is one `register_op` call: schema, kernel factory, gradient maker and doc. Gradient kernels
use PyTorch's backward primitives (`aten.convolution_backward`, `aten.max_pool2d_with_indices_backward`,
...) and never re-run the forward under autograd.

Spatial arguments follow Caffe2's ConvPoolOpBase: each of kernel, stride, pad and dilation may be given
as one value (`kernel`), per side (`kernel_h`/`kernel_w`; `pad_t`/`pad_l`/`pad_b`/`pad_r`) or as a list
(`kernels`; `pads` = [t, l, b, r], heads then tails), one form per quantity. Asymmetric pads are applied
with `F.pad` before the PyTorch kernel, whose own padding is symmetric.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import GI, KernelContext, Precision, PrecisionRule, Trait, gradient_op, register_op
from graphpar.ops.common import elementwise_grad, one_input_gradient, op_label, register_gradient, shaped

aten = torch.ops.aten


# ----------------------------------------------------------------------------------------------------
# Helpers shared with norm.py and loss.py
# ----------------------------------------------------------------------------------------------------


def require_nchw(args: SimpleNamespace, ctx: KernelContext) -> None:
    """Raise ValueError unless the op's `order` argument is NCHW (graphpar's only layout)."""
    if args.order != "NCHW":
        raise ValueError(
            f"{op_label(ctx.op)}: order={args.order!r} is not supported; graphpar is NCHW "
            f"only: convert with NHWC2NCHW and drop the order argument"
        )


def _to_nchw(x: torch.Tensor) -> torch.Tensor:
    """NHWC [N, H, W, C] as a contiguous NCHW tensor (a filter [M, kh, kw, C] likewise), so the NCHW
    kernel reduces in the same order and gives bit-identical results; other ranks are unchanged."""
    return x.permute(0, 3, 1, 2).contiguous() if x.dim() == 4 else x


def _to_nhwc(y: torch.Tensor) -> torch.Tensor:
    """The inverse of `_to_nchw`, made contiguous (NHWC ops hand out plain row-major blobs)."""
    return y.permute(0, 2, 3, 1).contiguous() if y.dim() == 4 else y


def nhwc_capable(factory: Callable[[SimpleNamespace, KernelContext], Callable[..., Any]]) -> Callable[..., Any]:
    """A kernel factory that also runs `order="NHWC"` (Caffe2's CPU layout): the NCHW kernel runs on
    4-D inputs permuted to NCHW (filters [M, kh, kw, C] permute the same way) and its 4-D outputs
    are permuted back, so results equal NCHW's exactly. Other orders still reach `require_nchw`."""

    def make(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., Any]:
        if getattr(a, "order", "NCHW") != "NHWC":
            return factory(a, ctx)
        kernel = factory(SimpleNamespace(**{**vars(a), "order": "NCHW"}), ctx)

        def run(*inputs: torch.Tensor) -> Any:
            out = kernel(*map(_to_nchw, inputs))
            return tuple(map(_to_nhwc, out)) if isinstance(out, tuple) else _to_nhwc(out)

        return run

    make.__name__ = make.__qualname__ = getattr(factory, "__name__", "kernel")
    return make


def flatten_2d(x: torch.Tensor, axis: int, op: OperatorDef | None = None) -> torch.Tensor:
    """X viewed as [prod(shape[:axis]), prod(shape[axis:])] (Caffe2's canonical 2-D view).

    Raises ValueError (naming `op`) unless -ndim <= axis < ndim, as Caffe2's canonical_axis_index
    does: past the last dim every row would hold one element, so e.g. a Softmax would be all ones.
    """
    ndim = x.dim()
    if not -ndim <= axis < ndim:
        where = f"{op_label(op)}: " if op is not None else ""
        raise ValueError(f"{where}axis {axis} is out of range for a {ndim}-d input of shape "
                         f"{tuple(x.shape)}; use an axis in [{-ndim}, {ndim})")
    axis = axis + ndim if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


# ----------------------------------------------------------------------------------------------------
# FC
# ----------------------------------------------------------------------------------------------------


def _fc(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def fc(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x2, w2 = flatten_2d(x, a.axis, ctx.op), flatten_2d(w, a.axis_w, ctx.op)
        if b.numel() != w2.shape[0]:
            raise ValueError(
                f"{op_label(ctx.op)}: bias has {b.numel()} elements, W has {w2.shape[0]} "
                f"output rows (shape {tuple(w.shape)})"
            )
        axis = a.axis + x.dim() if a.axis < 0 else a.axis
        return shaped(F.linear(x2, w2, b.reshape(-1)), (*x.shape[:axis], w2.shape[0]))

    return fc


def _with_input_gradient(a: SimpleNamespace, ctx: KernelContext, counts: tuple[int, int]) -> bool:
    """Whether a gradient op computes dX (its last output): not with `no_gradient_to_input` (Caffe2's).

    Raises ValueError when the op does not have `counts[0]` outputs without dX or `counts[1]` with it.
    """
    with_dx = not a.no_gradient_to_input
    if len(ctx.op.outputs) != counts[with_dx]:
        raise ValueError(
            f"{op_label(ctx.op)}: with no_gradient_to_input={int(not with_dx)} the op has "
            f"{counts[with_dx]} outputs, got {len(ctx.op.outputs)}"
        )
    return with_dx


def _fc_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    with_dx = _with_input_gradient(a, ctx, (2, 3))

    def fc_grad(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple:
        x2, w2 = flatten_2d(x, a.axis, ctx.op), flatten_2d(w, a.axis_w, ctx.op)
        dy2 = dy.reshape(x2.shape[0], w2.shape[0])
        dw, db = shaped(dy2.t().mm(x2), w.shape), dy2.sum(0)
        return (dw, db, shaped(dy2.mm(w2), x.shape)) if with_dx else (dw, db)

    return fc_grad


register_op(
    "FC",
    inputs=3,
    outputs=1,
    args={"axis": 1, "axis_w": 1},
    kernel=_fc,
    precision=Precision.LOW,
    gradient=lambda op, g: (
        [gradient_op("FCGradient", [op.inputs[0], op.inputs[1], g[0]], [GI(op, 1), GI(op, 2), GI(op, 0)])],
        [GI(op, 0), GI(op, 1), GI(op, 2)],
    ),
    doc="Fully connected: X (flattened to [M, K] at `axis`), W [N, K] (flattened at `axis_w`), b [N] "
    "-> Y = X·Wᵀ + b with shape X.shape[:axis] + [N].",
)

register_gradient(
    "FCGradient", "FC", _fc_grad, inputs=3, outputs=(2, 3), args={"no_gradient_to_input": False},
    doc="FCGradient(X, W, dY) -> dW = dYᵀ·X, db = Σ_rows dY, dX = dY·W (X and W flattened as in FC). "
    "no_gradient_to_input=1 (Caffe2's arg; autodiff sets it when nobody wants dX) drops dX, the last "
    "output.",
)


# ----------------------------------------------------------------------------------------------------
# Conv and pooling geometry
# ----------------------------------------------------------------------------------------------------

_SPATIAL_ARGS = {
    "kernel": 0,
    "kernel_h": 0,
    "kernel_w": 0,
    "kernels": (),
    "stride": 1,
    "stride_h": 1,
    "stride_w": 1,
    "strides": (),
    "pad": 0,
    "pad_t": 0,
    "pad_l": 0,
    "pad_b": 0,
    "pad_r": 0,
    "pads": (),
    "order": "NCHW",
}
_DILATION_ARGS = {"dilation": 1, "dilation_h": 1, "dilation_w": 1, "dilations": ()}


@dataclass(frozen=True)
class _Geometry:
    """Parsed spatial arguments; pads are (t, l, b, r)."""

    kernel: tuple[int, int] | None
    stride: tuple[int, int]
    pads: tuple[int, int, int, int]
    dilation: tuple[int, int]

    @property
    def symmetric(self) -> bool:
        return self.pads[0] == self.pads[2] and self.pads[1] == self.pads[3]

    @property
    def padding(self) -> tuple[int, int]:
        """The symmetric padding a PyTorch kernel takes."""
        return self.pads[0], self.pads[1]

    @property
    def f_pad(self) -> tuple[int, int, int, int]:
        """The pads in F.pad's order (l, r, t, b)."""
        return self.pads[1], self.pads[3], self.pads[0], self.pads[2]


def _one_form(
    a: SimpleNamespace, op: OperatorDef, single: str, sides: tuple[str, ...], plural: str, default: Any
) -> Any:
    """One spatial quantity from whichever of its three forms the op was given (at most one)."""
    used = [form for form in ((single,), sides, (plural,)) if any(n in op.args for n in form)]
    if len(used) > 1:
        raise ValueError(
            f"{op_label(op)}: give {single} in one form only, got "
            f"{sorted(n for form in used for n in form if n in op.args)}"
        )
    if plural in op.args:
        values = tuple(getattr(a, plural))
        if len(values) != len(sides):
            raise ValueError(f"{op_label(op)}: {plural} needs {len(sides)} values, got {list(values)}")
        return values
    if used and used[0] is sides:
        return tuple(getattr(a, n) for n in sides)
    if single in op.args:
        return (getattr(a, single),) * len(sides)
    return default


def _geometry(a: SimpleNamespace, ctx: KernelContext) -> _Geometry:
    """Parse and check kernel/stride/pad/dilation; raise ValueError naming the op on a bad value."""
    op = ctx.op
    require_nchw(a, ctx)
    geo = _Geometry(
        kernel=_one_form(a, op, "kernel", ("kernel_h", "kernel_w"), "kernels", None),
        stride=_one_form(a, op, "stride", ("stride_h", "stride_w"), "strides", (1, 1)),
        pads=_one_form(a, op, "pad", ("pad_t", "pad_l", "pad_b", "pad_r"), "pads", (0, 0, 0, 0)),
        dilation=(
            _one_form(a, op, "dilation", ("dilation_h", "dilation_w"), "dilations", (1, 1))
            if hasattr(a, "dilation")
            else (1, 1)
        ),
    )
    for name, values, low in (
        ("kernel", geo.kernel or (1,), 1),
        ("stride", geo.stride, 1),
        ("pad", geo.pads, 0),
        ("dilation", geo.dilation, 1),
    ):
        if min(values) < low:
            raise ValueError(f"{op_label(op)}: every {name} must be >= {low}, got {list(values)}")
    return geo


def _crop(dx_padded: torch.Tensor, x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """The gradient of F.pad: the unpadded window of a padded-input gradient."""
    t, left = geo.pads[0], geo.pads[1]
    return dx_padded[..., t : t + x.shape[-2], left : left + x.shape[-1]].contiguous()


# ----------------------------------------------------------------------------------------------------
# Conv
# ----------------------------------------------------------------------------------------------------


def _conv_plan(a: SimpleNamespace, ctx: KernelContext) -> tuple[_Geometry, tuple[int, int], Callable]:
    """Geometry, torch padding, and `prepare(x, w) -> x` (checks the filter, applies asymmetric pads)."""
    geo = _geometry(a, ctx)

    def prepare(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if geo.kernel is not None and tuple(w.shape[2:]) != geo.kernel:
            raise ValueError(
                f"{op_label(ctx.op)}: filter shape {tuple(w.shape)} does not match kernel {list(geo.kernel)}"
            )
        return x if geo.symmetric else F.pad(x, geo.f_pad)

    return geo, geo.padding if geo.symmetric else (0, 0), prepare


def _conv(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    geo, padding, prepare = _conv_plan(a, ctx)

    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.conv2d(prepare(x, w), w, b, geo.stride, padding, geo.dilation, a.group)

    return conv


_REDUCED = (torch.bfloat16, torch.float16)


def _backward_stride(x: torch.Tensor, w: torch.Tensor, geo: _Geometry, padding: tuple[int, int]) -> tuple[int, ...]:
    """The stride to give convolution_backward: `geo.stride`, except on CPU in bf16/fp16 where an axis with
    one output position and a stride past the window's slack gets the smallest stride that keeps that one
    position. The result is the same (a single position has no stride), and oneDNN's reduced-precision
    weight gradient reads uninitialised memory for the larger stride (torch 2.13: a 1x1 input, 3x3 kernel,
    pad 1, stride 2 gives NaN or 1e12 in dW in about one run of two)."""
    if x.device.type != "cpu" or x.dtype not in _REDUCED:
        return geo.stride
    stride = []
    for axis, (step, pad, dilation) in enumerate(zip(geo.stride, padding, geo.dilation)):
        slack = x.shape[2 + axis] + 2 * pad - dilation * (w.shape[2 + axis] - 1) - 1
        stride.append(min(step, slack + 1) if slack < step else step)
    return tuple(stride)


def _conv_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    geo, padding, prepare = _conv_plan(a, ctx)
    with_bias = len(ctx.op.outputs) == 3 or (len(ctx.op.outputs) == 2 and a.no_gradient_to_input)
    with_dx = _with_input_gradient(a, ctx, (1 + with_bias, 2 + with_bias))

    def conv_grad(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple:
        padded = prepare(x, w)
        dx, dw, db = aten.convolution_backward(
            dy,
            padded,
            w,
            [w.shape[0]] if with_bias else None,
            _backward_stride(padded, w, geo, padding),
            padding,
            geo.dilation,
            False,
            (0, 0),
            a.group,
            (with_dx, True, with_bias),
        )
        dx = dx if geo.symmetric or not with_dx else _crop(dx, x, geo)
        grads = (dw, *((db,) if with_bias else ()), *((dx,) if with_dx else ()))
        return grads if len(grads) > 1 else dw

    return conv_grad


def _conv_gradient(op: OperatorDef, g: list) -> tuple[list, list]:
    outs = [GI(op, 1), GI(op, 2), GI(op, 0)] if len(op.inputs) == 3 else [GI(op, 1), GI(op, 0)]
    grad = gradient_op("ConvGradient", [op.inputs[0], op.inputs[1], g[0]], outs)
    return [grad], [GI(op, i) for i in range(len(op.inputs))]


register_op(
    "Conv",
    inputs=(2, 3),
    outputs=1,
    args={**_SPATIAL_ARGS, **_DILATION_ARGS, "group": 1},
    kernel=nhwc_capable(_conv),
    gradient=_conv_gradient,
    traits=(Trait.CONVOLUTION,),
    precision=Precision.LOW,
    doc="2-D convolution, NCHW: X [N, C, H, W], filter [M, C/group, kh, kw], optional bias [M] -> Y. "
    "kernel (checked against the filter; inferred from it when absent), stride, pad (asymmetric "
    "pads allowed), dilation and group as in Caffe2; out = floor((in + pad_head + pad_tail - "
    "(d·(k-1)+1)) / stride) + 1.",
)

register_gradient(
    "ConvGradient", "Conv", nhwc_capable(_conv_grad), inputs=3, outputs=(1, 3), args={"no_gradient_to_input": False},
    doc="ConvGradient(X, filter, dY) -> dfilter, [dbias], dX (dbias when the Conv had a bias), through "
    "aten.convolution_backward. no_gradient_to_input=1 (Caffe2's arg) drops dX, the last output.",
)


# ----------------------------------------------------------------------------------------------------
# MaxPool / AveragePool
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PoolPlan:
    """Per-input pooling parameters: PyTorch kernel/stride/padding, plus F.pad pads when needed."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    geo: _Geometry | None  # set when pads are applied with F.pad first (asymmetric or > kernel / 2)


def _pool_planner(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], _PoolPlan]:
    """`plan(x)`: fixed for explicit kernels; the whole H x W for global pooling."""
    geo = _geometry(a, ctx)
    if a.global_pooling:  # Caffe2's rule: a kernel is ignored (the window is H x W); pad 0, stride 1
        if max(geo.pads) > 0 or geo.stride != (1, 1):
            raise ValueError(f"{op_label(ctx.op)}: with global_pooling, pad must be 0 and stride 1 "
                             f"(a kernel is ignored), got pads {list(geo.pads)}, stride {list(geo.stride)}")
        return lambda x: _PoolPlan((x.shape[-2], x.shape[-1]), (1, 1), (0, 0), None)
    if geo.kernel is None:
        raise ValueError(
            f"{op_label(ctx.op)}: needs a kernel (kernel, kernel_h/kernel_w or kernels) or global_pooling=1"
        )
    if any(p >= geo.kernel[i % 2] for i, p in enumerate(geo.pads)):
        raise ValueError(
            f"{op_label(ctx.op)}: pads {list(geo.pads)} must be smaller than the kernel {list(geo.kernel)}"
        )
    direct = geo.symmetric and all(2 * p <= k for p, k in zip(geo.padding, geo.kernel))
    plan = _PoolPlan(geo.kernel, geo.stride, geo.padding if direct else (0, 0), None if direct else geo)
    return lambda x: plan


def _padded_empty(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """An uninitialised tensor shaped like X after F.pad: a pooling backward reads only its shape."""
    left, r, t, b = geo.f_pad
    return x.new_empty((*x.shape[:-2], x.shape[-2] + t + b, x.shape[-1] + left + r))


def _max_pool(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], Any]:
    planner = _pool_planner(a, ctx)
    with_indices = len(ctx.op.outputs) == 2

    def max_pool(x: torch.Tensor) -> Any:
        p = planner(x)
        x = x if p.geo is None else F.pad(x, p.geo.f_pad, value=-math.inf)
        if with_indices:
            return tuple(aten.max_pool2d_with_indices(x, p.kernel, p.stride, p.padding))
        return F.max_pool2d(x, p.kernel, p.stride, p.padding)

    return max_pool


def _max_pool_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    planner = _pool_planner(a, ctx)

    def max_pool_grad(x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        p = planner(x)
        xp = x if p.geo is None else F.pad(x, p.geo.f_pad, value=-math.inf)
        _, indices = aten.max_pool2d_with_indices(xp, p.kernel, p.stride, p.padding)
        return _route_to_indices(p, x, xp, dy, indices)

    return max_pool_grad


def _max_pool_with_index_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    planner = _pool_planner(a, ctx)

    def max_pool_with_index_grad(x: torch.Tensor, dy: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        p = planner(x)
        return _route_to_indices(p, x, x if p.geo is None else _padded_empty(x, p.geo), dy, indices)

    return max_pool_with_index_grad


def _route_to_indices(
    p: _PoolPlan, x: torch.Tensor, xp: torch.Tensor, dy: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """dX: each dY element added at its window's arg-max `indices` (within the padded plane `xp`)."""
    dx = aten.max_pool2d_with_indices_backward(dy, xp, p.kernel, p.stride, p.padding, (1, 1), False, indices)
    return dx if p.geo is None else _crop(dx, x, p.geo)


def _max_pool_gradient(op: OperatorDef, g: list) -> tuple[list, list]:
    """MaxPoolGradient(X, Y, dY); with recorded indices MaxPoolWithIndexGradient(X, dY, indices), which
    keeps Y out of the backward pass so it can be freed after its last forward consumer's gradient."""
    if len(op.outputs) == 2:
        grad = gradient_op("MaxPoolWithIndexGradient", [op.inputs[0], g[0], op.outputs[1]], [GI(op, 0)])
    else:
        grad = gradient_op("MaxPoolGradient", [op.inputs[0], op.outputs[0], g[0]], [GI(op, 0)])
    return [grad], [GI(op, 0)]


def _pad_counts(x: torch.Tensor, p: _PoolPlan, geo: _Geometry) -> torch.Tensor:
    """How many non-padded elements each output window of an input padded by `geo` (F.pad) covers."""
    ones = torch.ones((1, 1, *x.shape[-2:]), dtype=x.dtype, device=x.device)
    return F.avg_pool2d(F.pad(ones, geo.f_pad), p.kernel, p.stride, divisor_override=1)


def _average_pool(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    planner = _pool_planner(a, ctx)

    def average_pool(x: torch.Tensor) -> torch.Tensor:
        p = planner(x)
        if p.geo is None:
            return F.avg_pool2d(x, p.kernel, p.stride, p.padding, count_include_pad=False)
        sums = F.avg_pool2d(F.pad(x, p.geo.f_pad), p.kernel, p.stride, divisor_override=1)
        return sums / _pad_counts(x, p, p.geo)

    return average_pool


def _average_pool_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    planner = _pool_planner(a, ctx)

    def average_pool_grad(x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        p = planner(x)
        if p.geo is None:
            return aten.avg_pool2d_backward(dy, x, p.kernel, p.stride, p.padding, False, False, None)
        dx = aten.avg_pool2d_backward(
            dy / _pad_counts(x, p, p.geo), _padded_empty(x, p.geo), p.kernel, p.stride, (0, 0), False, True, 1
        )
        return _crop(dx, x, p.geo)

    return average_pool_grad


def _pool_gradient(grad_type: str) -> Callable[[OperatorDef, list], tuple[list, list]]:
    def maker(op: OperatorDef, g: list) -> tuple[list, list]:
        return [gradient_op(grad_type, [op.inputs[0], op.outputs[0], g[0]], [GI(op, 0)])], [GI(op, 0)]

    return maker


_POOL_ARGS = {**_SPATIAL_ARGS, "global_pooling": False}

register_op(
    "MaxPool",
    outputs=(1, 2),
    args=_POOL_ARGS,
    kernel=nhwc_capable(_max_pool),
    gradient=_max_pool_gradient,
    precision=PrecisionRule(Precision.FOLLOW, outputs=(0,)),  # output 1: the arg-max indices
    doc="2-D max pooling, NCHW, with Conv's kernel/stride/pad arguments (pads must be smaller than the "
    "kernel; padded cells never win) or global_pooling over H x W. An optional second output records "
    "the arg-max indices (int64, PyTorch's, within each (padded) H x W plane), which MaxPoolGradient "
    "then reads instead of pooling X again (brew.max_pool asks for it when training).",
)

register_gradient(
    "MaxPoolGradient", "MaxPool", nhwc_capable(_max_pool_grad), inputs=3,
    doc="MaxPoolGradient(X, Y, dY) -> dX via aten.max_pool2d_with_indices_backward, with the arg-max "
    "recomputed from X. Ties: dY goes to ONE arg-max per window (PyTorch's first in scan order), whereas "
    "Caffe2's CPU kernel gave it to every element equal to the max; they differ only on exact ties.",
)

register_gradient(
    "MaxPoolWithIndexGradient", "MaxPool", nhwc_capable(_max_pool_with_index_grad), inputs=3,
    doc="MaxPoolWithIndexGradient(X, dY, indices) -> dX (Caffe2's name and inputs): dY routed to the "
    "arg-max indices MaxPool recorded as its second output; X gives only the shape.",
)

register_op(
    "AveragePool",
    args=_POOL_ARGS,
    kernel=nhwc_capable(_average_pool),
    gradient=_pool_gradient("AveragePoolGradient"),
    precision=Precision.FOLLOW,
    doc="2-D average pooling, NCHW, with Conv's kernel/stride/pad arguments or global_pooling; each "
    "window divides by its count of NON-padded elements (Caffe2 CPU, cuDNN EXCLUDE_PADDING).",
)

register_gradient(
    "AveragePoolGradient", "AveragePool", nhwc_capable(_average_pool_grad), inputs=3,
    doc="AveragePoolGradient(X, Y, dY) -> dX: each window's dY spread evenly over its non-padded cells.")


# ----------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------


def _leaky_relu_grad(a: SimpleNamespace, ctx: KernelContext, into_dy: bool = False) -> Callable[..., torch.Tensor]:
    if a.alpha < 0:
        raise ValueError(
            f"{op_label(ctx.op)}: alpha={a.alpha} < 0 flips the sign of Y, so the gradient "
            f"cannot be computed from Y; use alpha >= 0"
        )
    if into_dy:
        return _into_dy(lambda y, dy: aten.leaky_relu_backward(dy, y, a.alpha, True),
                        lambda y, dy: aten.leaky_relu_backward.grad_input(dy, y, a.alpha, True, grad_input=dy))
    return lambda y, dy: aten.leaky_relu_backward(dy, y, a.alpha, True)


def _in_place(fn: Callable[[torch.Tensor], torch.Tensor], fn_: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A reuse kernel (`register_op(reuse=...)`) for element-wise `fn`: its in-place form `fn_` on a
    floating-point input (others may change dtype, so they get `fn`)."""
    return lambda a, ctx: lambda x: fn_(x) if x.is_floating_point() else fn(x)


def _into_dy(backward: Callable, backward_into_dy: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`Grad(Y, dY) -> dX` writing dX into dY's storage where Y and dY agree in shape and dtype."""
    def run(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        if y.shape != dy.shape or y.dtype != dy.dtype:
            return backward(y, dy)
        return backward_into_dy(y, dy)

    return run


def _activation(name: str, fn: Callable, fn_: Callable, backward: Callable, backward_into_dy: Callable,
                doc: str, grad_doc: str, keeps_dtype: bool = False) -> None:
    """Register element-wise activation `name`, in place allowed, and `<name>Gradient(Y, dY) -> dX`, both
    with reuse kernels (`fn_`, and `backward_into_dy` writing into dY); `keeps_dtype`: `fn` never
    changes the dtype, so `fn_` serves every input as it is."""
    reuse = (lambda a, ctx: fn_) if keeps_dtype else _in_place(fn, fn_)
    register_op(name, inplace={(0, 0)}, kernel=lambda a, ctx: fn, reuse=(0, reuse),
                gradient=one_input_gradient(f"{name}Gradient", "Y"), precision=Precision.FOLLOW, doc=doc)
    elementwise_grad(f"{name}Gradient", name, backward, inplace={(1, 0)},
                     reuse=(1, lambda a, ctx: _into_dy(backward, backward_into_dy)), doc=grad_doc)


_activation("Relu", torch.relu, torch.relu_, lambda y, dy: aten.threshold_backward(dy, y, 0),
            lambda y, dy: aten.threshold_backward.grad_input(dy, y, 0, grad_input=dy),
            "Y = max(0, X); may run in place.", "ReluGradient(Y, dY) -> dX = dY where Y > 0, else 0.",
            keeps_dtype=True)

register_op(
    "LeakyRelu",
    inplace={(0, 0)},
    args={"alpha": 0.01},
    kernel=lambda a, ctx: lambda x: F.leaky_relu(x, a.alpha),
    reuse=(0, lambda a, ctx: lambda x: F.leaky_relu(x, a.alpha, inplace=x.is_floating_point())),
    gradient=one_input_gradient("LeakyReluGradient", "Y"),
    precision=Precision.FOLLOW,
    doc="Y = X where X > 0, else alpha·X (alpha = 0.01); may run in place.",
)

register_gradient("LeakyReluGradient", "LeakyRelu", _leaky_relu_grad, inplace={(1, 0)},
                  reuse=(1, functools.partial(_leaky_relu_grad, into_dy=True)),
                  doc="LeakyReluGradient(Y, dY) -> dX = dY where Y > 0, else alpha·dY (needs alpha >= 0).")

_activation("Sigmoid", torch.sigmoid, torch.sigmoid_, lambda y, dy: aten.sigmoid_backward(dy, y),
            lambda y, dy: aten.sigmoid_backward.grad_input(dy, y, grad_input=dy),
            "Y = 1 / (1 + exp(-X)); may run in place.", "SigmoidGradient(Y, dY) -> dX = dY·Y·(1 - Y).")
_activation("Tanh", torch.tanh, torch.tanh_, lambda y, dy: aten.tanh_backward(dy, y),
            lambda y, dy: aten.tanh_backward.grad_input(dy, y, grad_input=dy),
            "Y = tanh(X); may run in place.", "TanhGradient(Y, dY) -> dX = dY·(1 - Y²).")


# ----------------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------------


def _softmax(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.softmax(flatten_2d(x, a.axis, ctx.op), 1).reshape(x.shape)


def _softmax_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def softmax_grad(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        y2 = flatten_2d(y, a.axis, ctx.op)
        return aten._softmax_backward_data(dy.reshape(y2.shape), y2, 1, y.dtype).reshape(y.shape)

    return softmax_grad


register_op(
    "Softmax",
    args={"axis": 1},
    kernel=_softmax,
    gradient=one_input_gradient("SoftmaxGradient", "Y"),
    doc="Row softmax of X viewed as [prod(shape[:axis]), prod(shape[axis:])]; Y has X's shape.",
)

register_gradient("SoftmaxGradient", "Softmax", _softmax_grad, inplace={(1, 0)},
                  doc="SoftmaxGradient(Y, dY) -> dX = Y ⊙ (dY - Σ_row(dY ⊙ Y)) over the same 2-D view.")


# ----------------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------------


def _dropout_scale(a: SimpleNamespace, ctx: KernelContext) -> float:
    if not 0.0 <= a.ratio <= 1.0:
        raise ValueError(f"{op_label(ctx.op)}: ratio must be in [0, 1], got {a.ratio}")
    return 0.0 if a.ratio == 1.0 else 1.0 / (1.0 - a.ratio)


def _dropout(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], Any]:
    scale = _dropout_scale(a, ctx)
    if a.is_test:
        if len(ctx.op.outputs) == 2:
            return lambda x: (x, torch.ones_like(x, dtype=torch.bool))
        return lambda x: x
    if len(ctx.op.outputs) != 2:
        raise ValueError(f"{op_label(ctx.op)}: training mode (is_test=0) needs two outputs, Y and mask")

    next_generator = ctx.random_stream()

    def dropout(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.rand(x.shape, generator=next_generator(x.device), device=x.device) >= a.ratio
        return (x * mask).mul_(scale), mask

    return dropout


def _dropout_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    scale = _dropout_scale(a, ctx)
    if a.is_test:
        return lambda dy, *mask: dy
    if len(ctx.op.inputs) != 2:
        raise ValueError(f"{op_label(ctx.op)}: training mode (is_test=0) needs inputs dY and mask")
    return lambda dy, mask: (dy * mask).mul_(scale)


def _dropout_gradient(op: OperatorDef, g: list) -> tuple[list, list]:
    inputs = [g[0]] if op.args.get("is_test", False) else [g[0], op.outputs[1]]
    return [gradient_op("DropoutGrad", inputs, [GI(op, 0)])], [GI(op, 0)]


register_op(
    "Dropout",
    outputs=(1, 2),
    inplace={(0, 0)},
    args={"ratio": 0.5, "is_test": False},
    kernel=_dropout,
    gradient=_dropout_gradient,
    traits=(Trait.RANDOM,),
    precision=PrecisionRule(Precision.FOLLOW, outputs=(0,)),  # output 1: the bool mask
    doc="Training: mask ~ Bernoulli(1 - ratio) (bool, drawn on X's device from the op's random "
    "stream), Y = X·mask / (1 - ratio); outputs Y and mask. is_test=1: Y = X (a mask output, if any, "
    "is all true). May run in place.",
)

register_gradient(
    "DropoutGrad", "Dropout", _dropout_grad, inputs=(1, 2), inplace={(0, 0)},
    doc="DropoutGrad(dY, mask) -> dX = dY·mask / (1 - ratio); with is_test=1, DropoutGrad(dY) -> dY.",
)
