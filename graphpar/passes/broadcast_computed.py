"""Pass: copy computed params (batch-norm running statistics) from the first device to the others."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.passes.common import (
    BlobDevices,
    DeviceLayout,
    Group,
    append_ops,
    broadcast_ops,
    chain_collectives,
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
