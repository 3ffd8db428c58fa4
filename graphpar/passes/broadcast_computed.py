"""Pass: make computed params (batch-norm running statistics) agree across replicas every iteration.

By default they are broadcast from the first device (Caffe2's behaviour); with
`average_computed_params` they are averaged instead (all-reduce, then scale by 1/N), so every
replica's statistics reflect the whole global batch rather than the first device's share of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.passes.common import Group, copy_device, make_op
from graphpar.passes.reducers import Reducer, copies
from graphpar.passes.state import ParallelState


def broadcast_computed_params(net: NetDef, names: Sequence[str], grouped: Mapping[str, Group],
                              reducer: Reducer) -> list[OperatorDef]:
    """Append, for each computed param in `names` order, a broadcast from the first device.

    Input: `grouped[name]` has one copy per device; `net` is the train net after the backward ops.
    Guarantees: after these ops every replica holds the first device's value. As in Caffe2 the value
    is copied, not averaged (Caffe2 found NCCL all-reduce of these deadlock-prone). Nothing is added
    for one device. Returns the ops added.
    """
    ops = [op for name in names for op in reducer.broadcast(grouped[name])]
    net.ops.extend(ops)
    return ops


def average_computed_params(net: NetDef, names: Sequence[str], grouped: Mapping[str, Group],
                            reducer: Reducer, blob_devices: Mapping) -> list[OperatorDef]:
    """Append, for each computed param in `names` order, an all-reduce and an in-place `Scale` by 1/N.

    Input: as `broadcast_computed_params`. Guarantees: after these ops every replica holds the mean of
    the N replicas' values (of every shard's, across shards): the reducer's all-reduce, then each device scales its own copy on that
    copy's device. Nothing is added for one device. Returns the ops added.
    """
    layout = reducer.layout
    if copies(reducer) < 2:
        return []
    ops = []
    for name in names:
        group = [str(grouped[name][d]) for d in layout.devices]
        ops.extend(reducer.allreduce(name, group))
        ops.extend(make_op("Scale", [blob], [blob], copy_device(layout, d, blob, blob_devices),
                           scale=1.0 / copies(reducer)) for d, blob in zip(layout.devices, group))
    net.ops.extend(ops)
    return ops


def sync_computed_params(state: ParallelState) -> None:
    """Computed params agree after every iteration: averaged (`average_computed_params`) or broadcast
    from the first device (`broadcast_computed_params`), placed before the gradient all-reduce."""
    net, names = state.model.net.Proto(), state.computed_param_names
    grouped = {name: {d: str(blob) for d, blob in state.grouped[name].items()} for name in names}  # dense blobs
    if state.options.average_computed_params:
        average_computed_params(net, names, grouped, state.reducer, state.blob_to_device)
    else:
        broadcast_computed_params(net, names, grouped, state.reducer)
