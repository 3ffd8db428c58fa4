"""Shape inference: the shape, dtype and device of a net's blobs, known before anything runs.

`infer_specs(netdef, feeds)` walks the ops in program order from the blobs that exist before the net
runs (`feeds`) and asks each op's shape rule for its outputs: the schema's `infer`, or by default its
kernel run on "meta" tensors, which carry shapes and dtypes but no data, so nothing is computed or
allocated. CreateNet runs it so that a shape or dtype mismatch is reported at compile time, naming
the op; passes use it to size blobs (gradient bucketing).

Unknown is not an error: a blob neither fed nor written earlier is unknown, so is an output whose
shape depends on tensor values (a rule returns None for it), and so are the outputs of an op that
reads an unknown blob. Ops with one signature (type, args, input specs, device type), such as a
net's replicas, are inferred once per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from graphpar.core.graph import output_devices
from graphpar.core.ir import CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import KernelContext, TensorSpec, get_schema, op_signature, parse_args
from graphpar.errors import ShapeInferenceError

META = torch.device("meta")


class BlobSpec(NamedTuple):
    """A blob's shape, dtype and device (where it lives, as `core.graph.blob_devices` places it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: DeviceOption

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> BlobSpec:
        """The spec of a tensor (a CUDA tensor's device is CUDA <index>, any other the CPU)."""
        device = tensor.device
        option = DeviceOption(CUDA, device.index or 0) if device.type == "cuda" else DeviceOption()
        return cls(tuple(tensor.shape), tensor.dtype, option)


Feeds = Mapping[str, "BlobSpec | torch.Tensor"]


def infer_specs(netdef: NetDef, feeds: Feeds | None = None,
                wanted: Iterable[str] | None = None) -> dict[str, BlobSpec | None]:
    """The spec of every blob the net reads from `feeds` or writes, as it is after the net (None: unknown).

    `feeds` maps the blobs that exist before the net runs to their BlobSpecs or tensors; only those
    the net reads are looked at, so a workspace's whole blob dict may be passed. With `wanted`, only
    the ops that the final values of those blobs depend on are inferred (the result holds their blobs).

    Raises:
        ValueError: an op's shape rule failed (its inputs do not fit it, or its args are wrong),
            naming the net, the op's index and type, where it was recorded and its input specs.
        TypeError: a feed the net reads is neither a BlobSpec nor a tensor.
    """
    feeds = feeds or {}
    known: dict[str, TensorSpec | None] = {}  # shapes and dtypes, apart from devices so that they memoize
    placed: dict[str, DeviceOption] = {}
    memo: dict[tuple, list[TensorSpec | None]] = {}
    net_device = netdef.device_option or DeviceOption()
    for index in range(len(netdef.ops)) if wanted is None else _slice(netdef.ops, wanted):
        op = netdef.ops[index]
        inputs = [known[name] if name in known else _fed(known, placed, feeds, name) for name in op.inputs]
        if not op.outputs:
            continue
        device = op.device_option or net_device
        specs = [spec for spec in inputs if spec is not None]
        if len(specs) < len(inputs):
            known.update(dict.fromkeys(op.outputs))
        else:
            known.update(zip(op.outputs, _infer_op(netdef, index, device, specs, memo)))
        placed.update(zip(op.outputs, output_devices(op, device)))
    return {name: None if spec is None else BlobSpec(spec.shape, spec.dtype, placed[name])
            for name, spec in known.items()}


def _slice(ops: Sequence[OperatorDef], wanted: Iterable[str]) -> list[int]:
    """The indices, in program order, of the ops that the final values of the `wanted` blobs depend on."""
    needed, kept = set(wanted), []
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        if any(blob in needed for blob in op.outputs):
            kept.append(index)
            needed.difference_update(op.outputs)
            needed.update(op.inputs)
    return kept[::-1]


def on_meta(fn: Callable[..., Any], inputs: Sequence[TensorSpec | BlobSpec]) -> list[TensorSpec]:
    """Call `fn` on meta tensors of the `inputs`' shapes and dtypes; the specs of what it returns (a
    tensor or a tuple of tensors). The default shape rule calls an op's kernel so."""
    out = fn(*[torch.empty(spec.shape, dtype=spec.dtype, device=META) for spec in inputs])
    return [TensorSpec(tuple(t.shape), t.dtype) for t in (out if isinstance(out, (tuple, list)) else (out,))]


def _fed(known: dict[str, TensorSpec | None], placed: dict[str, DeviceOption], feeds: Feeds,
        name: str) -> TensorSpec | None:
    """The spec of feed `name` (recorded in `known` and `placed`), or None when it is not fed."""
    value = feeds.get(name)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = BlobSpec.of(value)
    elif not isinstance(value, BlobSpec):
        raise TypeError(f"infer_specs: feed {name!r} must be a BlobSpec or a torch.Tensor, got "
                        f"{type(value).__name__}")
    spec = known[name] = TensorSpec(value.shape, value.dtype)
    placed[name] = value.device
    return spec


def _infer_op(netdef: NetDef, index: int, device: DeviceOption, inputs: list[TensorSpec],
              memo: dict[tuple, list[TensorSpec | None]]) -> list[TensorSpec | None]:
    """The op's output specs from its rule, memoized by signature; ShapeInferenceError naming the op if it fails."""
    op = netdef.ops[index]
    signature = op_signature(op)
    key = None if signature is None else (signature, device.device_type, *inputs)
    cached = None if key is None else memo.get(key)
    if cached is not None:
        return cached
    schema = get_schema(op.type)
    try:
        args = parse_args(schema, op.args)
        ctx = KernelContext(op=op, device=META, device_of=lambda _option: META, random_stream=_throwaway_stream)
        outs = schema.infer(args, ctx, inputs) if schema.infer else on_meta(schema.kernel(args, ctx), inputs)
        outs = _checked(outs, len(op.outputs))
    except Exception as exc:
        raise ShapeInferenceError(_failure(netdef, index, inputs, exc, schema.infer is None)) from exc
    if key is not None:
        memo[key] = outs
    return outs


def _throwaway_stream() -> Callable[[torch.device], torch.Generator]:
    """Inference's random stream: a fresh CPU generator per draw, touching no workspace's streams."""
    return lambda _device: torch.Generator()


def _checked(outs: Sequence[Any], count: int) -> list[TensorSpec | None]:
    """A rule's result as one TensorSpec (shape a tuple of ints) or None per output."""
    if len(outs) != count:
        raise ValueError(f"the shape rule gave {len(outs)} output specs, the op has {count} outputs")
    checked: list[TensorSpec | None] = []
    for k, spec in enumerate(outs):
        if spec is not None and not isinstance(spec[1], torch.dtype):
            raise TypeError(f"the shape rule gave output {k} dtype {spec[1]!r}, not a torch.dtype")
        checked.append(None if spec is None else TensorSpec(tuple(int(d) for d in spec[0]), spec[1]))
    return checked


def float64_hint(names: Sequence[str], dtypes: Sequence[torch.dtype]) -> str:
    """A message suffix naming the float64 inputs of an op that mixes them with other float dtypes
    (usually a numpy array fed as is: numpy's default is float64), with the fix; else empty."""
    floats = {dtype for dtype in dtypes if dtype.is_floating_point}
    if torch.float64 not in floats or len(floats) < 2:
        return ""
    wide = [name for name, dtype in zip(names, dtypes) if dtype == torch.float64]
    other = next(str(d).removeprefix("torch.") for d in dtypes if d.is_floating_point and d != torch.float64)
    return (f"\n  {', '.join(map(repr, wide))} {'is' if len(wide) == 1 else 'are'} float64 while other inputs are "
            f"{other}: cast to {other} before feeding (e.g. FeedBlob(name, x.astype(np.{other})); numpy "
            f"arrays keep their dtype, and numpy's default is float64)")


def _failure(netdef: NetDef, index: int, inputs: list[TensorSpec], exc: Exception, by_kernel: bool) -> str:
    """The message for op `index`'s failed rule; a kernel that read values on meta tensors gets the fix."""
    op: OperatorDef = netdef.ops[index]
    lines = [f"    input {k} {name!r}: shape {list(spec.shape)}, {str(spec.dtype).removeprefix('torch.')}"
             for k, (name, spec) in enumerate(zip(op.inputs, inputs))]
    hint = ""
    if by_kernel and "meta tensor" in str(exc):
        hint = (f"\n  {op.type}'s kernel reads tensor values on the host: declare Trait.HOST_SYNC and an "
                f"`infer` rule in its registration")
    hint += float64_hint(op.inputs, [spec.dtype for spec in inputs])
    recorded = f" (recorded at {op.source})" if op.source else ""
    described = "\n".join(lines) or "    (none)"
    return (f"[enforce fail at shape inference] net {netdef.name!r} op #{index} ({op.type}){recorded}: its output shapes "
            f"cannot be inferred: {type(exc).__name__}: {exc}\n  inputs:\n{described}{hint}")
