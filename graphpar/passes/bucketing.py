"""Pass: all-reduce gradients in buckets of a byte size, one collective per bucket, as PyTorch DDP does.

Many small collectives cost more than a few large ones (each Sum, Copy or NCCL launch has a fixed
overhead), so gradients are packed, in the order they are reduced (reverse creation order, the last
layer first), into buckets as DDP assigns them (`plan_buckets`): the first one small
(`first_bucket_bytes`, DDP's 1 MiB, so the first collective starts early), the others of
`bucket_bytes`, each closing once it holds at least its limit. Per bucket and device the gradients are
flattened (`FlattenToVec`) and concatenated (`Concat`) into one flat buffer, the buffers are summed
by the reducer's all-reduce (`passes.reducers`: Sum tree and Copy back, or one `NCCLAllreduce`), and
each device cuts its buffer back (`Split`) and restores every gradient's shape (`Reshape`) into the gradient blob, so the update ops read what they read without buckets.

Sizes come from shape inference (`core.shapes.infer_specs`) on the ops of `param_init_net` that
create the params (a gradient has its param's shape and dtype), whatever ops they are. A param whose
size inference cannot tell (no op creates it, or its shape depends on tensor values, such as a fill
with `input_as_shape`) raises `ParallelizeError` naming it, rather than guessing, when buckets were
asked for; the default buckets on real CUDA devices fall back to one all-reduce per gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.naming import bucket_name, flat_name, old_shape_name, split_info_name, stripBlobName
from graphpar.core.shapes import BlobSpec, infer_specs
from graphpar.errors import ParallelizeError
from graphpar.passes.allreduce import allreduce_gradients, checked_group
from graphpar.passes.common import make_op
from graphpar.passes.reducers import Reducer, copies
from graphpar.passes.sparse_allreduce import allgather_slices, is_sparse
from graphpar.passes.state import Blob, ParallelState

log = logging.getLogger(__name__)


_BUCKETS = ("gradient bucketing", "use gradient_bucket_bytes=0 (no buckets)")


def param_specs(init_net: NetDef, params: Iterable[str], user: tuple[str, str] = _BUCKETS) -> dict[str, BlobSpec]:
    """The shape, dtype and device of each param after `init_net`, inferred from the ops creating it.
    `user` names what needs them and the way out, for the errors (default: gradient bucketing's).

    Raises:
        ParallelizeError: naming a param that no op creates or whose shape inference cannot tell, or
            the op whose shape rule failed.
    """
    params, (needs, instead) = list(params), user
    try:
        specs = infer_specs(init_net, wanted=params)
    except ValueError as e:
        raise ParallelizeError(f"{needs} needs the sizes of the params, but {e}") from None
    for param in params:
        if param not in specs:
            raise ParallelizeError(f"{needs} needs the size of param {param!r}, but no op of "
                                   f"param_init_net creates it; create it there, or {instead}")
        if specs[param] is None:
            raise ParallelizeError(f"{needs} needs the size of param {param!r}, but shape inference "
                                   f"on param_init_net cannot tell it: its shape depends on tensor values (e.g. "
                                   f"a fill with input_as_shape); give the shape as an argument (e.g. "
                                   f"XavierFill(shape=...)), or {instead}")
    return {param: spec for param in params if (spec := specs[param]) is not None}  # each known: checked above


def plan_buckets(names: Sequence[str], specs: Mapping[str, BlobSpec], bucket_bytes: int,
                 first_bucket_bytes: int) -> list[list[str]]:
    """Cut `names` (in the order their gradients are reduced) into buckets as PyTorch DDP does
    (`torch.distributed._compute_bucket_assignment_by_size`, with the gradients in ready order, as
    DDP's Reducer rebuilds its buckets after the first iteration).

    Each (dtype, device) fills a bucket of its own: a gradient joins the open bucket of its kind, and
    the bucket closes once it holds at least its limit (so it may pass it: a gradient larger than the
    limit closes the bucket it joined). The first bucket of each kind has the limit
    `first_bucket_bytes`, the others `bucket_bytes`. Buckets come in the order they close, then the
    ones still open, by their first gradient.
    """
    buckets: list[list[str]] = []
    open_: dict[tuple, tuple[list[str], int]] = {}  # kind -> (its open bucket, the bytes it holds)
    closed: set[tuple] = set()  # the kinds that closed a bucket already (their limit is bucket_bytes)
    for name in names:
        spec = specs[name]
        kind = (spec.dtype, spec.device)
        bucket, filled = open_.pop(kind, ([], 0))
        bucket.append(name)
        filled += spec.nbytes
        if filled >= (bucket_bytes if kind in closed else first_bucket_bytes):
            buckets.append(bucket)
            closed.add(kind)
        else:
            open_[kind] = (bucket, filled)
    order = {name: k for k, name in enumerate(names)}
    return buckets + sorted((bucket for bucket, _ in open_.values()), key=lambda bucket: order[bucket[0]])


def allreduce_buckets(net: NetDef, init_net: NetDef, names: Iterable[str], params: Mapping[str, str],
                      grouped: Mapping[str, Mapping[int, Blob]], reducer: Reducer, bucket_bytes: int,
                      first_bucket_bytes: int, to_all: bool = True) -> list[OperatorDef]:
    """Append the ops that sum the gradients in `names` (in that order) over every replica, by bucket.

    Input: as `allreduce.allreduce_blobs`, plus `params[name]`, the first device's param of
    gradient `name`, created in `init_net` (its shape and dtype are the gradient's). Guarantees: after
    the ops, every copy of each gradient (only the first device's with `to_all=False`) holds the sum,
    with its own shape, as without buckets. A bucket of a single gradient is reduced as without
    buckets (nothing to flatten). Returns the ops added, all in `net`.

    Raises:
        ParallelizeError: a gradient misses a copy on some device; a param's size is unknown.
        ValueError: a sparse (GradientSlice) gradient (`allreduce_gradient_buckets` leaves them out).
    """
    layout = reducer.layout
    if copies(reducer) < 2:
        return []
    groups, singles = {}, []
    for name in names:
        group = checked_group(name, grouped[name], layout, reducer.num_shards > 1)
        if group is not None and len(group) < len(layout.devices):  # not data parallel: one copy per shard
            singles.append(name)
            groups[name] = group
        elif group is not None:
            groups[name] = group
    ops: list[OperatorDef] = [op for name in singles for op in reducer.allreduce(name, groups.pop(name), to_all)]
    sizes = param_specs(init_net, [params[name] for name in groups])
    specs = {name: sizes[params[name]] for name in groups}
    buckets = plan_buckets(list(groups), specs, bucket_bytes, first_bucket_bytes)
    log.info("gradient buckets: %d gradients in %d buckets of %s bytes (limit %d, first %d)", len(groups),
             len(buckets), [sum(specs[name].nbytes for name in bucket) for bucket in buckets], bucket_bytes,
             first_bucket_bytes)
    for k, bucket in enumerate(buckets):
        log.debug("gradient bucket %d: %s", k, bucket)
        if len(bucket) == 1:
            ops.extend(reducer.allreduce(bucket[0], groups[bucket[0]], to_all))
        else:
            ops.extend(_bucket_ops(k, bucket, groups, specs, reducer, to_all))
    net.ops.extend(ops)
    return ops


def _bucket_ops(k: int, bucket: list[str], groups: Mapping[str, list[str]], specs: Mapping[str, BlobSpec],
                reducer: Reducer, to_all: bool) -> list[OperatorDef]:
    """Flatten and concatenate on every device, one all-reduce of the buffers, split and reshape back."""
    layout = reducer.layout
    positions = range(len(layout.devices))
    buffers = [bucket_name(groups[bucket[0]][i], k) for i in positions]
    ops: list[OperatorDef] = []
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
    """Like `allreduce.allreduce_gradients`, in buckets of `gradient_bucket_bytes` (see the module doc).
    Sparse gradients stay out of buckets: each is concatenated on its own after the buckets. The
    default buckets on CUDA (`auto_buckets`) give way to `allreduce_gradients` when a param's size
    cannot be told."""
    model, layout, options = state.model, state.layout, state.options
    if options.gradient_bucket_bytes is None:  # no buckets asked for
        allreduce_gradients(state)
        return
    params = {stripBlobName(g): str(p) for p, g in model.param_to_grad.items()
              if layout.replica_of(str(p)) == layout.master}
    if options.auto_buckets:  # the CUDA default, not asked for: fall back rather than refuse
        try:
            param_specs(model.param_init_net.Proto(), params.values())
        except ParallelizeError as exc:
            log.info("gradients all-reduced one by one instead of in the default buckets: %s", exc)
            allreduce_gradients(state)
            return
    names = list(reversed(state.grad_names))
    sparse = [name for name in names if is_sparse(state.grouped[name])]
    allreduce_buckets(model.net.Proto(), model.param_init_net.Proto(), [n for n in names if n not in sparse],
                      params, state.grouped, state.reducer, options.gradient_bucket_bytes,
                      options.first_bucket_bytes, to_all=not options.shared_model)
    model.net.Proto().ops.extend(allgather_slices(state, sparse, {}, to_all=not options.shared_model))
