"""What every Parallelize pass shares: the replica layout, op construction, appending, broadcasting.

A `DeviceLayout` names the replicas (`gpu_3/...` or `cpu_1/...`) and their device options; the
*position* of a device in `layout.devices` (not its id) is what trees and "the first device" refer
to, so device ids need not start at 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from graphpar.core.ir import CPU, CUDA, DeviceOption, DeviceType, NetDef, OperatorDef
from graphpar.naming import SCOPE_SEPARATOR, device_scope_name, device_scoped

# A blob's copies, one per replica: {device id: blob name}.
Group = Mapping[int, str]
# Where blobs live (graphpar.core.graph.blob_devices); a missing blob lives on its replica's device.
BlobDevices = Mapping[str, DeviceOption]

DPM_SUM_NAME = "dpm"  # the name of the cross-replica Sum ops Parallelize adds (Caffe2's marker)


@dataclass(frozen=True)
class DeviceLayout:
    """The replicas of a parallelized model: device ids in order and the name prefix ('gpu' or 'cpu')."""

    devices: tuple[int, ...]
    prefix: str

    @property
    def device_type(self) -> DeviceType:
        """CUDA for 'gpu' replicas, CPU for 'cpu' ones."""
        return CUDA if self.prefix == "gpu" else CPU

    @property
    def master(self) -> int:
        """The first device: the root of reductions and the source of broadcasts."""
        return self.devices[0]

    def option(self, device_id: int) -> DeviceOption:
        """The DeviceOption replica `device_id` runs on."""
        return self._options.get(device_id) or DeviceOption(self.device_type, device_id)

    @cached_property
    def _options(self) -> dict[int, DeviceOption]:
        """One DeviceOption per replica, shared by the many ops passes create."""
        return {d: DeviceOption(self.device_type, d) for d in self.devices}

    def scope(self, device_id: int) -> str:
        """The replica's name scope without the trailing '/', e.g. 'gpu_3'."""
        return device_scope_name(self.prefix, device_id)

    def scoped(self, device_id: int, name: str) -> str:
        """`name` inside replica `device_id`, e.g. 'gpu_3/fc_w'."""
        return device_scoped(self.prefix, device_id, name)

    def replica_of(self, blob: str) -> int | None:
        """The device id whose scope `blob` is in ('gpu_3/x' -> 3), or None outside these replicas."""
        head, sep, _ = blob.partition(SCOPE_SEPARATOR)
        return self._scope_ids.get(head) if sep else None

    @cached_property
    def _scope_ids(self) -> dict[str, int]:
        """{'gpu_3': 3, ...}: a dict look-up is what passes over 100k-op nets can afford per blob."""
        return {self.scope(d): d for d in self.devices}

    def group(self, name: str) -> dict[int, str]:
        """The copies of unscoped `name`, one per replica, in device order."""
        return {d: self.scoped(d, name) for d in self.devices}


def make_op(type_: str, inputs: Iterable[str], outputs: Iterable[str], device: DeviceOption | None,
            name: str = "", control_inputs: Iterable[str] = (), **args: Any) -> OperatorDef:
    """An OperatorDef built by a pass (its `source`, shown in error messages, says so)."""
    return OperatorDef(type_, [str(b) for b in inputs], [str(b) for b in outputs], args, device, name,
                       control_inputs=[str(b) for b in control_inputs], source="added by Parallelize")


def append_ops(net: NetDef, ops: Iterable[OperatorDef]) -> list[OperatorDef]:
    """Append `ops` to `net`; inputs that no earlier op produces become external inputs. Returns the ops."""
    ops = list(ops)
    if not ops:
        return ops
    known = set(net.external_inputs)
    for op in net.ops:
        known.update(op.outputs)
    for op in ops:
        for blob in op.inputs:
            if blob not in known:
                net.external_inputs.append(blob)
                known.add(blob)
        known.update(op.outputs)
    net.ops.extend(ops)
    return ops


def chain_collectives(earlier: Sequence[OperatorDef], ops: Iterable[OperatorDef]) -> None:
    """Chain the NCCL ops among `ops`, in order, after the last NCCL op of `earlier` (the ops they
    follow in the net): each gets a control input on the first output of the NCCL op before it.

    Single-process NCCL launches issued concurrently (by the DAG executor's workers) can deadlock, so
    every collective of a net runs in one fixed order, whichever pass added it (Caffe2 chained only
    its gradient all-reduces, not its batch-norm or computed-param collectives).
    """
    ops = [op for op in ops if op.type.startswith("NCCL")]
    if not ops:
        return
    previous = next((op.outputs[0] for op in reversed(earlier) if op.type.startswith("NCCL")), None)
    for op in ops:
        if previous is not None and previous not in op.control_inputs:
            op.control_inputs.append(previous)
        previous = op.outputs[0]


def copy_device(layout: DeviceLayout, device_id: int, blob: str, blob_devices: BlobDevices) -> DeviceOption:
    """Where a copy into replica `device_id`'s `blob` runs: the blob's own device (Iter counters of a
    GPU replica live on the CPU), else the replica's device."""
    return blob_devices.get(blob) or layout.option(device_id)


def broadcast_ops(layout: DeviceLayout, group: Group, blob_devices: BlobDevices,
                  use_nccl: bool = False) -> list[OperatorDef]:
    """Ops that copy the first device's copy of a blob (`group` has one per replica) onto the others.

    With `use_nccl` on CUDA replicas (and a blob that lives on the GPU): one in-place
    `NCCLBroadcast(root=0)` (root is a position, not a device id). Otherwise one `Copy` per other
    device, placed on the destination blob's device.
    """
    master_blob = group[layout.master]
    others = layout.devices[1:]
    if not others:
        return []
    if use_nccl and layout.device_type == CUDA and _on_gpu(master_blob, layout, blob_devices):
        blobs = [group[d] for d in layout.devices]
        return [make_op("NCCLBroadcast", blobs, blobs, layout.option(layout.master), root=0)]
    return [make_op("Copy", [master_blob], [group[d]], copy_device(layout, d, group[d], blob_devices))
            for d in others]


def _on_gpu(blob: str, layout: DeviceLayout, blob_devices: BlobDevices) -> bool:
    device = blob_devices.get(blob)
    return device is None or device.device_type == CUDA
