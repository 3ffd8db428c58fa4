"""Pass (a check): no operator touches another replica's blobs, except the ones that move data."""

from __future__ import annotations

from collections.abc import Iterable

from graphpar.core.ir import CUDA, NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DPM_SUM_NAME, DeviceLayout

# Ops that exist to read or write several devices' blobs.
COLLECTIVE_TYPES = frozenset({"NCCLAllreduce", "NCCLBroadcast", "NCCLReduce", "NCCLAllGather",
                              "Allreduce", "Broadcast", "Barrier"})


def is_cross_device_op(op: OperatorDef) -> bool:
    """Collectives, copies (every type with 'Copy' in its name) and Parallelize's own `dpm` Sums."""
    return (op.type in COLLECTIVE_TYPES or "Copy" in op.type
            or (op.type == "Sum" and op.name == DPM_SUM_NAME))


def analyze_operators(nets: Iterable[NetDef], layout: DeviceLayout) -> None:
    """Check that every other op stays inside one replica.

    Input: the model's nets. Guarantees on return: each op that is not a collective, a copy or a
    `dpm` Sum touches (reads, writes or waits on) blobs of at most one replica scope, and a CUDA op of
    a GPU model runs on that replica's device. Unscoped blobs (e.g. `optimizer_iteration`) are
    shared on purpose and allowed. Caffe2 checked only GPU ops; graphpar checks CPU replicas too.

    Raises:
        ParallelizeError: naming the net, the op, where it was recorded, and the foreign blob.
    """
    for net in nets:
        for index, op in enumerate(net.ops):
            if not is_cross_device_op(op):
                _check_op(net, index, op, layout)


def _check_op(net: NetDef, index: int, op: OperatorDef, layout: DeviceLayout) -> None:
    """The op's replica is its device for a CUDA op of a GPU model, else that of the first replica blob
    it writes (else reads): CPU ops such as a GPU replica's Iter counter carry no replica device."""
    device = net.op_device(op)
    owner = device.device_id if layout.device_type == CUDA and device.device_type == CUDA else None
    for blob in (*op.outputs, *op.inputs, *op.control_inputs):
        replica = layout.replica_of(blob)
        if replica is None:
            continue
        if owner is None:
            owner = replica
        elif replica != owner:
            where = f" (recorded at {op.source})" if op.source else ""
            raise ParallelizeError(
                f"net {net.name!r} op #{index} {op.type}{where} belongs to replica {layout.scope(owner)}/ but "
                f"touches {blob!r}: blob {blob} should have namescope {layout.scope(owner)}/. Replicas may "
                f"only use their own blobs; move data between devices with Copy")
