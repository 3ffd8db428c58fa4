"""Pass: find the device each blob lives on."""

from __future__ import annotations

from collections.abc import Sequence

from graphpar.core.graph import blob_devices
from graphpar.core.ir import DeviceOption, NetDef


def infer_blob_devices(nets: Sequence[NetDef]) -> dict[str, DeviceOption]:
    """`{blob: device}` from the first op (init net first, then the train net) that reads or writes it.

    Input: the model's nets in run order. Guarantees: every blob any op touches is placed; schemas'
    device inference overrides the op's device (Iter counters and copies' CPU sides live on the CPU,
    as Caffe2's `_InferBlobDevice` forced for Iter). The view itself is `core.graph.blob_devices`.
    """
    return blob_devices(nets)
