"""What every Parallelize pass shares: the replica layout, op construction and external inputs.

A `DeviceLayout` names the replicas (`gpu_3/...` or `cpu_1/...`) and their device options; the
*position* of a device in `layout.devices` (not its id) is what trees and "the first device" refer
to, so device ids need not start at 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import CPU, CUDA, DeviceOption, DeviceType, NetDef, OperatorDef
from graphpar.core.naming import CROSS_REPLICA_SUM_NAME, SCOPE_SEPARATOR, device_scope_name, device_scoped

# A blob's copies, one per replica: {device id: blob name}.
Group = Mapping[int, str]
# Where blobs live (graphpar.core.graph.blob_devices); a missing blob lives on its replica's device.
BlobDevices = Mapping[str, DeviceOption]

DPM_SUM_NAME = CROSS_REPLICA_SUM_NAME  # the name of the cross-replica Sum ops Parallelize adds


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


def declare_external_inputs(net: NetDef) -> list[str]:
    """Declare every blob an op of `net` reads before any op writes it as an external input (appended
    in first-read order after those already declared); returns the names added. One O(net) scan, so
    passes append ops freely and the pipeline declares inputs once, at the end."""
    declared = set(net.external_inputs)
    added = [blob for blob in dataflow(net).loads if blob not in declared]
    net.external_inputs.extend(added)
    return added


def copy_device(layout: DeviceLayout, device_id: int, blob: str, blob_devices: BlobDevices) -> DeviceOption:
    """Where a copy into replica `device_id`'s `blob` runs: the blob's own device (Iter counters of a
    GPU replica live on the CPU), else the replica's device."""
    return blob_devices.get(blob) or layout.option(device_id)
