"""Tensor operators: copies, element-wise arithmetic, shape manipulation and reductions.

Each op is one registration (schema, kernel, gradient maker, doc); gradient ops that are not forward
ops of their own (`AddGradient`, `SumElementsGradient`, ...) follow their forward op and name it
(`ops.common.register_gradient`), so autodiff's copy of the forward args parses. Gradients use
explicit formulas. Kernels are functional: they may return an input (or a view of it) unchanged, never
modify one. Reshape and Split read their sizes input on the host (Trait.HOST_SYNC): their shape rules
leave what it decides unknown.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import DeviceOption, OperatorDef
from graphpar.core.naming import CROSS_REPLICA_SUM_NAME
from graphpar.core.schema import (
    GI,
    NO_GRADIENT,
    Arg,
    Effects,
    Elementwise,
    KernelContext,
    Precision,
    PrecisionRule,
    TensorSpec,
    Trait,
    gradient_op,
    register_op,
)
from graphpar.core.shapes import on_meta
from graphpar.errors import GradientError
from graphpar.ops.common import Maker, elementwise_grad, one_input_gradient, op_label, register_gradient
from graphpar.ops.fill import to_torch_dtype

_HOST = DeviceOption()


def _pack(outs: Sequence[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A kernel's result: the tensor itself for one output, else a tuple."""
    return outs[0] if len(outs) == 1 else tuple(outs)


def _pass_through(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    """Every input's gradient is the output's gradient, with no op (Caffe2's SetDense(i, GO(0)))."""
    return [], [g[0]] * len(op.inputs)


# ---------------------------------------------------------------------------------------------- copies


def _copy_kernel(_a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    device = ctx.device
    return lambda x: x.to(device, copy=True)


def _input_devices(op: OperatorDef, device: DeviceOption) -> list[DeviceOption]:
    """Input i lives on device `input_device_ids[i]` of the op's type (-1 or none given: the op's)."""
    ids = op.args.get("input_device_ids") or ()
    return [DeviceOption(device.device_type, ids[i]) if i < len(ids) and ids[i] >= 0 else device
            for i in range(len(op.inputs))]


_INPUT_DEVICES = {"input_device_ids": Arg("ints", ())}
_COPY = (Trait.CROSS_DEVICE,)


def _copy_gradient(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    """dX = CopyOnDeviceLike(dY, X): back onto X's device, which the forward op's args name."""
    ids = op.args.get("input_device_ids") or ()
    args = {"input_device_ids": [-1, ids[0]]} if ids else {}
    return [gradient_op("CopyOnDeviceLike", [g[0], op.inputs[0]], [GI(op, 0)], **args)], [GI(op, 0)]


register_op(
    "Copy", args=_INPUT_DEVICES, kernel=_copy_kernel, gradient=_copy_gradient, copy_args_to_gradient=False,
    device_inference=lambda op, d: (_input_devices(op, d), [d]), traits=_COPY, effects=Effects(same_value={(0, 0)}),
    precision=Precision.FOLLOW,
    doc="Y = a copy of X on the op's device (a new tensor, also when X is already there). X may live "
        "on another device of the op's type: `input_device_ids=[id]` says which (default: the op's).")
register_op(
    "CopyOnDeviceLike", inputs=2, args=_INPUT_DEVICES,
    kernel=lambda _a, _ctx: lambda x, like: x.to(like.device, copy=True), gradient=NO_GRADIENT,
    device_inference=lambda op, d: (_input_devices(op, d), _input_devices(op, d)[1:]), traits=_COPY,
    doc="Y = a copy of X on the device of the second input (the gradient of Copy); `input_device_ids` "
        "as for Copy.")
register_op(
    "CopyCPUToGPU", kernel=_copy_kernel, gradient=one_input_gradient("CopyGPUToCPU"),
    device_inference=lambda op, d: ([_HOST], [d]), traits=_COPY, precision=Precision.FOLLOW,
    doc="Y = a copy of X (a CPU blob) on the op's (CUDA) device.")
register_op(
    "CopyGPUToCPU", kernel=lambda _a, ctx: (lambda host: lambda x: x.to(host, copy=True))(ctx.device_of(_HOST)),
    gradient=one_input_gradient("CopyCPUToGPU"), device_inference=lambda op, d: ([d], [_HOST]), traits=_COPY,
    precision=Precision.FOLLOW, doc="Y = a copy of X (on the op's CUDA device) on the CPU.")
register_op("Alias", kernel=lambda _a, _ctx: lambda x: x, gradient=_pass_through, effects=Effects(aliases={(0, 0)}),
            precision=Precision.FOLLOW,
            doc="Y is X: the same tensor under another name, no copy (an in-place update of either is seen through both; Parallelize's cpu_update_once binds replicas to the first device's tensors with it). The gradient passes straight through.")
register_op("StopGradient", inplace={(0, 0)}, kernel=lambda _a, _ctx: lambda x: x, gradient=NO_GRADIENT,
            effects=Effects(same_value={(0, 0)}), precision=Precision.FOLLOW,
            doc="Y = X; no gradient flows to X through this op (in place blocks all of X's gradient).")


# -------------------------------------------------------------------------------------- element-wise


def _sum_kernel(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    device, where = ctx.device, op_label(ctx.op)

    def run(*xs: torch.Tensor) -> torch.Tensor:
        out = xs[0].to(device)
        for i, x in enumerate(xs[1:], 1):
            if x.shape != xs[0].shape:
                raise ValueError(f"{where}: input {i} has shape {tuple(x.shape)}, input 0 has "
                                 f"{tuple(xs[0].shape)}; Sum needs equal shapes")
            out = out + x.to(device) if i == 1 else out.add_(x.to(device))
        return out

    return run


def _sum_into_first(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    """Sum adding into X0's storage where X0 is on the op's device and every input has its shape and
    dtype (the same additions in the same order, so the same bits); otherwise Sum's kernel."""
    device, plain = ctx.device, _sum_kernel(a, ctx)

    def run(*xs: torch.Tensor) -> torch.Tensor:
        out = xs[0]
        if out.device != device or any(x.shape != out.shape or x.dtype != out.dtype for x in xs[1:]):
            return plain(*xs)
        for x in xs[1:]:
            out.add_(x.to(device))
        return out

    return run


register_op(
    "Sum", inputs=(1, None), inplace={(0, 0)}, args=_INPUT_DEVICES, kernel=_sum_kernel, gradient=_pass_through,
    reuse=(0, _sum_into_first),
    device_inference=lambda op, d: (_input_devices(op, d), [d]),
    effects=Effects(cross_device=lambda op: op.name == CROSS_REPLICA_SUM_NAME), precision=Precision.FOLLOW,
    doc="Y = X0 + X1 + ... (equal shapes), added in input order on the op's device; inputs may live on "
        "other devices of its type (`input_device_ids`, as for Copy). In place into X0 allowed. Gradient: "
        "each input gets dY, with no op.")

_BROADCAST_ARGS = {"broadcast": False, "axis": -1}


def _legacy_shape(b_shape: Sequence[int], ndim: int, axis: int, where: str) -> tuple[int, ...]:
    """Caffe2's `broadcast=1`: B's dims match A's starting at `axis` (-1: B is a suffix of A)."""
    start = ndim - len(b_shape) if axis == -1 else axis
    if start < 0 or start + len(b_shape) > ndim:
        raise ValueError(f"{where}: B of shape {tuple(b_shape)} cannot broadcast at axis {axis} "
                         f"into a {ndim}-d A")
    return (*b_shape, *[1] * (ndim - start - len(b_shape)))


def _binary_kernel(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    def factory(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
        if not a.broadcast:
            return fn
        where = op_label(ctx.op)
        return lambda x, y: fn(x, y.reshape(_legacy_shape(y.shape, x.ndim, a.axis, where)))

    return factory


def _reducer(a: SimpleNamespace, ctx: KernelContext) -> Callable:
    """`reduce(g, like, is_b)`: g summed over the dims along which `like` was broadcast."""
    where = op_label(ctx.op)

    def reduce(g: torch.Tensor, like: torch.Tensor, is_b: bool = False) -> torch.Tensor:
        if is_b and a.broadcast:
            return g.sum_to_size(_legacy_shape(like.shape, g.ndim, a.axis, where)).reshape(like.shape)
        return g if g.shape == like.shape else g.sum_to_size(like.shape)

    return reduce


def _aligned(a: SimpleNamespace, y: torch.Tensor, ndim: int, where: str) -> torch.Tensor:
    return y.reshape(_legacy_shape(y.shape, ndim, a.axis, where)) if a.broadcast else y


def _binary_grad_kernel(grads: Callable) -> Callable:
    """Factory for `<Op>Gradient`; `grads(dc, x, yb, *extra)` gives the unreduced (dA, dB)."""

    def factory(a: SimpleNamespace, ctx: KernelContext) -> Callable:
        reduce, where = _reducer(a, ctx), op_label(ctx.op)

        def run(dc: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *extra: torch.Tensor) -> tuple:
            da, db = grads(dc, x, _aligned(a, y, dc.ndim, where), *extra)
            return reduce(da, x), reduce(db, y, True)

        return run

    return factory


def _binary_maker(grad_type: str, with_output: bool = False) -> Maker:
    def maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
        inputs = [g[0], *op.inputs, *op.outputs[:with_output]]
        return [gradient_op(grad_type, inputs, [GI(op, 0), GI(op, 1)])], [GI(op, 0), GI(op, 1)]

    return maker


_BINARY = (
    # name, forward, in-place pairs, unreduced (dA, dB), formula and notes for the doc
    ("Add", torch.add, {(0, 0), (1, 0)}, lambda dc, x, y: (dc, dc), "A + B."),
    ("Sub", torch.sub, {(0, 0), (1, 0)}, lambda dc, x, y: (dc, -dc), "A - B."),
    ("Mul", torch.mul, {(0, 0), (1, 0)}, lambda dc, x, y: (dc * y, dc * x), "A * B."),
    ("Div", torch.div, {(0, 0)}, lambda dc, x, y, c: (dc / y, -dc * c / y), "A / B (true division)."),
)
for _name, _fn, _inplace, _grads, _formula in _BINARY:
    _div = _name == "Div"
    register_op(
        _name, inputs=2, inplace=_inplace, args=_BROADCAST_ARGS, kernel=_binary_kernel(_fn),
        gradient=_binary_maker(f"{_name}Gradient", with_output=_div), precision=Precision.FOLLOW,
        doc=f"C = {_formula} NumPy broadcasting; with Caffe2's `broadcast=1`, B's dims align with A's "
            f"from `axis` (-1: trailing). `{_name}Gradient(dC, A, B{', C' if _div else ''})` sums dA, dB "
            f"over the broadcast dims; as it reads A, autodiff refuses an in-place {_name} on the path of "
            f"a gradient (in place stays fine elsewhere, e.g. Caffe2's LR multipliers).")
    register_gradient(f"{_name}Gradient", _name, _binary_grad_kernel(_grads), inputs=4 if _div else 3, outputs=2,
                      doc=f"(dA, dB) of {_name}, each summed to its input's shape.")


def _max_maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    grads = [GI(op, i) for i in range(len(op.inputs))]
    return [gradient_op("MaxGradient", [op.outputs[0], g[0], *op.inputs], grads)], grads


def _max_grad(_a: SimpleNamespace, _ctx: KernelContext) -> Callable[..., tuple[torch.Tensor, ...]]:
    def run(y: torch.Tensor, dy: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.where(x == y, dy, 0).sum_to_size(x.shape).to(x.dtype) for x in xs)

    return run


register_op("Max", inputs=(1, None), inplace={(0, 0)}, kernel=lambda _a, _ctx: lambda *xs: _elementwise_max(xs),
            gradient=_max_maker, precision=Precision.FOLLOW,
            doc="Y = the element-wise maximum of X0, X1, ... (NumPy broadcasting). Gradient "
                "`MaxGradient(Y, dY, X0, ...)`: each Xi gets dY where it equals Y (ties: every maximal input, "
                "as Caffe2).")
register_gradient("MaxGradient", "Max", _max_grad, inputs=(3, None), outputs=(1, None),
                  doc="(dX0, dX1, ...) of Max: dY where Xi equals Y, summed to Xi's shape.")


def _elementwise_max(xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = torch.maximum(out, x)
    return out if len(xs) > 1 else out.clone()


_UNARY: tuple[tuple[str, Callable[..., torch.Tensor], bool, str, Callable[..., torch.Tensor], Precision], ...] = (
    # name, forward, in place ok, what the gradient reads, gradient formula (saved, dY) -> dX, precision
    ("Sqr", lambda x: x * x, False, "X", lambda x, dy: 2 * x * dy, Precision.FP32),
    ("Sqrt", torch.sqrt, True, "Y", lambda y, dy: 0.5 * dy / y, Precision.FP32),
    ("Exp", torch.exp, True, "Y", lambda y, dy: dy * y, Precision.FP32),
    ("Log", torch.log, False, "X", lambda x, dy: dy / x, Precision.FP32),
    ("Abs", torch.abs, False, "X", lambda x, dy: torch.sign(x) * dy, Precision.FOLLOW),
)
for _name, _fn, _in_place, _reads, _derivative, _precision in _UNARY:
    register_op(_name, inplace={(0, 0)} if _in_place else (), kernel=(lambda f: lambda _a, _ctx: f)(_fn),
                gradient=one_input_gradient(f"{_name}Gradient", _reads), precision=_precision,
                doc=f"Y = {_name}(X) element-wise; gradient `{_name}Gradient({_reads}, dY)`.")
    elementwise_grad(f"{_name}Gradient", _name, _derivative, doc=f"dX of {_name} from {_reads} and dY.")

register_op("Negative", inplace={(0, 0)}, kernel=lambda _a, _ctx: torch.neg,
            gradient=one_input_gradient("Negative"), precision=Precision.FOLLOW, doc="Y = -X; gradient Negative(dY).")
register_op("Scale", inplace={(0, 0)}, args={"scale": 1.0},
            kernel=lambda a, _ctx: lambda x: x * a.scale, gradient=one_input_gradient("Scale"),
            reuse=(0, lambda a, _ctx: lambda x: x.mul_(a.scale) if x.is_floating_point() else x * a.scale),
            effects=Effects(elementwise=Elementwise((0,))),
            precision=Precision.FOLLOW,
            doc="Y = scale * X; gradient Scale(dY) with the same scale.")
register_op("Clip", inplace={(0, 0)}, args={"min": -math.inf, "max": math.inf},
            kernel=lambda a, _ctx: lambda x: torch.clamp(x, a.min, a.max),
            gradient=one_input_gradient("ClipGradient", "Y"), precision=Precision.FOLLOW,
            doc="Y = X clamped to [min, max]; gradient ClipGradient(Y, dY) passes dY where min < Y < max.")
register_gradient("ClipGradient", "Clip", lambda a, _ctx: lambda y, dy: torch.where((y > a.min) & (y < a.max), dy, 0),
                  doc="dX of Clip: dY where min < Y < max, else 0 (Caffe2's rule).")


# ----------------------------------------------------------------------------------------------- shape


def _resize_like_maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    return [gradient_op("ResizeLike", [g[0], op.inputs[0]], [GI(op, 0)])], [GI(op, 0), None][: len(op.inputs)]


register_op("ResizeLike", inputs=2, kernel=lambda _a, _ctx: lambda x, like: x.reshape(like.shape),
            gradient=_resize_like_maker, precision=Precision.FOLLOW,
            doc="Y = X reshaped to the shape of the second input (same numel).")


def _flatten_kernel(a: SimpleNamespace, _ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x.reshape(math.prod(x.shape[: a.axis]), math.prod(x.shape[a.axis:]))


register_op("Flatten", args={"axis": 1}, kernel=_flatten_kernel, gradient=_resize_like_maker,
            copy_args_to_gradient=False, precision=Precision.FOLLOW,
            doc="Y = X as a 2-D [prod(dims[:axis]), prod(dims[axis:])]; gradient ResizeLike(dY, X).")
register_op("FlattenToVec", kernel=lambda _a, _ctx: lambda x: x.reshape(-1), gradient=_resize_like_maker,
            precision=Precision.FOLLOW,
            doc="Y = X as a 1-D vector; gradient ResizeLike(dY, X).")


def _reshape_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    has_input = len(ctx.op.inputs) == 2
    if (a.shape is not None) == has_input:
        raise ValueError(f"{op_label(ctx.op)}: give the new shape either as the `shape` argument or as a "
                         f"second input, exactly one of them")

    def run(x: torch.Tensor, *new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = new[0].tolist() if new else a.shape
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(spec)]
        return x.reshape(shape), torch.tensor(list(x.shape), dtype=torch.int64)

    return run


def _reshape_infer(a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> Sequence[TensorSpec | None]:
    """Y is unknown with a shape input (its values decide); the old shape is X's rank in int64."""
    run = _reshape_kernel(a, ctx)
    if len(inputs) == 1:
        return on_meta(run, inputs)
    return [None, TensorSpec((len(inputs[0].shape),), torch.int64)]


def _reshape_maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    dx = GI(op, 0)
    return ([gradient_op("Reshape", [g[0], op.outputs[1]], [dx, f"_{dx}_dims"])],
            [dx, None][: len(op.inputs)])


register_op(
    "Reshape", inputs=(1, 2), outputs=2, inplace={(0, 0)}, args={"shape": Arg("ints", None)},
    kernel=_reshape_kernel, gradient=_reshape_maker, copy_args_to_gradient=False, infer=_reshape_infer,
    precision=PrecisionRule(Precision.FOLLOW, inputs=(0,), outputs=(0,)),  # the shapes are CPU ints
    traits=(Trait.HOST_SYNC,), device_inference=lambda op, d: ([d, _HOST][: len(op.inputs)], [d, _HOST]),
    doc="Y = X reshaped to `shape` (or the CPU int64 second input); a 0 keeps X's dim at that index, "
        "one -1 is inferred. Output 1 is X's old shape (CPU int64). Gradient Reshape(dY, old_shape).")


def _axis(a: SimpleNamespace, ctx: KernelContext) -> int:
    """Caffe2's Concat/Split axis: `axis`, or the channel axis of `order` (not both)."""
    if not a.order:
        return a.axis
    if "axis" in ctx.op.args:
        raise ValueError(f"{op_label(ctx.op)}: pass `axis` or `order`, not both")
    if a.order not in ("NCHW", "NHWC"):
        raise ValueError(f"{op_label(ctx.op)}: order must be 'NCHW' or 'NHWC', got {a.order!r}")
    return 1 if a.order == "NCHW" else 3


_AXIS_ARGS = {"axis": 1, "add_axis": False, "order": ""}


def _concat_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    axis = _axis(a, ctx)

    def run(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.stack(xs, axis) if a.add_axis else torch.cat(xs, axis)
        sizes = [1] * len(xs) if a.add_axis else [x.shape[axis] for x in xs]
        return out, torch.tensor(sizes, dtype=torch.int32)

    return run


register_op(
    "Concat", inputs=(1, None), outputs=2, args=_AXIS_ARGS, kernel=_concat_kernel,
    precision=PrecisionRule(Precision.FOLLOW, outputs=(0,)),  # output 1: the input sizes (CPU ints)
    gradient=lambda op, g: ([gradient_op("Split", [g[0], op.outputs[1]], [GI(op, i) for i in
                                                                           range(len(op.inputs))])],
                            [GI(op, i) for i in range(len(op.inputs))]),
    device_inference=lambda op, d: ([d] * len(op.inputs), [d, _HOST]),
    doc="Y = the inputs concatenated along `axis` (stacked along a new one with add_axis); output 1 is "
        "split_info, the CPU int32 sizes along the axis. Gradient Split(dY, split_info).")


def _split_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., Any]:
    axis, n, where = _axis(a, ctx), len(ctx.op.outputs), op_label(ctx.op)
    if a.split and len(ctx.op.inputs) == 2:
        raise ValueError(f"{where}: give the split sizes as the `split` argument or as an input, not both")

    def sizes_of(x: torch.Tensor, given: Sequence[torch.Tensor]) -> list[int]:
        sizes = [int(s) for s in given[0].tolist()] if given else list(a.split)
        if not sizes:
            if x.shape[axis] % n:
                raise ValueError(f"{where}: dim {axis} of size {x.shape[axis]} does not split into {n}")
            sizes = [x.shape[axis] // n] * n
        if len(sizes) != n or sum(sizes) != x.shape[axis]:
            raise ValueError(f"{where}: split sizes {sizes} do not cut dim {axis} (size {x.shape[axis]}) "
                             f"into {n} outputs")
        return sizes

    def run(x: torch.Tensor, *given: torch.Tensor) -> Any:
        parts = torch.split(x, sizes_of(x, given), axis)
        return _pack([p.squeeze(axis) for p in parts] if a.add_axis else parts)

    return run


def _split_infer(a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> Sequence[TensorSpec | None]:
    """Unknown outputs with a sizes input (its values decide), else the kernel's on meta tensors."""
    run = _split_kernel(a, ctx)
    return on_meta(run, inputs) if len(inputs) == 1 else [None] * len(ctx.op.outputs)


def _split_maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    zeros = [gradient_op("ConstantFill", [out], [f"_{out}_grad_zeros"], value=0.0)
             for out, dy in zip(op.outputs, g) if dy is None]
    dys = [dy if dy is not None else f"_{out}_grad_zeros" for out, dy in zip(op.outputs, g)]
    dx = GI(op, 0)
    args = {k: op.args[k] for k in _AXIS_ARGS if k in op.args}
    concat = gradient_op("Concat", dys, [dx, f"_{dx}_dims"], **args)
    return [*zeros, concat], [dx, None][: len(op.inputs)]


register_op(
    "Split", inputs=(1, 2), outputs=(1, None), args={**_AXIS_ARGS, "split": Arg("ints", ())},
    kernel=_split_kernel, gradient=_split_maker, copy_args_to_gradient=False, infer=_split_infer,
    precision=Precision.FOLLOW,
    traits=(Trait.HOST_SYNC,), device_inference=lambda op, d: ([d, _HOST][: len(op.inputs)], [d] * len(op.outputs)),
    doc="Outputs = X cut along `axis` into the sizes of `split` (or the CPU second input; default equal "
        "parts); add_axis drops the axis (sizes 1). Gradient Concat(dY...), zeros for missing dY.")


def _slice_index(a: SimpleNamespace, shape: Sequence[int], where: str) -> tuple[slice, ...]:
    """The index of Caffe2's Slice: `[starts[i], ends[i])` along dim i, a negative bound counting from
    the end (dim + 1 + bound, so ends=-1 runs to the end); dims past `starts` whole."""
    if len(a.starts) != len(a.ends) or len(a.starts) > len(shape):
        raise ValueError(f"{where}: starts {list(a.starts)} and ends {list(a.ends)} need one bound per dim, "
                         f"at most {len(shape)} (X is {list(shape)})")
    index = []
    for dim, (start, end) in enumerate(zip(a.starts, a.ends)):
        size = shape[dim]
        lo, hi = (size + 1 + b if b < 0 else b for b in (start, end))
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"{where}: dim {dim} of size {size} has no slice [{start}, {end})")
        index.append(slice(lo, hi))
    return tuple(index)


def _slice_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    where = op_label(ctx.op)
    return lambda x: x[_slice_index(a, x.shape, where)]


def _slice_grad_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)

    def run(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        dx = torch.zeros_like(x, dtype=dy.dtype)
        dx[_slice_index(a, x.shape, where)] = dy
        return dx

    return run


_SLICE_ARGS = {"starts": Arg("ints", ()), "ends": Arg("ints", ())}
register_op(
    "Slice", args=_SLICE_ARGS, kernel=_slice_kernel, gradient=one_input_gradient("SliceGradient", "X"),
    doc="Y = X[starts[0]:ends[0], starts[1]:ends[1], ...] (Caffe2's Slice with its bounds as arguments): a "
        "negative bound counts from the end, dim + 1 + bound, so ends=[-1] runs to the end; dims past "
        "`starts` are kept whole. Gradient SliceGradient(X, dY).")
register_gradient("SliceGradient", "Slice", _slice_grad_kernel,
                  doc="dX = zeros shaped like X with dY at Slice's bounds.")


def _permutation(a: SimpleNamespace, ctx: KernelContext) -> tuple[int, ...]:
    axes = tuple(a.axes)
    if sorted(axes) != list(range(len(axes))):
        raise ValueError(f"{op_label(ctx.op)}: axes {axes} are not a permutation of 0..{len(axes) - 1}")
    return axes


def _transpose_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    axes = _permutation(a, ctx)
    if not axes:
        return lambda x: x.permute(*reversed(range(x.ndim))).contiguous()
    return lambda x: x.permute(axes).contiguous()


def _transpose_maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    axes = list(op.args.get("axes", ()))
    inverse = {"axes": [axes.index(i) for i in range(len(axes))]} if axes else {}
    return [gradient_op("Transpose", [g[0]], [GI(op, 0)], **inverse)], [GI(op, 0)]


register_op("Transpose", args={"axes": Arg("ints", ())}, kernel=_transpose_kernel, gradient=_transpose_maker,
            copy_args_to_gradient=False, precision=Precision.FOLLOW,
            doc="Y = X with dims permuted by `axes` (default: reversed), contiguous. Gradient: Transpose "
                "by the inverse permutation.")
register_op("NHWC2NCHW", kernel=lambda _a, _ctx: lambda x: x.movedim(-1, 1).contiguous(),
            gradient=one_input_gradient("NCHW2NHWC"), precision=Precision.FOLLOW,
            doc="Y = X[N, H, W, C] as [N, C, H, W] (any spatial rank).")
register_op("NCHW2NHWC", kernel=lambda _a, _ctx: lambda x: x.movedim(1, -1).contiguous(),
            gradient=one_input_gradient("NHWC2NCHW"), precision=Precision.FOLLOW,
            doc="Y = X[N, C, H, W] as [N, H, W, C] (any spatial rank).")


def _cast_kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    dtype = to_torch_dtype(a.to, op_label(ctx.op))
    return lambda x: x.to(dtype)


register_op("Cast", args={"to": Arg("any")}, kernel=_cast_kernel, gradient=one_input_gradient("CastGradient", "X"),
            precision=Precision.CONVERT,
            doc="Y = X converted to dtype `to` (a Caffe2 code, a name or a torch dtype, see ops.fill). "
                "Gradient CastGradient(X, dY) casts dY back to X's dtype.")
elementwise_grad("CastGradient", "Cast", lambda x, dy: dy.to(x.dtype), doc="dX of Cast: dY in X's dtype.")


# ------------------------------------------------------------------------------------------ reductions


def _expand_grad(average: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """dX = dY (divided by X's numel if `average`) broadcast to X's shape, as a fresh tensor."""
    if average:
        return lambda x, dy: (dy.reshape(()) / x.numel()).expand(x.shape).contiguous()
    return lambda x, dy: dy.reshape(()).expand(x.shape).contiguous()


def _mean_or_sum(a: SimpleNamespace, _ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.mean if a.average else torch.sum


register_op("SumElements", args={"average": False}, kernel=_mean_or_sum,
            gradient=one_input_gradient("SumElementsGradient", "X"),
            doc="Y (0-d) = sum of X's elements, or their mean with average=True.")
register_gradient("SumElementsGradient", "SumElements", lambda a, _ctx: _expand_grad(a.average),
                  doc="dX of SumElements: dY (divided by numel with average) everywhere.")
register_op("AveragedLoss", kernel=lambda _a, _ctx: torch.mean,
            gradient=one_input_gradient("AveragedLossGradient", "X"),
            doc="Y (0-d) = mean of X's elements.")
elementwise_grad("AveragedLossGradient", "AveragedLoss", _expand_grad(True),
                 doc="dX of AveragedLoss: dY / numel everywhere.")


def _reduce_front_sum(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        if not 0 < a.num_reduce_dim <= x.dim():
            raise ValueError(f"{op_label(ctx.op)}: num_reduce_dim={a.num_reduce_dim} needs 1..{x.dim()} for "
                             f"an input of shape {tuple(x.shape)}")
        return x.sum(dim=tuple(range(a.num_reduce_dim)))

    return run


register_op("ReduceFrontSum", args={"num_reduce_dim": 1}, kernel=_reduce_front_sum,
            gradient=one_input_gradient("ReduceFrontSumGradient", "X"),
            doc="Y = X summed over its first num_reduce_dim dimensions (Caffe2's op).")
register_gradient("ReduceFrontSumGradient", "ReduceFrontSum",
                  lambda a, _ctx: lambda x, dy: dy.expand(x.shape).contiguous(),
                  doc="dX of ReduceFrontSum: dY repeated over the reduced leading dimensions.")


def _sum_sqr(a: SimpleNamespace, _ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda x: torch.mean(x * x)) if a.average else (lambda x: torch.sum(x * x))


register_op("SumSqrElements", args={"average": False}, kernel=_sum_sqr,
            gradient=one_input_gradient("SumSqrElementsGradient", "X"),
            doc="Y (0-d) = sum of X's squared elements, or their mean with average=True.")
register_gradient("SumSqrElementsGradient", "SumSqrElements",
                  lambda a, _ctx: lambda x, dy: x * (dy.reshape(()) * (2.0 / x.numel() if a.average else 2)),
                  doc="dX of SumSqrElements: 2 X dY (divided by numel with average).")


def _weighted_sum_kernel(_a: SimpleNamespace, ctx: KernelContext, into_x0: bool = False) -> Callable[..., torch.Tensor]:
    """WeightedSum; with `into_x0`, computed in X0's storage (the same operations, so the same bits)."""
    where = op_label(ctx.op)
    if len(ctx.op.inputs) % 2:
        raise ValueError(f"{where}: WeightedSum takes pairs X0, w0, X1, w1, ...; got "
                         f"{len(ctx.op.inputs)} inputs")

    def run(*xw: torch.Tensor) -> torch.Tensor:
        dtype, shape = xw[0].dtype, xw[0].shape
        out = xw[0].mul_(xw[1].reshape(()).to(dtype)) if into_x0 else xw[0] * xw[1].reshape(()).to(dtype)
        for i in range(2, len(xw), 2):
            if xw[i].shape != shape:  # addcmul_ would broadcast a smaller X silently
                raise ValueError(f"{where}: X{i // 2} has shape {tuple(xw[i].shape)}, X0 has "
                                 f"{tuple(shape)}; WeightedSum needs equal shapes")
            out.addcmul_(xw[i], xw[i + 1].reshape(()).to(dtype))
        return out

    return run


def _weighted_sum_maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    on_w = bool(op.args.get("grad_on_w", False))
    if on_w and op.inputs[0] == op.outputs[0]:
        raise GradientError(f"WeightedSum {op.inputs} -> {op.outputs} runs in place on X0, so the "
                            f"gradient of w0 (grad_on_w) cannot read X0; write the output elsewhere")
    xs = [GI(op, i) for i in range(0, len(op.inputs), 2)]
    ws = [GI(op, i) for i in range(1, len(op.inputs), 2)] if on_w else []
    inputs = op.inputs if on_w else op.inputs[1::2]
    weights: list[str | None] = list(ws) if ws else [None] * len(xs)
    grads = [gi for pair in zip(xs, weights) for gi in pair]
    return [gradient_op("WeightedSumGradient", [g[0], *inputs], xs + ws)], grads


def _weighted_sum_grad_kernel(a: SimpleNamespace, _ctx: KernelContext) -> Callable[..., Any]:
    if not a.grad_on_w:
        return lambda dy, *ws: _pack([dy * w.reshape(()).to(dy.dtype) for w in ws])

    def run(dy: torch.Tensor, *xw: torch.Tensor) -> Any:
        dxs = [dy * w.reshape(()).to(dy.dtype) for w in xw[1::2]]
        dws = [(dy * x).sum().reshape(w.shape).to(w.dtype) for x, w in zip(xw[0::2], xw[1::2])]
        return _pack(dxs + dws)

    return run


register_op(
    "WeightedSum", inputs=(2, None), inplace={(0, 0)}, args={"grad_on_w": False},
    kernel=_weighted_sum_kernel, gradient=_weighted_sum_maker,
    reuse=(0, functools.partial(_weighted_sum_kernel, into_x0=True)),
    effects=Effects(elementwise=Elementwise(lambda n: tuple(range(0, n, 2)))),
    doc="Y = w0 X0 + w1 X1 + ... (equal shapes; X0's dtype) with 1-element weights; in place into X0 allowed. "
        "Gradient WeightedSumGradient: dXi = wi dY, and dwi = sum(dY Xi) with grad_on_w.")
register_gradient(
    "WeightedSumGradient", "WeightedSum", _weighted_sum_grad_kernel, inputs=(2, None), outputs=(1, None),
    doc="Inputs dY, w0, w1, ... (or dY, X0, w0, ... with grad_on_w) -> dX0, dX1, ... [, dw0, dw1, ...].")
