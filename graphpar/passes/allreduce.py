"""Pass: all-reduce (sum) every gradient across the replicas of one host, in reverse creation order.

The last layer's gradients are ready first, so they go first. The reducer decides the ops (a Sum tree
onto the first device and copies back, or one NCCLAllreduce; see `passes.reducers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from graphpar.core.ir import GradientSlice, NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout
from graphpar.passes.reducers import Reducer, copies
from graphpar.passes.sparse_allreduce import Gathered, allgather_slices, is_sparse
from graphpar.passes.state import Blob, ParallelState


def allreduce_blobs(net: NetDef, names: Iterable[str], grouped: Mapping[str, Mapping[int, Blob]],
                    reducer: Reducer, to_all: bool = True) -> list[OperatorDef]:
    """Append to `net` the ops that sum each blob in `names` (in that order) over every replica.

    Input: `net` computes every copy; `grouped[name]` maps each device id to its copy (a group with a
    single copy, e.g. a gradient that is not data parallel, is skipped). Guarantees: after the ops,
    every copy (only the first device's with `to_all=False`, used by shared CPU models) holds the
    sum. Returns the ops added.

    Raises:
        ParallelizeError: a blob misses a copy on some device.
        ValueError: a sparse (GradientSlice) gradient.
    """
    if copies(reducer) < 2:
        return []
    ops: list[OperatorDef] = []
    for name in names:
        group = checked_group(name, grouped[name], reducer.layout, reducer.num_shards > 1)
        if group is not None:
            ops.extend(reducer.allreduce(name, group, to_all))
    net.ops.extend(ops)
    return ops


def allreduce_gradients(state: ParallelState) -> None:
    """Sum every data-parallel gradient over the replicas, in reverse creation order (one by one);
    sparse ones are concatenated instead, at their place in that order (`passes.sparse_allreduce`).

    Input: the train net computes every replica's gradients (`state.grad_names` grouped). Guarantees:
    each replica's gradient holds the sum (the first device's only, for a shared model); each sparse
    gradient's `param_to_grad` entry names the combined indices and values.
    """
    net, to_all = state.model.net.Proto(), not state.options.shared_model
    gathered: Gathered = {}
    for name in reversed(state.grad_names):
        if is_sparse(state.grouped[name]):
            net.ops.extend(allgather_slices(state, [name], gathered, to_all))
        else:
            allreduce_blobs(net, [name], state.grouped, state.reducer, to_all)


def checked_group(name: str, copies: Mapping[int, Blob], layout: DeviceLayout,
                  across_shards: bool = False) -> list[str] | None:
    """The copies of `name` in device order, or None for a single copy (nothing to reduce), unless
    `across_shards` (a single copy, e.g. a gradient that is not data parallel, then has one per shard).

    Raises:
        ParallelizeError: a copy is missing on some device.
        ValueError: a sparse (GradientSlice) gradient (it is concatenated, not summed).
    """
    if len(copies) == 1:
        return [str(next(iter(copies.values())))] if across_shards else None
    missing = [d for d in layout.devices if d not in copies]
    if missing:
        raise ParallelizeError(f"gradient {name!r} has no copy on device(s) {missing}; every replica must "
                               f"compute it (each device should have a copy)")
    if any(isinstance(copies[d], GradientSlice) for d in layout.devices):
        raise ValueError(f"gradient {name!r} is sparse (GradientSlice): it cannot be summed; "
                         f"passes.sparse_allreduce concatenates sparse gradients")
    return [str(copies[d]) for d in layout.devices]
