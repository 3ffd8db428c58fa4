"""Pass: inter-device (synchronised) batch norm, Caffe2's `combine_spatial_bn` (SPEC §7.7).

Each replica's SpatialBN sees only its slice of the batch. This pass makes every replica normalise
with the statistics of the whole global batch, and back-propagate accordingly, so N devices compute
exactly what one device computes on the concatenated batch:

- forward, per group of N SpatialBN ops (one per device):
  `ChannelStats(X_d) -> X_d_sums, X_d_sumsq, X_d_count` on each device, an all-reduce of each so
  that every device holds the global Σx, Σx² and value count, and each SpatialBN takes them as
  inputs 5, 6, 7 with `num_batches=N`. The count is the real one, so devices fed batches of
  different sizes (a 2 + 6 split of 8) still normalise with the whole batch's statistics, as
  `SyncBatchNorm` weights by each process's count;
- backward, per group of N SpatialBNGradient ops:
  `ChannelBackpropStats(X_d, saved_mean_d, saved_inv_std_d, dY_d) -> dscale_d, dbias_d` (into the
  SpatialBNGradient's own scale / bias gradient blobs), an all-reduce of each, and each
  SpatialBNGradient takes the global sums as inputs 5, 6 and its forward op's global count as input
  7, with `num_batches=N`; it writes the sums back divided by N, in place, and the gradient
  all-reduce that Parallelize adds later sums them up again.

The all-reduce is the reducer's (`passes.reducers`: a Sum tree over device positions plus Copy back,
or one `NCCLAllreduce` with `use_nccl` on CUDA; peers without P2P access are copied to the root first).
Unlike Caffe2, whose GPU variant reduced through `cpu_0` and which needed device ids 0..N-1, the sums
stay on the replicas' devices and any device ids work. The statistics are two per-channel vectors
(and, forward, one scalar count), so per layer this adds N stats ops and 3 all-reduces forward, 2
backward: NCCLAllreduce ops, or Sum reductions (N-1 pairwise Sums each for 4, 8 or 16 devices, else
one N-ary Sum) and N-1 Copies each. Unlike Caffe2, devices may get batches of different sizes.
"""

from __future__ import annotations

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.naming import stripBlobName
from graphpar.core.schema import Trait, get_schema, has_trait
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout, make_op
from graphpar.passes.reducers import DistributedReducer, Reducer, copies
from graphpar.passes.state import ParallelState


def inter_device_batch_norm(netdef: NetDef, reducer: Reducer) -> NetDef:
    """Rewrite every group of training SpatialBN / SpatialBNGradient ops to use global batch statistics.

    Input invariant: `netdef` was interleaved (`interleave_ops`), so each training SpatialBN (5
    inputs, `is_test` false) is followed by its counterparts on the other devices, one per device in
    `layout.devices` order, and likewise each SpatialBNGradient (added by autodiff before this pass:
    the gradient maker refuses the 7-input form). Guarantees: before each group, the per-device stats
    ops and their all-reduce; each op of the group gets the summed statistics as inputs 5, 6 and
    `num_batches=N`; every new non-collective op runs on its replica's device and touches only its
    replica's blobs. Other ops are unchanged; already combined (7-input) or `is_test` ops are left alone. A single device is a no-op.
    Across shards (`DistributedReducer`) the statistics are summed over every replica of every shard
    and N counts them all.
    Returns `netdef`, edited in place.

    Raises:
        ParallelizeError: a group is incomplete or out of device order (run interleave_ops first).
    """
    layout = reducer.layout
    count = len(layout.devices)
    if copies(reducer) < 2:
        return netdef
    taken = {b for op in netdef.ops for b in (*op.inputs, *op.outputs)} | set(netdef.external_inputs)
    counts: dict[str, str] = {}  # a forward op's saved mean -> its global count blob
    rewritten: list[OperatorDef] = []
    index = 0
    while index < len(netdef.ops):
        op = netdef.ops[index]
        if not _is_combinable(op):
            rewritten.append(op)
            index += 1
            continue
        group = netdef.ops[index:index + count]
        _check_group(netdef, index, group, layout)
        rewritten += _combine(group, reducer, taken, counts)
        index += count
    netdef.ops[:] = rewritten
    return netdef


def _is_combinable(op: OperatorDef) -> bool:
    """A training batch norm (`Trait.BATCH_NORM`: SpatialBN, SpatialBNGradient) that does not have the
    global statistics yet."""
    return has_trait(op, Trait.BATCH_NORM) and len(op.inputs) == 5 and not op.args.get("is_test", False)


def _check_group(netdef: NetDef, index: int, group: list[OperatorDef], layout: DeviceLayout) -> None:
    expected = [(group[0].type, device) for device in layout.devices]
    found = [(_label(op), netdef.op_device(op).device_id) for op in group]
    if found != expected:
        raise ParallelizeError(
            f"inter-device batch norm: net {netdef.name!r} op #{index} starts a group of {group[0].type} "
            f"ops, expected one per device {list(layout.devices)} in that order, found (type, device) "
            f"{found}. Run interleave_ops first, and build every replica identically")


def _label(op: OperatorDef) -> str:
    if has_trait(op, Trait.BATCH_NORM) and not _is_combinable(op):
        return f"{op.type} (is_test or already combined)"
    return op.type


def _combine(group: list[OperatorDef], reducer: Reducer, taken: set[str],
             counts: dict[str, str]) -> list[OperatorDef]:
    """The stats ops and their all-reduce, then the group's ops, edited to read the global stats."""
    if get_schema(group[0].type).gradient_of is None:  # the forward op
        stats = [make_op("ChannelStats", [op.inputs[0]],
                         [_fresh(f"{op.inputs[0]}_{what}", taken) for what in ("sums", "sumsq", "count")],
                         op.device_option) for op in group]
        counts.update((op.outputs[3], stat.outputs[2]) for op, stat in zip(group, stats))
        extra: list[list[str]] = [[] for _ in group]
    else:  # SpatialBNGradient(X, scale, dY, saved_mean, saved_inv_std) -> dX, dscale, dbias
        stats = [make_op("ChannelBackpropStats", [op.inputs[0], op.inputs[3], op.inputs[4], op.inputs[2]],
                         op.outputs[1:3], op.device_option) for op in group]
        missing = [op.inputs[3] for op in group if op.inputs[3] not in counts]
        if missing:
            raise ParallelizeError(f"inter-device batch norm: SpatialBNGradient reads saved means {missing} "
                                   f"that no combined training SpatialBN before it wrote")
        extra = [[counts[op.inputs[3]]] for op in group]
    reduce_ops = [op for copies in zip(*(stat.outputs for stat in stats))
                  for op in reducer.allreduce(stripBlobName(copies[0]), copies)]
    for op, stat, more in zip(group, stats, extra):
        op.inputs.extend([*stat.outputs, *more])
        op.args["num_batches"] = copies(reducer)  # every replica of every shard
    return [*stats, *reduce_ops, *group]


def _fresh(name: str, taken: set[str]) -> str:
    """`name`, or `name_1`, `name_2`, ... if a blob already has it; the result is marked taken."""
    candidate, suffix = name, 0
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    taken.add(candidate)
    return candidate



BN_GROUP_WORLD = "graphpar_bn_cw"  # the communicator of combine_spatial_bn's group of shards


def combine_batch_norm(state: ParallelState) -> None:
    """`inter_device_batch_norm` on the (interleaved) train net (`combine_spatial_bn`): over every
    replica of every shard; with "shard", this shard's devices only (the local reducer of a
    `DistributedReducer`, so num_batches counts this shard's replicas); with groups of shards, the
    devices of this shard's group (a `DistributedReducer` on communicator `BN_GROUP_WORLD`, recorded in
    `state.group_worlds` for `passes.distributed` to create over the group alone)."""
    reducer, combine = state.reducer, state.options.combine_spatial_bn
    if isinstance(reducer, DistributedReducer) and combine == "shard":
        reducer = reducer.local
    elif isinstance(reducer, DistributedReducer) and isinstance(combine, tuple):
        rendezvous = state.options.rendezvous
        group = next(g for g in combine if rendezvous is not None and rendezvous.shard_id in g)
        if len(group) == 1:
            reducer = reducer.local
        elif len(group) < reducer.num_shards:
            reducer = DistributedReducer(reducer.local, len(group), 1, reducer.blob_devices, reducer.order)
            reducer.worlds = [BN_GROUP_WORLD]
            state.group_worlds[BN_GROUP_WORLD] = group
    inter_device_batch_norm(state.model.net.Proto(), reducer)
