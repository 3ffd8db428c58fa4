"""Analysis passes: where each blob lives, and a check that no op touches another replica's blobs."""

from __future__ import annotations

from collections.abc import Iterable

from graphpar.core.graph import blob_devices
from graphpar.core.ir import CUDA, NetDef, OperatorDef
from graphpar.core.schema import crosses_devices
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout
from graphpar.passes.state import ParallelState


def is_cross_device_op(op: OperatorDef) -> bool:
    """Ops that exist to move data between devices (`core.schema.crosses_devices`: copies, collectives,
    Parallelize's own cross-replica Sums)."""
    return crosses_devices(op)


def analyze_operators(nets: Iterable[NetDef], layout: DeviceLayout) -> None:
    """Check that every other op stays inside one replica.

    Input: the model's nets. Guarantees on return: each op that is not a collective, a copy, a
    `dpm` Sum or a host op writing only shared (unscoped) blobs touches (reads, writes or waits on) blobs of at most one replica scope, and a CUDA op of
    a GPU model runs on that replica's device. Unscoped blobs (e.g. `optimizer_iteration`) are
    shared on purpose and allowed. Caffe2 checked only GPU ops; graphpar checks CPU replicas too.

    Raises:
        ParallelizeError: naming the net, the op, where it was recorded, and the foreign blob.
    """
    for net in nets:
        for index, op in enumerate(net.ops):
            if not is_cross_device_op(op) and not _into_shared_host_blobs(net, op, layout):
                _check_op(net, index, op, layout)


def _into_shared_host_blobs(net: NetDef, op: OperatorDef, layout: DeviceLayout) -> bool:
    """A host op writing only blobs outside every replica: it may read every replica, e.g. the gradient
    of a shared CPU param (an embedding table created before Parallelize) accumulated over the
    replicas' lookups (Caffe2 exempted every Concat)."""
    return (bool(op.outputs) and net.op_device(op).device_type != CUDA
            and all(layout.replica_of(b) is None for b in op.outputs))


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


def infer_devices(state: ParallelState) -> None:
    """Place every blob of the model's nets (`core.graph.blob_devices`, init net first), updating
    `state.blob_to_device` in place (the reducer reads the same dict)."""
    state.blob_to_device.clear()
    state.blob_to_device.update(blob_devices(state.netdefs()))


def analyze(state: ParallelState) -> None:
    """`analyze_operators` on the model's nets."""
    analyze_operators(state.netdefs(), state.layout)


def validate_params(state: ParallelState) -> None:
    """No param is registered twice (the model's own check, `ModelHelper.Validate`), as a ParallelizeError."""
    try:
        state.model.Validate()
    except ValueError as exc:
        raise ParallelizeError(str(exc)) from None
