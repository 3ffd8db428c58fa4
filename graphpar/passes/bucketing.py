"""Pass: all-reduce gradients in buckets of a byte size, one collective per bucket, as PyTorch DDP does.

Many small collectives cost more than a few large ones (each Sum, Copy or NCCL launch has a fixed
overhead), so gradients are packed, in the order they are reduced (reverse creation order, the last
layer first), into buckets: the first one small (`first_bucket_bytes`, DDP's 1 MiB, so the first
collective starts early), the others up to `bucket_bytes`. Per bucket and device the gradients are
flattened (`FlattenToVec`) and concatenated (`Concat`) into one flat buffer, the buffers are summed
by the reducer's all-reduce (`passes.reducers`: Sum tree and Copy back, or one `NCCLAllreduce`), and each device cuts its buffer back (`Split`) and restores every gradient's shape
(`Reshape`) into the gradient blob, so the update ops read what they read without buckets.

Sizes come from the op of `param_init_net` that creates each param (a gradient has its param's shape
and dtype): its `shape` (+ `extra_shape`) argument and its dtype. A param created otherwise (an op with
inputs, a `Load`, ...) raises `ParallelizeError` naming it, rather than guessing: bucketing is opt-in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.naming import bucket_name, flat_name, old_shape_name, split_info_name, stripBlobName
from graphpar.ops.fill import to_torch_dtype
from graphpar.passes.allreduce import checked_group
from graphpar.passes.common import make_op
from graphpar.passes.reducers import Reducer
from graphpar.passes.state import ParallelState

# Fill ops whose output shape is their `shape` (+ `extra_shape`) argument when they have no input.
_SHAPED_FILLS = frozenset({"ConstantFill", "UniformFill", "GaussianFill", "XavierFill", "MSRAFill"})
_GIVEN_FILLS = {"GivenTensorFill": torch.float32, "GivenTensorDoubleFill": torch.float64,
                "GivenTensorIntFill": torch.int32, "GivenTensorInt64Fill": torch.int64,
                "GivenTensorBoolFill": torch.bool}


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of a gradient (those of its param)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def param_specs(init_net: NetDef, params: Iterable[str]) -> dict[str, TensorSpec]:
    """The shape and dtype of each param as the first op of `init_net` that writes it creates it.

    Raises:
        ParallelizeError: naming a param that no op creates, or whose op's output shape is not given by
            its arguments.
    """
    creators: dict[str, OperatorDef] = {}
    for op in init_net.ops:
        for blob in op.outputs:
            creators.setdefault(blob, op)
    return {param: _spec(param, creators.get(param)) for param in params}


def _spec(param: str, op: OperatorDef | None) -> TensorSpec:
    if op is None:
        raise ParallelizeError(f"gradient bucketing needs the size of param {param!r}, but no op of "
                               f"param_init_net creates it; create it there, or use gradient_bucket_bytes=None")
    where = f"{op.type} op {list(op.inputs)} -> {list(op.outputs)}"
    if op.inputs or op.args.get("input_as_shape") or (op.type not in _SHAPED_FILLS and op.type not in _GIVEN_FILLS):
        raise ParallelizeError(f"gradient bucketing needs the size of param {param!r}, but its {where} in "
                               f"param_init_net does not give its shape as arguments; create it with a fill "
                               f"op and a `shape` (e.g. XavierFill(shape=...)), or use gradient_bucket_bytes=None")
    shape = tuple(int(s) for s in (*op.args.get("shape", ()), *op.args.get("extra_shape", ())))
    try:
        return TensorSpec(shape, _fill_dtype(op))
    except ValueError as e:
        raise ParallelizeError(f"gradient bucketing: param {param!r}: {e}") from None


def _fill_dtype(op: OperatorDef) -> torch.dtype:
    """The fill kernels' dtype rule (graphpar.ops.fill), for an op without inputs."""
    if op.type in _GIVEN_FILLS:
        return _GIVEN_FILLS[op.type]
    if op.args.get("dtype") is not None:
        return to_torch_dtype(op.args["dtype"], f"{op.type} op writing {list(op.outputs)}")
    value = op.args.get("value", 0.0) if op.type == "ConstantFill" else 0.0
    if isinstance(value, bool):
        return torch.bool
    return torch.int64 if isinstance(value, Integral) else torch.float32


def plan_buckets(names: Sequence[str], specs: Mapping[str, TensorSpec], bucket_bytes: int,
                 first_bucket_bytes: int) -> list[list[str]]:
    """Cut `names` (in order) into buckets: the first of at most `first_bucket_bytes`, the others of at
    most `bucket_bytes`. A gradient larger than the limit gets a bucket of its own, and so does an empty
    one; a bucket holds one dtype (a change of dtype starts a new bucket).
    """
    buckets: list[list[str]] = []
    current: list[str] = []
    filled, limit = 0, first_bucket_bytes
    for name in names:
        spec = specs[name]
        if current and (filled + spec.nbytes > limit or spec.dtype != specs[current[0]].dtype
                        or spec.numel == 0 or specs[current[0]].numel == 0):
            buckets.append(current)
            current, filled, limit = [], 0, bucket_bytes
        current.append(name)
        filled += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def allreduce_buckets(net: NetDef, init_net: NetDef, names: Iterable[str], params: Mapping[str, str],
                      grouped: Mapping[str, Mapping[int, str]], reducer: Reducer, bucket_bytes: int,
                      first_bucket_bytes: int, to_all: bool = True) -> list[OperatorDef]:
    """Append the ops that sum the gradients in `names` (in that order) over every replica, by bucket.

    Input: as `allreduce.allreduce_blobs`, plus `params[name]`, the first device's param of
    gradient `name`, created in `init_net` (its shape and dtype are the gradient's). Guarantees: after
    the ops, every copy of each gradient (only the first device's with `to_all=False`) holds the sum,
    with its own shape, as without buckets. A bucket of a single gradient is reduced as without
    buckets (nothing to flatten). Returns the ops added, all in `net`.

    Raises:
        ParallelizeError: a gradient misses a copy on some device; a param's size is unknown.
        NotImplementedError: a sparse (GradientSlice) gradient.
    """
    layout = reducer.layout
    if len(layout.devices) < 2:
        return []
    groups = {}
    for name in names:
        group = checked_group(name, grouped[name], layout)
        if group is not None:
            groups[name] = group
    sizes = param_specs(init_net, [params[name] for name in groups])
    specs = {name: sizes[params[name]] for name in groups}
    ops: list[OperatorDef] = []
    for k, bucket in enumerate(plan_buckets(list(groups), specs, bucket_bytes, first_bucket_bytes)):
        if len(bucket) == 1:
            ops.extend(reducer.allreduce(bucket[0], groups[bucket[0]], to_all))
        else:
            ops.extend(_bucket_ops(k, bucket, groups, specs, reducer, to_all))
    net.ops.extend(ops)
    return ops


def _bucket_ops(k: int, bucket: list[str], groups: Mapping[str, list[str]], specs: Mapping[str, TensorSpec],
                reducer: Reducer, to_all: bool) -> list[OperatorDef]:
    """Flatten and concatenate on every device, one all-reduce of the buffers, split and reshape back."""
    layout = reducer.layout
    positions = range(len(layout.devices))
    buffers = [bucket_name(groups[bucket[0]][i], k) for i in positions]
    ops = []
    for i in positions:
        device = layout.option(layout.devices[i])
        grads = [groups[name][i] for name in bucket]
        ops.extend(make_op("FlattenToVec", [g], [flat_name(g)], device) for g in grads)
        ops.append(make_op("Concat", [flat_name(g) for g in grads], [buffers[i], split_info_name(buffers[i])],
                           device, axis=0))
    ops.extend(reducer.allreduce(stripBlobName(buffers[0]), buffers, to_all))
    sizes = [specs[name].numel for name in bucket]
    for i in positions if to_all else positions[:1]:
        device = layout.option(layout.devices[i])
        grads = [groups[name][i] for name in bucket]
        ops.append(make_op("Split", [buffers[i]], [flat_name(g) for g in grads], device, axis=0, split=sizes))
        ops.extend(make_op("Reshape", [flat_name(g)], [g, old_shape_name(g)], device,
                           shape=list(specs[name].shape)) for name, g in zip(bucket, grads))
    return ops


def allreduce_gradient_buckets(state: ParallelState) -> None:
    """Like `allreduce.allreduce_gradients`, in buckets of `gradient_bucket_bytes` (see the module doc)."""
    model, layout, options = state.model, state.layout, state.options
    params = {stripBlobName(g): str(p) for p, g in model.param_to_grad.items()
              if layout.replica_of(str(p)) == layout.master}
    allreduce_buckets(model.net.Proto(), model.param_init_net.Proto(), reversed(state.grad_names), params,
                      state.grouped, state.reducer, options.gradient_bucket_bytes, options.first_bucket_bytes,
                      to_all=not options.shared_model)
