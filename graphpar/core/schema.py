"""The operator registry: one registration per op type holds its schema, traits, kernel, gradient and doc.

This module is torch-free: `core` knows schemas, never kernels. The op library (`graphpar/ops/`)
registers into it on first use: the package root provides it (`graphpar._providers`), and its modules
are discovered (see `graphpar.ops`). A registration reads
top to bottom in one screen (see `graphpar/ops/tensor.py`):

    register_op(
        "Scale", inputs=1, outputs=1, inplace={(0, 0)}, args={"scale": 1.0},
        kernel=lambda a, ctx: lambda x: x * a.scale,
        gradient=lambda op, g: ([gradient_op("Scale", [g[0]], [GI(op, 0)])], [GI(op, 0)]),
        doc="Y = scale * X.")

Kernels are *factories*: `kernel(args, ctx)` runs once, at CreateNet, with the op's parsed arguments
(a namespace with defaults filled in) and a `KernelContext`; it returns the function that runs on every
RunNet, `fn(*input_tensors) -> Tensor` for one output or a tuple of tensors for several. Kernels are
device-agnostic PyTorch, keep the input dtype, and never modify their inputs in place: the executor
rebinds output names, so blobs may share tensors safely. An output may share storage with an input
only where the schema says so (in-place pairs, `Effects.aliases`): in-place updates rely on that contract.

Effects (`Effects`, `effects=` at registration) say what an op does to its inputs' tensors and values
that passes must know without naming its type: which outputs are an input's tensor (`aliases`) or equal
its value (`same_value`), which in-place inputs the kernel rebinds instead of writing (`rebinds`), its
momentum buffer, how a group of it fuses into one multi-tensor op, when one op of the type crosses
replicas, and which inputs it works on element by element (`Elementwise`: sharded updates run it on
parts). Adding an op with a new aliasing or in-place effect is one registration (docs/extending.md).

Gradient makers follow Caffe2: `maker(op, grad_outputs) -> (grad_ops, grad_inputs)`, where
`grad_outputs[i]` is the gradient blob of `op.outputs[i]` (or None) and `grad_inputs[i]` is the
gradient blob of `op.inputs[i]` (a name, a `GradientSlice`, or None). Autodiff stamps each gradient op
with the forward op's device option and engine and, unless `copy_args_to_gradient=False`, its args.

Traits (`Trait`) say what passes and executors need to know about an op type without naming it:
whether it is a collective (kept in one fixed order), moves data between devices, counts iterations,
fills, draws random numbers, updates state in place, and so on.

Shape rules (`infer`, used by `core.shapes.infer_specs`) say what an op's outputs will be, from its
arguments and the `TensorSpec`s (shape, dtype) of its inputs, before anything runs. Most ops need
none: by default the kernel itself runs on "meta" tensors (shapes and dtypes, no data). An op
declares `infer(args, ctx, inputs) -> [TensorSpec or None per output]` when that cannot work or would
allocate memory: kernels that read tensor values on the host (Trait.HOST_SYNC), and fills. None means
unknown until the op runs (e.g. a shape read from a tensor's values).

Input checks (`check`) state what an op promises of its inputs beyond their count: equal shapes
(`same_shape`: an update's param, gradient and moments), one length per channel, an integer
counter. PyTorch broadcasts silently where such a promise is broken (a [1] param updated by a [3]
gradient becomes [3]), so `register_op` runs the check before the kernel on every run and before the
shape rule at CreateNet, where shapes are known, so a mismatch is reported there, naming the op.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

from graphpar import _providers
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.naming import grad_name
from graphpar.errors import UnknownOperatorError

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

# The arguments Caffe2 accepted on any op and ignored (its ops read only the arguments they knew), which
# Caffe2 code and tutorials pass freely: graphpar accepts and ignores them on ops that do not declare them
# (an op that declares one reads it). Each changes no result: it picks a kernel or a buffer, or its
# behaviour is Caffe2's default here. docs/caffe2_migration.md lists them; any other unknown argument is
# an error.
IGNORED_ARGS = frozenset({
    "order",  # on ops without a layout (Caffe2's brew passes the model's arg_scope everywhere)
    "use_cudnn", "cudnn_exhaustive_search", "exhaustive_search", "ws_nbytes_limit", "enable_tensor_core",
    "deterministic", "cudnn_state", "shared_buffer",  # cuDNN algorithm search and workspace, shared buffers
    "float16_compute",  # fp16 math in Caffe2's FP16 FC; graphpar's precision is Parallelize(compute_dtype=...)
    "random_seed",  # an op-level seed; graphpar's seeds are the workspace's (SetSeed)
    "run_once",  # fills: "fill only on the first run", dropped by Caffe2 long ago; tutorials pass run_once=0
})

ARG_KINDS = ("int", "float", "bool", "str", "ints", "floats", "strs", "net", "any")


class Trait(str, Enum):
    """What an op type is, for the passes and executors that must treat it specially."""

    COLLECTIVE = "collective"  # one op over every device's copy; all of a net's collectives keep one order
    CROSS_DEVICE = "cross_device"  # reads or writes blobs of several devices (copies, collectives)
    # talks to other processes through the communicator (or store) handle of input 0; the
    # collectives of one communicator keep one order, those of different ones may overlap
    DISTRIBUTED = "distributed"
    COUNTER = "counter"  # advances an iteration counter (checkpointed, never replicated)
    FILL = "fill"  # creates a tensor from its arguments (and at most an input's shape)
    RANDOM = "random"  # draws random numbers (from `KernelContext.random_stream`)
    INPLACE_UPDATE = "inplace_update"  # updates state blobs that are both inputs and outputs
    # The kernel writes each in-place-enforced output into its input's storage and returns it (no copy).
    # The plan hands it only tensors it may overwrite (`executor.plan`): a value loaded from the workspace
    # makes the step an update (second phase); on each run a tensor that anything else still sees (another
    # blob, a view, the caller) is replaced by a copy first (`executor.program.claim`).
    OVERWRITES_INPUTS = "overwrites_inputs"
    LEARNING_RATE = "learning_rate"  # computes a learning rate from the iteration counter
    # The kernel reads tensor values into Python (`.item()`, `.tolist()`, a shape taken from a tensor's
    # values) for some inputs or arguments, so a CUDA run waits for the device there, and output
    # shapes or values depend on data, not on input specs (such ops declare an `infer` rule). Copies
    # between devices are CROSS_DEVICE, not HOST_SYNC: they move data without Python reading it.
    HOST_SYNC = "host_sync"
    # A spatial convolution of input 0 into output 0 (NCHW unless its `order` argument says "NHWC"): it gains
    # from channels-last activations, and writes them from a channels-last input (`passes.channels_last`).
    CONVOLUTION = "convolution"
    # Normalises input 0 with statistics over the batch, in SpatialBN's form (X, scale, bias, running mean
    # and variance -> Y, running mean and variance, saved mean, saved inverse std; the 8-input form takes the
    # global sums Σx, Σx² and count) or, for a gradient op, SpatialBNGradient's (X, scale, dY, saved mean,
    # saved inverse std -> dX, dscale, dbias; 8 inputs: the global sums and count): `passes.inter_device_bn`
    # gives every replica's copy the statistics of the whole batch (`combine_spatial_bn`).
    BATCH_NORM = "batch_norm"


# What keeps a kernel out of a compiled program (`executor.compiled`) unless its registration says
# `traceable=True`: a host read of tensor values (torch.compile would bake the value in or break the
# graph), per-run random streams, another process, or the host-side iteration counter.
UNTRACEABLE_TRAITS = frozenset({Trait.HOST_SYNC, Trait.RANDOM, Trait.DISTRIBUTED, Trait.COUNTER})


class Precision(str, Enum):
    """How an op takes part in mixed precision (`passes.precision`); see `PrecisionRule`."""

    LOW = "low"  # gains from the low dtype (matrix work): its inputs are cast down, its outputs are low
    FP32 = "fp32"  # needs range or accuracy (losses, softmax, reductions, updates): low inputs are cast up
    FOLLOW = "follow"  # runs in its inputs' dtype (element-wise, pooling, layout); mixed inputs promote to fp32
    CONVERT = "convert"  # sets its output's dtype itself (Cast, FloatToHalf, HalfToFloat)


@dataclass(frozen=True)
class PrecisionRule:
    """An op's mixed-precision rule: how it computes, on which inputs, and which outputs carry that dtype.

    `inputs`: the inputs the rule governs (None: all); every other floating input is kept fp32 (e.g.
    SpatialBN's scale, bias and running statistics). `outputs`: the outputs in the compute dtype (None:
    all); the others are fp32 or not floating (saved statistics, masks, shapes). `dtype`: a CONVERT op's
    output dtype (None: its `to` argument). Gradient ops need no rule: autodiff gives them the dtypes of
    the forward op they differentiate.
    """

    compute: Precision
    inputs: tuple[int, ...] | None = None
    outputs: tuple[int, ...] | None = None
    dtype: str | None = None


_FP32 = PrecisionRule(Precision.FP32)


def precision_rule(type_: str) -> PrecisionRule:
    """The mixed-precision rule an op type declares at registration (`register_op(precision=...)`), else
    FP32: the safe default, whose low inputs are cast up."""
    return get_schema(type_).precision or _FP32


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


class TensorSpec(NamedTuple):
    """What shape rules know of a tensor: its shape and dtype (no data, no device)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# infer(args, ctx, inputs) -> one TensorSpec (or None: unknown) per output; see the module docstring.
InferRule = Callable[[SimpleNamespace, "KernelContext", list[TensorSpec]], Sequence["TensorSpec | None"]]
# check(args, op, inputs) -> None, raising ValueError/TypeError for inputs that break the op's promise;
# `inputs` have `.shape` and `.dtype` (tensors at run, TensorSpecs at CreateNet).
InputCheck = Callable[[SimpleNamespace, OperatorDef, Sequence[Any]], None]


@dataclass
class KernelContext:
    """What a kernel factory may know at CreateNet: the op, its device, and its random stream.

    `random_stream()` returns the op's own generator source (for ops with the RANDOM trait): call it
    once per run for a generator seeded from the workspace seed, the net, the op's index and the run,
    so draws never depend on the order in which ops execute. Shape inference builds kernels and runs
    rules with `device` = meta and a `random_stream` of throwaway generators that touch no workspace.
    """

    op: OperatorDef
    device: torch.device
    device_of: Callable[[DeviceOption], torch.device]
    random_stream: Callable[[], Callable[[torch.device], torch.Generator]]


class InputReuse(NamedTuple):
    """A second kernel of an op that may write into one of its inputs instead of allocating.

    `kernel(args, ctx)` builds a function taking the same inputs as the op's kernel and returning
    results bit-identical to it, but free to overwrite input `input` (using its storage for an output
    or for scratch). The plan uses it on a run only where that is unseen (`executor.plan`): the op
    rewrites the input's blob (the pair is in place by name), an earlier op of the same run made the
    value, and on that run nothing but the run's frame holds the tensor (`executor.program.owns`).
    """

    input: int
    kernel: Callable[[SimpleNamespace, KernelContext], Callable[..., Any]]


class MultiTensor(NamedTuple):
    """How a group of one update op type becomes one multi-tensor op (`passes.fuse_updates`): the fused
    type, the per-param inputs (one block each, in order), the inputs the group shares, and the input
    each output updates in place."""

    type: str
    blocks: tuple[int, ...]
    shared: tuple[int, ...]
    updated: tuple[int, ...]


class Elementwise(NamedTuple):
    """An op that computes every element of each output from the same element of its `tensors` inputs
    (one shape, which every output has) and whole scalar inputs (the others: learning rates, counters,
    1-element weights). It gives the same bits on any flat piece of its tensors as on the whole, so
    `passes.shard_updates` runs it on each replica's shard. `tensors`: input indices, or a function of
    the op's input count (ops with a variable number of inputs)."""

    tensors: tuple[int, ...] | Callable[[int], tuple[int, ...]]

    def of(self, num_inputs: int) -> tuple[int, ...]:
        """The tensor inputs of an op with `num_inputs` inputs."""
        given = self.tensors(num_inputs) if callable(self.tensors) else self.tensors
        return tuple(i for i in given if i < num_inputs)


class PredictAs(NamedTuple):
    """What a prediction net runs instead of an op whose outputs `unused` nothing reads (a loss whose loss
    nobody reads becomes the prediction it computes): op `type` on this op's inputs `inputs`, writing its
    outputs `outputs`, with its arguments named in `args` (those the op has). `passes.predictor` reads it."""

    unused: tuple[int, ...]
    type: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Effects:
    """What an op type does to its inputs beyond computing outputs, for passes (see the module docstring).

    `aliases`: (input, output) pairs where the output is the input's tensor under another name (no
    copy). `same_value`: pairs where the output equals the input's value (copies; aliases count too).
    `rebinds`: in-place inputs whose storage the kernel never writes (it binds a new tensor to the
    name). `momentum`: the input holding a momentum buffer (BMUF zeroes it after each block).
    `multi_tensor`: how a group of this op fuses. `cross_device(op)`: whether this one op reads or
    writes several replicas' blobs (for types that do so only sometimes; Trait.CROSS_DEVICE is always).
    `elementwise`: the op works element by element on some of its inputs (see `Elementwise`).
    """

    aliases: AbstractSet[tuple[int, int]] = frozenset()  # any set given; frozensets after __post_init__
    same_value: AbstractSet[tuple[int, int]] = frozenset()
    rebinds: AbstractSet[int] = frozenset()
    momentum: int | None = None
    multi_tensor: MultiTensor | None = None
    cross_device: Callable[[OperatorDef], bool] | None = None
    elementwise: Elementwise | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aliases", frozenset(self.aliases))
        object.__setattr__(self, "same_value", frozenset(self.same_value) | self.aliases)
        object.__setattr__(self, "rebinds", frozenset(self.rebinds))


NO_EFFECTS = Effects()


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
    traits: frozenset[Trait] = frozenset()
    infer: InferRule | None = None  # None: run the kernel on meta tensors (see the module docstring)
    check: InputCheck | None = None  # what the inputs must satisfy; kernel and infer already run it
    reuse: InputReuse | None = None  # a kernel that may overwrite an input the run owns
    precision: PrecisionRule | None = None  # mixed precision (None: FP32)
    effects: Effects = NO_EFFECTS  # what passes must know of its inputs' tensors (see `Effects`)
    # traceable(op): whether the kernel runs inside a compiled program (torch.compile) without a graph
    # break or a recompilation per run; the compiled executor runs the others eagerly between regions
    traceable: Callable[[OperatorDef], bool] = field(default=lambda op: True)
    predict_as: PredictAs | None = None  # the op a prediction net runs instead, when some outputs are unused

    def enforced_pairs(self, num_inputs: int, num_outputs: int) -> list[tuple[int, int]]:
        """The (input, output) pairs that must name the same blob, for an op with these counts."""
        return [(i, o) for i in range(num_inputs) for o in range(num_outputs) if self.enforce_inplace(i, o)]

    def all_args(self) -> dict[str, Arg]:
        """Own args plus, for a gradient op, those of its forward op (autodiff copies them over)."""
        if self.gradient_of is None:
            return self.args
        return {**get_schema(self.gradient_of).args, **self.args}

    def has(self, trait: Trait) -> bool:
        """Whether this op type has `trait`."""
        return trait in self.traits


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
    traits: Iterable[Trait] = (),
    infer: InferRule | None = None,
    check: InputCheck | None = None,
    reuse: tuple[int, Callable[[SimpleNamespace, KernelContext], Callable[..., Any]]] | None = None,
    precision: PrecisionRule | Precision | None = None,
    effects: Effects = NO_EFFECTS,
    traceable: bool | Callable[[OperatorDef], bool] | None = None,
    predict_as: PredictAs | None = None,
) -> OpSchema:
    """Register an operator type once; re-registering a type is an error.

    `args` maps each argument to its default (its kind is inferred) or to an `Arg`.
    `gradient` is a maker, NO_GRADIENT, NOT_DIFFERENTIABLE, or None (no maker: an error if reached).
    `gradient_of` names the forward op whose arguments this gradient op accepts.
    `device_inference(op, device) -> (input_devices, output_devices)` overrides "everything on the
    op's device" for ops that read or write CPU blobs from a CUDA op (Iter, LearningRate, copies).
    `traits` declares what the op is (see `Trait`).
    `infer(args, ctx, inputs) -> [TensorSpec | None per output]` is the op's shape rule; without one,
    shape inference runs the kernel on meta tensors (see the module docstring).
    `check(args, op, inputs)` raises for inputs that break the op's promise (`same_shape`, ...); the
    registered kernel and shape rule run it first, so it holds at CreateNet and on every run.
    `reuse=(input, kernel)` adds a kernel that may overwrite that input (see `InputReuse`); it is used
    only where a net writes the op in place on that input (so the op must allow that).
    `precision` is the op's mixed-precision rule (a `PrecisionRule`, or a `Precision` for the rule over
    all inputs and outputs; default FP32), read by `passes.precision` and `passes.channels_last`.
    `effects` declares aliasing, equal values, rebound inputs and fusion for passes (see `Effects`).
    `traceable` says whether the kernel can run inside a compiled program (`executor.compiled`): no
    host read of tensor values, no Python decision on them, nothing that changes per run but tensors;
    a function of the op where its arguments decide (a fill reads values only with `input_as_shape`).
    None derives it: traceable unless the op has one of `UNTRACEABLE_TRAITS`; an op with such a trait
    whose kernel takes a traceable path under `torch.compiler.is_compiling()` says True.
    `predict_as` is the op a prediction net runs instead when some outputs are unused (see `PredictAs`).
    """
    if type_ in _REGISTRY:
        raise ValueError(f"operator {type_!r} is already registered")
    traits = frozenset(traits)
    unknown = [t for t in traits if not isinstance(t, Trait)]
    if unknown:
        raise TypeError(f"operator {type_!r}: traits must be graphpar.core.schema.Trait members, got {unknown}")
    enforce = _inplace_rule(enforce_inplace)
    allowed = _inplace_rule(inplace)
    schema = OpSchema(
        type=type_, num_inputs=_count_range(inputs), num_outputs=_count_range(outputs),
        args={name: _arg_from_default(d) for name, d in (args or {}).items()}, kernel=kernel,
        gradient=gradient, doc=doc, inplace=lambda i, o: enforce(i, o) or allowed(i, o),
        enforce_inplace=enforce, gradient_of=gradient_of, copy_args_to_gradient=copy_args_to_gradient,
        device_inference=device_inference, traits=traits, infer=infer, check=check,
        reuse=reuse and InputReuse(*reuse), effects=effects, predict_as=predict_as,
        precision=PrecisionRule(precision) if isinstance(precision, Precision) else precision,
        traceable=_traceable_rule(not traits & UNTRACEABLE_TRAITS if traceable is None else traceable))
    if check is not None:
        schema.kernel, schema.infer = _checked_kernel(kernel, check), infer and _checked_infer(infer, check)
        if schema.reuse is not None:
            schema.reuse = schema.reuse._replace(kernel=_checked_kernel(schema.reuse.kernel, check))
    _REGISTRY[type_] = schema
    return schema


def _traceable_rule(spec: bool | Callable[[OperatorDef], bool]) -> Callable[[OperatorDef], bool]:
    if callable(spec):
        return spec
    return (lambda op: True) if spec else (lambda op: False)


def _checked_kernel(factory: Callable[[SimpleNamespace, KernelContext], Callable[..., Any]],
                    check: InputCheck) -> Callable[[SimpleNamespace, KernelContext], Callable[..., Any]]:
    """The kernel factory whose kernels run `check` on their inputs first."""

    def make(args: SimpleNamespace, ctx: KernelContext) -> Callable[..., Any]:
        fn, op = factory(args, ctx), ctx.op

        def run(*inputs: Any) -> Any:
            check(args, op, inputs)
            return fn(*inputs)

        return run

    make.__name__ = make.__qualname__ = getattr(factory, "__name__", "kernel")
    return make


def _checked_infer(rule: InferRule, check: InputCheck) -> InferRule:
    """The shape rule that runs `check` on the input specs first."""

    def infer(args: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> Sequence[TensorSpec | None]:
        check(args, ctx.op, inputs)
        return rule(args, ctx, inputs)

    return infer


def same_shape(*groups: Iterable[int] | Callable[[int], Iterable[Iterable[int]]]) -> InputCheck:
    """An input check: the inputs of each group (input indices) have one shape, so nothing broadcasts.

    A group may be a function of the op's input count returning groups (for ops with k params).
    Indices past the op's inputs (optional inputs) are skipped.
    """

    known: dict[int, tuple[tuple[int, ...], ...]] = {}  # by input count (a dict: compilers trace it, not a cache)

    def expanded(count: int) -> tuple[tuple[int, ...], ...]:
        found = known.get(count)
        if found is None:
            flat = [indices for group in groups for indices in (group(count) if callable(group) else (group,))]
            found = known[count] = tuple(kept for kept in (tuple(i for i in indices if i < count) for indices in flat)
                                         if len(kept) > 1)
        return found

    def check(_args: SimpleNamespace, op: OperatorDef, inputs: Sequence[Any]) -> None:
        for indices in expanded(len(inputs)):  # the run-time cost: a few shape comparisons
            first = inputs[indices[0]].shape
            for i in indices[1:]:
                if inputs[i].shape != first:
                    listed = ", ".join(f"{k} {op.inputs[k]!r} {list(inputs[k].shape)}" for k in indices)
                    raise ValueError(f"{op.type}: inputs {listed} must have one shape ({op.type} does not "
                                     f"broadcast); feed or create them with the same shape")

    return check


def all_checks(*checks: InputCheck) -> InputCheck:
    """An input check that runs every one of `checks`, in order."""

    def check(args: SimpleNamespace, op: OperatorDef, inputs: Sequence[Any]) -> None:
        for one in checks:
            one(args, op, inputs)

    return check


@contextmanager
def scoped_registry() -> Iterator[None]:
    """Registrations made inside the block are forgotten on exit (for tests and experiments)."""
    _ensure_loaded()
    before = dict(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(before)
        _passed.clear()


def _ensure_loaded() -> None:
    _providers.load_operators()


def is_registered(type_: str) -> bool:
    """Whether an operator type is registered."""
    _ensure_loaded()
    return type_ in _REGISTRY


def registered_types() -> list[str]:
    """Every registered operator type, sorted."""
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


def has_trait(op: OperatorDef, trait: Trait) -> bool:
    """Whether `op`'s type has `trait` (False for an unregistered type)."""
    schema = _REGISTRY.get(op.type)
    if schema is None and is_registered(op.type):
        schema = _REGISTRY[op.type]
    return schema is not None and trait in schema.traits


def effects_of(op: OperatorDef) -> Effects:
    """The declared effects of `op`'s type (none for an unregistered type)."""
    schema = _REGISTRY.get(op.type)
    if schema is None and is_registered(op.type):
        schema = _REGISTRY[op.type]
    return NO_EFFECTS if schema is None else schema.effects


def crosses_devices(op: OperatorDef) -> bool:
    """Whether `op` moves data between replicas: Trait.CROSS_DEVICE (copies, collectives) or its
    type's `Effects.cross_device` accepts this op (Parallelize's cross-replica Sums)."""
    schema = _REGISTRY.get(op.type)
    if schema is None:
        if not is_registered(op.type):
            return False
        schema = _REGISTRY[op.type]
    rule = schema.effects.cross_device
    return Trait.CROSS_DEVICE in schema.traits or (rule is not None and rule(op))


def stops_gradient(op: OperatorDef) -> bool:
    """Whether `op` is a gradient stop: output 0 is input 0's value and no gradient flows back through
    it (its registration: `gradient=NO_GRADIENT` and `Effects(same_value={(0, 0)})`, as StopGradient)."""
    if not is_registered(op.type):
        return False
    schema = _REGISTRY[op.type]
    return schema.gradient is NO_GRADIENT and (0, 0) in schema.effects.same_value


def _coerce(kind: str, value: Any) -> Any:
    """Convert `value` to `kind` or raise TypeError (numpy scalars are accepted)."""

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


# The `op_signature`s of ops that passed check_operator. Ops are recorded in large numbers with few
# distinct signatures, so most are checked by one set look-up.
_passed: set[tuple] = set()
_MAX_PASSED = 1 << 14  # signatures remembered (later ones are checked every time)
_MAX_LIST = 16  # longer list args (e.g. GivenTensorFill values) are checked every time
_SCALARS = frozenset({int, float, bool, str, type(None)})


def check_operator(op: OperatorDef, where: str = "", counts: bool = True) -> OpSchema:
    """Check an op against its schema (type, counts, in-place pairs, args); return the schema.

    An op whose signature (type, counts, in-place pairs, scalar args) passed before is not checked again.
    With `counts=False` (recording, as Caffe2 did) wrong input/output counts are left for the check
    at CreateNet; only the type and the args are checked for such an op.

    Raises:
        UnknownOperatorError: an unregistered type (naming close matches).
        ValueError: wrong input/output counts, a forbidden or missing in-place pair, one blob named
            as two outputs (checked at recording too).
        TypeError: an unknown, missing or mistyped argument.
    """
    schema = get_schema(op.type)
    _check_distinct_outputs(op, where or f"operator {op.type}")
    signature = op_signature(op)
    if signature is not None and signature in _passed:
        return schema
    if not counts and not _counts_fit(schema, op):
        parse_args(schema, op.args, where or f"operator {op.type}")
        return schema
    _check_against(schema, op, where or f"operator {op.type}")
    if signature is not None and len(_passed) < _MAX_PASSED:
        _passed.add(signature)
    return schema


def _check_distinct_outputs(op: OperatorDef, where: str) -> None:
    """Raise unless every output names another blob: two outputs of one blob would race (which value
    wins depends on the kernel), so an op may not name one blob twice among its outputs."""
    outputs = op.outputs
    if len(outputs) > 1 and len(set(outputs)) != len(outputs):
        twice = sorted({b for b in outputs if outputs.count(b) > 1})
        raise ValueError(f"{where}: names {', '.join(map(repr, twice))} as two of its outputs "
                         f"{list(outputs)}; give each output its own blob")


def _counts_fit(schema: OpSchema, op: OperatorDef) -> bool:
    return (schema.num_inputs[0] <= len(op.inputs) <= schema.num_inputs[1]
            and schema.num_outputs[0] <= len(op.outputs) <= schema.num_outputs[1])


def _check_against(schema: OpSchema, op: OperatorDef, where: str) -> None:
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


def op_signature(op: OperatorDef) -> tuple | None:
    """All of `op` but its blob names: type, counts, in-place pairs and args (with their types), or
    None when an arg is not a scalar or a short list. Schema checks depend on nothing else (shape
    rules on nothing else but the inputs' specs), so a net's replicated ops are checked once."""
    args = []
    for name, value in op.args.items():
        kind = type(value)
        if kind is list:
            types = tuple(map(type, value))
            if len(value) > _MAX_LIST or not _SCALARS.issuperset(types):
                return None
            value = (tuple(value), types)
        elif kind not in _SCALARS:
            return None
        args.append((name, kind, value))
    inputs, outputs = op.inputs, op.outputs
    aliases = () if set(inputs).isdisjoint(outputs) else tuple(
        (i, o) for i, blob in enumerate(inputs) for o, out in enumerate(outputs) if blob == out)
    return op.type, len(inputs), len(outputs), aliases, tuple(args)


def validate_net(netdef: NetDef) -> NetDef:
    """`netdef.validate()` (structure) plus every op checked against its schema; returns `netdef`.

    Raises ValueError/TypeError (or UnknownOperatorError) naming the first op that breaks a rule.
    """
    netdef.validate()
    for index, op in enumerate(netdef.ops):
        check_operator(op, f"net {netdef.name!r} op #{index} ({op.type})")
    return netdef


def gradient_op(type_: str, inputs: list[str], outputs: list[str], **args: Any) -> OperatorDef:
    """A gradient operator for a maker to return (autodiff stamps device, engine and args)."""
    return OperatorDef(type_, [str(b) for b in inputs], [str(b) for b in outputs], dict(args),
                       is_gradient_op=True)


def GI(op: OperatorDef, i: int) -> str:  # noqa: N802 - Caffe2's name in gradient makers
    """The dense gradient blob of the op's i-th input."""
    return grad_name(op.inputs[i])
