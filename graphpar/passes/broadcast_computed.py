"""Pass: make computed params (batch-norm running statistics) agree across replicas every iteration.

By default they are copied from the first device (Caffe2's behaviour); `add_computed_params_average`
averages them instead (all-reduce, then scale by 1/N), so every replica's statistics reflect the
whole global batch rather than the first device's share of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.passes.allreduce import PeerAccess, allreduce_copies
from graphpar.passes.common import (
    BlobDevices,
    DeviceLayout,
    Group,
    append_ops,
    broadcast_ops,
    chain_collectives,
    copy_device,
    make_op,
)


def add_computed_params_broadcast(net: NetDef, names: Sequence[str], grouped: Mapping[str, Group],
                                 layout: DeviceLayout, blob_devices: BlobDevices,
                                 use_nccl: bool = False) -> list[OperatorDef]:
    """Append, for each computed param in `names` order, a broadcast from the first device.

    Input: `grouped[name]` has one copy per device; `net` is the train net after the backward ops.
    Guarantees: after these ops every replica holds the first device's value. As in Caffe2 the value
    is copied, not averaged (Caffe2 found NCCL all-reduce of these deadlock-prone); with `use_nccl` on
    CUDA it is one `NCCLBroadcast` per blob, chained after the net's previous collectives. Nothing is
    added for one device. Returns the ops added.
    """
    if len(layout.devices) < 2:
        return []
    ops = [op for name in names for op in broadcast_ops(layout, grouped[name], blob_devices, use_nccl)]
    chain_collectives(net.ops, ops)
    return append_ops(net, ops)


def add_computed_params_average(net: NetDef, names: Sequence[str], grouped: Mapping[str, Group],
                                layout: DeviceLayout, blob_devices: BlobDevices, use_nccl: bool = False,
                                peer_access: PeerAccess | None = None) -> list[OperatorDef]:
    """Append, for each computed param in `names` order, an all-reduce and an in-place `Scale` by 1/N.

    Input: as `add_computed_params_broadcast`. Guarantees: after these ops every replica holds the
    mean of the N replicas' values. The all-reduce is the gradients' (`allreduce.allreduce_copies`: a
    Sum tree and Copy back, or one `NCCLAllreduce` chained after the net's previous collectives); then
    each device scales its own copy, on that copy's device. Nothing is added for one device. Returns
    the ops added.
    """
    if len(layout.devices) < 2:
        return []
    ops = []
    for name in names:
        group = [str(grouped[name][d]) for d in layout.devices]
        ops.extend(allreduce_copies(name, group, layout, blob_devices, use_nccl, peer_access))
        ops.extend(make_op("Scale", [blob], [blob], copy_device(layout, d, blob, blob_devices),
                           scale=1.0 / len(layout.devices)) for d, blob in zip(layout.devices, group))
    chain_collectives(net.ops, ops)
    return append_ops(net, ops)
