"""Fill operators: constant, random and given-value tensors (all NO_GRADIENT).

Shapes come from the `shape` argument, or from an optional input: its shape, or with
`input_as_shape=True` its values (a 1-D integer tensor); `extra_shape` is appended in both cases.
Random fills draw from the op's own random stream on the CPU (`ctx.random_stream()`, keyed by the
workspace seed, the net, the op's index and the run) and then move the result to the op's device, so
CPU and CUDA runs give identical values for one workspace seed, whatever order ops run in.

Every fill declares its shape rule (shape and dtype from its args, or its input's shape), so shape
inference never allocates; with `input_as_shape` the shape depends on values (Trait.HOST_SYNC) and is
unknown until the op runs.

`dtype` arguments accept Caffe2's TensorProto codes (`DataType.FLOAT` = 1, `INT32` = 2, `BOOL` = 5,
`INT64` = 10, `FLOAT16` = 12, `DOUBLE` = 13, ...), their names in any case ("float", "float32",
"double", "float64", "int32", "int64", "bool", ...), or a `torch.dtype`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import DataType, OperatorDef
from graphpar.core.schema import NO_GRADIENT, Arg, KernelContext, TensorSpec, Trait, register_op
from graphpar.ops.common import op_label

_CODES = {
    DataType.FLOAT: torch.float32, DataType.INT32: torch.int32, DataType.BYTE: torch.uint8,
    DataType.BOOL: torch.bool, DataType.UINT8: torch.uint8, DataType.INT8: torch.int8,
    DataType.INT16: torch.int16, DataType.INT64: torch.int64, DataType.FLOAT16: torch.float16,
    DataType.DOUBLE: torch.float64,
}
_NAMES = {
    **{code.name.lower(): dtype for code, dtype in _CODES.items()},
    "float32": torch.float32, "float64": torch.float64, "half": torch.float16, "int": torch.int32,
    "long": torch.int64, "bfloat16": torch.bfloat16,
}


def to_torch_dtype(value: Any, where: str = "dtype") -> torch.dtype:
    """The torch dtype for a Caffe2 code, a name (any case) or a torch.dtype; ValueError otherwise."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in _CODES:
        return _CODES[DataType(value)]
    raise ValueError(f"{where}: unsupported dtype {value!r}; use a Caffe2 code "
                     f"({', '.join(f'{c.name}={int(c)}' for c in DataType)}), one of "
                     f"{sorted(_NAMES)}, or a torch.dtype")


_SHAPE_ARGS = {"shape": Arg("ints", ()), "extra_shape": Arg("ints", ()), "input_as_shape": False,
               "dtype": Arg("any", None)}

# plan(args, ctx) -> (shape_of, dtype_of): a fill's output shape and dtype from its (0 or 1) input,
# a tensor when the kernel runs or a TensorSpec when its shape rule does, so both follow one rule.
Plan = Callable[[SimpleNamespace, KernelContext], tuple[Callable[..., tuple[int, ...]], Callable[..., torch.dtype]]]


def _shape_fn(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple[int, ...]]:
    """How the output shape is found from the (0 or 1) inputs."""
    extra = tuple(a.extra_shape)
    if not ctx.op.inputs:
        if a.input_as_shape:
            raise ValueError(f"{op_label(ctx.op)}: input_as_shape=True needs a shape input")
        shape = tuple(a.shape) + extra
        return lambda: shape
    if a.shape:
        raise ValueError(f"{op_label(ctx.op)}: pass either the `shape` argument or an input, not both")
    if a.input_as_shape:
        return lambda x: tuple(int(v) for v in x.reshape(-1).tolist()) + extra
    return lambda x: tuple(x.shape) + extra


def _fill_rule(plan: Plan, fan_dim: int | None) -> Callable[..., list[TensorSpec | None]]:
    """The shape rule of a fill: its kernel's shape and dtype, unknown with input_as_shape; a fill that
    computes a fan along `fan_dim` checks it as its kernel would."""

    def infer(a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec | None]:
        shape_of, dtype_of = plan(a, ctx)
        if a.input_as_shape:
            return [None]
        shape = shape_of(*inputs)
        if fan_dim is not None and all(shape):  # no empty dim
            _fan(shape, fan_dim, op_label(ctx.op))
        return [TensorSpec(shape, dtype_of(*inputs))]

    return infer


def _register_fill(type_: str, doc: str, kernel: Callable[..., Any], plan: Plan, fan_dim: int | None = None,
                   random: bool = True, **args: Any) -> None:
    traits = (Trait.FILL, Trait.HOST_SYNC, *((Trait.RANDOM,) if random else ()))
    register_op(type_, inputs=(0, 1), outputs=1, args={**_SHAPE_ARGS, **args}, kernel=kernel,
                gradient=NO_GRADIENT, doc=doc, traits=traits, infer=_fill_rule(plan, fan_dim),
                traceable=False if random else _reads_only_a_shape)


def _reads_only_a_shape(op: OperatorDef) -> bool:
    """Whether a fill reads no tensor value (only its input's shape), so it can be compiled."""
    return not op.args.get("input_as_shape")


def _constant_dtype(a: SimpleNamespace, ctx: KernelContext) -> torch.dtype | None:
    """The declared dtype; else Caffe2's rule (an int `value` gives int64, a bool bool); else None."""
    if a.dtype is not None:
        return to_torch_dtype(a.dtype, op_label(ctx.op))
    if isinstance(a.value, bool):
        return torch.bool
    if isinstance(a.value, numbers.Integral):
        return torch.int64
    return None


def _constant_plan(a: SimpleNamespace, ctx: KernelContext) -> tuple[Callable, Callable]:
    if not isinstance(a.value, numbers.Real):
        raise TypeError(f"{op_label(ctx.op)}: `value` must be a number, got {a.value!r}")
    declared = _constant_dtype(a, ctx)

    def dtype_of(*x: Any) -> torch.dtype:
        return declared or (x[0].dtype if x and x[0].dtype.is_floating_point else torch.float32)

    return _shape_fn(a, ctx), dtype_of


def _constant_fill(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    """A fill shaped like its input on the input's device takes the input's layout (a channels-last
    param's momentum is channels-last, as eager optimizers' `zeros_like`)."""
    (shape_of, dtype_of), device = _constant_plan(a, ctx), ctx.device

    def fill(*x: Any) -> torch.Tensor:
        shape = shape_of(*x)
        if x and x[0].shape == shape and x[0].device == device:
            return torch.full_like(x[0], a.value, dtype=dtype_of(*x))
        return torch.full(shape, a.value, dtype=dtype_of(*x), device=device)

    return fill


_register_fill(
    "ConstantFill", kernel=_constant_fill, plan=_constant_plan, random=False, value=Arg("any", 0.0),
    doc="Y filled with `value`. Shape from `shape`, or from the optional input (its shape, or its values "
        "with input_as_shape), plus `extra_shape`; shaped like its input, it takes the input's memory format "
        "(channels-last stays channels-last). Without `dtype`, an int `value` gives int64 and a bool "
        "`value` bool (Caffe2's rule); a float `value` gives the input's dtype when the input is "
        "floating point (so autodiff seeds match the loss), else float32.")


def _random_plan(a: SimpleNamespace, ctx: KernelContext) -> tuple[Callable, Callable]:
    dtype = torch.float32 if a.dtype is None else to_torch_dtype(a.dtype, op_label(ctx.op))
    if not dtype.is_floating_point:
        raise ValueError(f"{op_label(ctx.op)}: random fills produce floating-point tensors, got dtype {dtype}")
    return _shape_fn(a, ctx), lambda *_x: dtype


def _fan(shape: Sequence[int], dim: int, where: str) -> int:
    if len(shape) <= dim:
        raise ValueError(f"{where}: needs a shape with at least {dim + 1} dims to compute its fan, "
                         f"got {tuple(shape)}")
    return math.prod(shape) // shape[dim]


def _register_random(type_: str, draw: Callable[..., Any], doc: str, fan_dim: int | None = None,
                     **args: Any) -> None:
    """A random fill: allocate on the CPU, `draw(tensor, args, gen, fan)` in place, then move it to the
    op's device; `fan` is numel / shape[fan_dim] (None without a `fan_dim`)."""

    def factory(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
        (shape_of, dtype_of), device = _random_plan(a, ctx), ctx.device
        next_generator, where, host = ctx.random_stream(), op_label(ctx.op), torch.device("cpu")

        def fill(*x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(shape_of(*x), dtype=dtype_of())
            gen = next_generator(host)  # one draw of the stream per run, even for an empty tensor
            if out.numel():
                draw(out, a, gen, None if fan_dim is None else _fan(out.shape, fan_dim, where))
            return out.to(device)

        return fill

    _register_fill(type_, doc, factory, _random_plan, fan_dim, **args)


_register_random("UniformFill", lambda t, a, g, _fan: t.uniform_(a.min, a.max, generator=g), min=0.0, max=1.0,
                 doc="Y ~ U[min, max), drawn on the CPU from the workspace generator.")
_register_random("GaussianFill", lambda t, a, g, _fan: t.normal_(a.mean, a.std, generator=g), mean=0.0, std=1.0,
                 doc="Y ~ N(mean, std^2), drawn on the CPU from the workspace generator.")


def _xavier(t: torch.Tensor, _a: SimpleNamespace, gen: torch.Generator, fan: int) -> None:
    scale = math.sqrt(3.0 / fan)
    t.uniform_(-scale, scale, generator=gen)


def _msra(t: torch.Tensor, _a: SimpleNamespace, gen: torch.Generator, fan: int) -> None:
    t.normal_(0.0, math.sqrt(2.0 / fan), generator=gen)


_register_random("XavierFill", _xavier, fan_dim=0,
                 doc="Y ~ U(-sqrt(3/fan_in), sqrt(3/fan_in)) with fan_in = numel / shape[0] (Caffe2's rule).")
_register_random("MSRAFill", _msra, fan_dim=1,
                 doc="Y ~ N(0, std=sqrt(2/fan_out)) with fan_out = numel / shape[1] (Caffe2's rule; needs at "
                     "least 2 dims).")


def _given_shape(a: SimpleNamespace, ctx: KernelContext) -> tuple[int, ...]:
    shape = tuple(a.shape)
    if len(a.values) != math.prod(shape):
        raise ValueError(f"{op_label(ctx.op)}: {len(a.values)} values do not fill shape {shape} "
                         f"({math.prod(shape)} elements)")
    return shape


def _given_fill(dtype: torch.dtype) -> Callable:
    def factory(a: SimpleNamespace, ctx: KernelContext) -> Callable[[], torch.Tensor]:
        shape = _given_shape(a, ctx)
        return torch.tensor(a.values, dtype=dtype).reshape(shape).to(ctx.device).clone

    return factory


for _type, _dtype, _kind in (("GivenTensorFill", torch.float32, "floats"),
                             ("GivenTensorDoubleFill", torch.float64, "floats"),
                             ("GivenTensorIntFill", torch.int32, "ints"),
                             ("GivenTensorInt64Fill", torch.int64, "ints"),
                             ("GivenTensorBoolFill", torch.bool, "ints")):
    register_op(_type, inputs=0, outputs=1, args={"values": Arg(_kind), "shape": Arg("ints")},
                kernel=_given_fill(_dtype), gradient=NO_GRADIENT, traits=(Trait.FILL,),
                infer=(lambda dtype: lambda a, ctx, _inputs: [TensorSpec(_given_shape(a, ctx), dtype)])(_dtype),
                doc=f"Y of `shape` ({_dtype}) holding `values` in row-major order; a fresh copy per run.")
