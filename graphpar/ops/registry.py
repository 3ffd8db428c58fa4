"""The operator registry: one registration per op type holds its schema, kernel, gradient maker and doc.

A registration reads top to bottom in one screen (see `graphpar/ops/tensor.py`):

    register_op(
        "Scale", inputs=1, outputs=1, inplace={(0, 0)}, args={"scale": 1.0},
        kernel=lambda a, ctx: lambda x: x * a.scale,
        gradient=lambda op, g: ([gradient_op("Scale", [g[0]], [GI(op, 0)])], [GI(op, 0)]),
        doc="Y = scale * X.")

Kernels are *factories*: `kernel(args, ctx)` runs once, at CreateNet, with the op's parsed arguments
(a namespace with defaults filled in) and a `KernelContext`; it returns the function that runs on every
RunNet, `fn(*input_tensors) -> Tensor` for one output or a tuple of tensors for several. Kernels are
device-agnostic PyTorch, keep the input dtype, and never modify their inputs in place: the workspace
rebinds output names, so blobs may share tensors safely.

Gradient makers follow Caffe2: `maker(op, grad_outputs) -> (grad_ops, grad_inputs)`, where
`grad_outputs[i]` is the gradient blob of `op.outputs[i]` (or None) and `grad_inputs[i]` is the
gradient blob of `op.inputs[i]` (a name, a `GradientSlice`, or None). Autodiff stamps each gradient op
with the forward op's device option and engine and, unless `copy_args_to_gradient=False`, its args.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.errors import UnknownOperatorError
from graphpar.naming import grad_name

if TYPE_CHECKING:
    import torch


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Marker("REQUIRED")
NO_GRADIENT = _Marker("NO_GRADIENT")  # gradients stop here: the op's inputs get none (fills, StopGradient)
NOT_DIFFERENTIABLE = _Marker("NOT_DIFFERENTIABLE")  # raise if a gradient reaches the op (Caffe2 SHOULD_NOT_DO)

# Arguments Caffe2 code passes freely that graphpar accepts and ignores on ops that do not declare them.
IGNORED_ARGS = frozenset({"order", "use_cudnn", "cudnn_exhaustive_search", "exhaustive_search",
                          "ws_nbytes_limit", "float16_compute", "random_seed"})

ARG_KINDS = ("int", "float", "bool", "str", "ints", "floats", "strs", "net", "any")


@dataclass(frozen=True)
class Arg:
    """An argument's kind (one of ARG_KINDS) and default (REQUIRED if it has none)."""

    kind: str
    default: Any = REQUIRED


def _arg_from_default(default: Any) -> Arg:
    if isinstance(default, Arg):
        return default
    if isinstance(default, bool):
        return Arg("bool", default)
    if isinstance(default, int):
        return Arg("int", default)
    if isinstance(default, float):
        return Arg("float", default)
    if isinstance(default, str):
        return Arg("str", default)
    if isinstance(default, (list, tuple)) and all(isinstance(v, int) for v in default):
        return Arg("ints", tuple(default))
    if isinstance(default, (list, tuple)) and all(isinstance(v, (int, float)) for v in default):
        return Arg("floats", tuple(float(v) for v in default))
    return Arg("any", default)


@dataclass
class KernelContext:
    """What a kernel factory may know at CreateNet: the op, its device, and the workspace's RNGs."""

    op: OperatorDef
    device: torch.device
    device_of: Callable[[DeviceOption], torch.device]
    generator: Callable[[torch.device], torch.Generator]


@dataclass
class OpSchema:
    """Everything graphpar knows about one operator type."""

    type: str
    num_inputs: tuple[int, float]
    num_outputs: tuple[int, float]
    args: dict[str, Arg]
    kernel: Callable[[SimpleNamespace, KernelContext], Callable[..., Any]]
    gradient: Any = None
    doc: str = ""
    inplace: Callable[[int, int], bool] = field(default=lambda i, o: False)
    enforce_inplace: Callable[[int, int], bool] = field(default=lambda i, o: False)
    gradient_of: str | None = None
    copy_args_to_gradient: bool = True
    device_inference: Callable[[OperatorDef, DeviceOption], tuple[list, list]] | None = None

    def enforced_pairs(self, num_inputs: int, num_outputs: int) -> list[tuple[int, int]]:
        """The (input, output) pairs that must name the same blob, for an op with these counts."""
        return [(i, o) for i in range(num_inputs) for o in range(num_outputs) if self.enforce_inplace(i, o)]

    def all_args(self) -> dict[str, Arg]:
        """Own args plus, for a gradient op, those of its forward op (autodiff copies them over)."""
        if self.gradient_of is None:
            return self.args
        return {**get_schema(self.gradient_of).args, **self.args}


_REGISTRY: dict[str, OpSchema] = {}


def _count_range(spec: int | tuple[int, int | None]) -> tuple[int, float]:
    if isinstance(spec, int):
        return spec, spec
    low, high = spec
    return low, math.inf if high is None else high


def _inplace_rule(spec: Any) -> Callable[[int, int], bool]:
    if callable(spec):
        return spec
    pairs = frozenset(spec)
    return lambda i, o: (i, o) in pairs


def same_index(i: int, o: int) -> bool:
    """In-place rule: input i may be written by output i (e.g. NCCLAllreduce)."""
    return i == o


def register_op(
    type_: str,
    *,
    kernel: Callable[[SimpleNamespace, KernelContext], Callable[..., Any]],
    doc: str,
    inputs: int | tuple[int, int | None] = 1,
    outputs: int | tuple[int, int | None] = 1,
    args: dict[str, Any] | None = None,
    inplace: Iterable[tuple[int, int]] | Callable[[int, int], bool] = (),
    enforce_inplace: Iterable[tuple[int, int]] | Callable[[int, int], bool] = (),
    gradient: Any = None,
    gradient_of: str | None = None,
    copy_args_to_gradient: bool = True,
    device_inference: Callable[[OperatorDef, DeviceOption], tuple[list, list]] | None = None,
) -> OpSchema:
    """Register an operator type once; re-registering a type is an error.

    `args` maps each argument to its default (its kind is inferred) or to an `Arg`.
    `gradient` is a maker, NO_GRADIENT, NOT_DIFFERENTIABLE, or None (no maker: an error if reached).
    `gradient_of` names the forward op whose arguments this gradient op accepts.
    `device_inference(op, device) -> (input_devices, output_devices)` overrides "everything on the
    op's device" for ops that read or write CPU blobs from a CUDA op (Iter, LearningRate, copies).
    """
    if type_ in _REGISTRY:
        raise ValueError(f"operator {type_!r} is already registered")
    enforce = _inplace_rule(enforce_inplace)
    allowed = _inplace_rule(inplace)
    schema = OpSchema(
        type=type_, num_inputs=_count_range(inputs), num_outputs=_count_range(outputs),
        args={name: _arg_from_default(d) for name, d in (args or {}).items()}, kernel=kernel,
        gradient=gradient, doc=doc, inplace=lambda i, o: enforce(i, o) or allowed(i, o),
        enforce_inplace=enforce, gradient_of=gradient_of, copy_args_to_gradient=copy_args_to_gradient,
        device_inference=device_inference)
    _REGISTRY[type_] = schema
    return schema


def _ensure_loaded() -> None:
    import graphpar.ops  # noqa: F401 - importing the package registers every op module


def is_registered(type_: str) -> bool:
    _ensure_loaded()
    return type_ in _REGISTRY


def registered_types() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def get_schema(type_: str) -> OpSchema:
    """The schema of `type_`; an unknown type raises UnknownOperatorError naming close matches."""
    schema = _REGISTRY.get(type_)
    if schema is None:
        _ensure_loaded()
        schema = _REGISTRY.get(type_)
    if schema is None:
        close = difflib.get_close_matches(type_, _REGISTRY, n=5, cutoff=0.6)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownOperatorError(f"unknown operator type {type_!r}.{hint}")
    return schema


def _coerce(kind: str, value: Any) -> Any:
    """Convert `value` to `kind` or raise TypeError (numpy scalars are accepted)."""
    import numbers

    def number(v: Any, integral: bool) -> Any:
        if integral and isinstance(v, numbers.Integral):
            return int(v)
        if not integral and isinstance(v, numbers.Real):
            return float(v)
        raise TypeError

    if kind == "any":
        return value
    if kind == "int":
        return number(value, True)
    if kind == "float":
        return number(value, False)
    if kind == "bool":
        if isinstance(value, numbers.Integral) and int(value) in (0, 1):
            return bool(value)
        raise TypeError
    if kind == "str":
        if isinstance(value, str):
            return str(value)
        raise TypeError
    if kind == "net":
        if isinstance(value, NetDef) or hasattr(value, "Proto"):
            return value
        raise TypeError
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError
    items = list(value)
    if kind == "ints":
        return tuple(number(v, True) for v in items)
    if kind == "floats":
        return tuple(number(v, False) for v in items)
    if kind == "strs" and all(isinstance(v, str) for v in items):
        return tuple(str(v) for v in items)
    raise TypeError


def parse_args(schema: OpSchema, raw: dict[str, Any], where: str = "") -> SimpleNamespace:
    """Type-check `raw` against the schema and fill in defaults; raise TypeError on a bad argument."""
    where = where or f"operator {schema.type}"
    specs = schema.all_args()
    parsed: dict[str, Any] = {}
    for name, value in raw.items():
        spec = specs.get(name)
        if spec is None:
            if name in IGNORED_ARGS:
                continue
            close = difflib.get_close_matches(name, specs, n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            known = ", ".join(sorted(specs)) or "none"
            raise TypeError(f"{where}: unknown argument {name!r}.{hint} (arguments: {known})")
        try:
            parsed[name] = _coerce(spec.kind, value)
        except TypeError:
            raise TypeError(f"{where}: argument {name!r} must be {spec.kind}, got "
                            f"{type(value).__name__} {value!r}") from None
    for name, spec in specs.items():
        if name not in parsed:
            if spec.default is REQUIRED:
                raise TypeError(f"{where}: missing required argument {name!r}")
            parsed[name] = spec.default
    return SimpleNamespace(**parsed)


def check_operator(op: OperatorDef, where: str = "") -> OpSchema:
    """Check an op against its schema (type, counts, in-place pairs, args); return the schema."""
    schema = get_schema(op.type)
    where = where or f"operator {op.type}"
    for what, count, (low, high) in (("inputs", len(op.inputs), schema.num_inputs),
                                     ("outputs", len(op.outputs), schema.num_outputs)):
        if not low <= count <= high:
            bound = f"{low}" if low == high else f"{low}..{'any' if high == math.inf else int(high)}"
            raise ValueError(f"{where}: takes {bound} {what}, got {count}: {getattr(op, what)}")
    for i, blob in enumerate(op.inputs):
        for o, out in enumerate(op.outputs):
            if blob == out and not schema.inplace(i, o):
                raise ValueError(f"{where}: input {i} and output {o} are both {blob!r}, but {op.type} "
                                 f"may not run in place on that pair; give the output another name")
    for i, o in schema.enforced_pairs(len(op.inputs), len(op.outputs)):
        if op.inputs[i] != op.outputs[o]:
            raise ValueError(f"{where}: output {o} must be input {i} ({op.inputs[i]!r}) in place, "
                             f"got {op.outputs[o]!r}")
    parse_args(schema, op.args, where)
    return schema


def gradient_op(type_: str, inputs: list[str], outputs: list[str], **args: Any) -> OperatorDef:
    """A gradient operator for a maker to return (autodiff stamps device, engine and args)."""
    return OperatorDef(type_, [str(b) for b in inputs], [str(b) for b in outputs], dict(args),
                       is_gradient_op=True)


def GI(op: OperatorDef, i: int) -> str:  # noqa: N802 - Caffe2's name in gradient makers
    """The dense gradient blob of the op's i-th input."""
    return grad_name(op.inputs[i])
