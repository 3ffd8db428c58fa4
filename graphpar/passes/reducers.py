"""Reducers: how the per-device copies of a blob are summed and broadcast, chosen once by Parallelize.

A reducer turns "combine these copies" into operators. Every pass that moves data between replicas
(gradient all-reduce, gradient buckets, batch-norm statistics, computed params, the initial and
checkpoint syncs) asks the one reducer Parallelize built from its options, so a new way to reduce
(e.g. across hosts) is a new class here, not a flag threaded through the passes:

- `TreeReducer`: Caffe2's single-host reduction, a tree of `Sum` ops named "dpm" over device
  *positions* (4, 8 and 16 devices pairwise, doubling the stride each level; any other count one flat
  Sum onto position 0), then a `Copy` back to every other device. A peer whose memory the root cannot
  read (no P2P access) is first copied to the root (Caffe2 issues #633/#659).
- `NcclReducer`: one in-place `NCCLAllreduce` / `NCCLBroadcast` over every copy (CUDA replicas).
- `DistributedReducer`: across shards (processes, `rendezvous`): the local reducer's sum onto the
  first device, one cross-shard `Allreduce` of that copy, the local broadcast back; broadcasts go
  from shard 0's first device (`Broadcast`, then the local copies). Its collectives take turns on
  `max_concurrent_distributed_ops` communicators (blobs created by `CreateCommonWorld`), so that
  many may be in flight at once.

Cross-device ops name their inputs' devices in `input_device_ids`, so nothing parses device ids out of
blob names. Collectives are left unordered here: the `order_collectives` pass chains every collective
of a net in program order at the end of the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from graphpar.core.ir import CUDA, DeviceOption, OperatorDef
from graphpar.core.trees import tree_levels
from graphpar.passes.common import DPM_SUM_NAME, BlobDevices, DeviceLayout, Group, copy_device, make_op

PeerAccess = Callable[[int, int], bool]  # (root device id, peer device id) -> may root read peer's memory


class Reducer(Protocol):
    """Builds the ops that combine or copy one blob's per-replica copies."""

    layout: DeviceLayout
    num_shards: int  # processes whose copies it combines too (1: this process's replicas only)

    def allreduce(self, name: str, group: Sequence[str], to_all: bool = True) -> list[OperatorDef]:
        """Ops after which every copy in `group` (one per replica, in device order) holds their sum, or
        at least the first device's copy does with `to_all=False`. `name` (unscoped) names temporaries.
        Used for gradients, gradient buckets, batch-norm statistics and averaged computed params."""
        ...

    def broadcast(self, group: Group) -> list[OperatorDef]:
        """Ops after which every copy in `group` ({device id: blob}) holds the first device's value."""
        ...

    def allgather(self, name: str, group: Sequence[str], outputs: Sequence[str]) -> list[OperatorDef]:
        """Ops after which every `outputs[i]` (one per replica, in device order; only the first with a
        single output) holds the copies of `group` concatenated along axis 0 in device order. Used for
        sparse gradients (indices and values), whose rows differ per device; `name` names temporaries."""
        ...


class TreeReducer:
    """Sum trees onto the first device and copies back (CPU replicas, and CUDA without NCCL)."""

    num_shards = 1

    def __init__(self, layout: DeviceLayout, blob_devices: BlobDevices,
                 peer_access: PeerAccess | None = None) -> None:
        self.layout = layout
        self.blob_devices = blob_devices  # read when ops are built: Parallelize keeps it up to date
        self.peer_access = peer_access  # None: every device may read every other's memory

    def allreduce(self, name: str, group: Sequence[str], to_all: bool = True) -> list[OperatorDef]:
        layout, ops = self.layout, []
        for level in tree_levels(len(group)):
            for positions in level:
                root = layout.devices[positions[0]]
                inputs, ids = [group[positions[0]]], [root]
                for position in positions[1:]:
                    peer, blob = layout.devices[position], group[position]
                    if self.peer_access is not None and not self.peer_access(root, peer):
                        copy = layout.scoped(root, f"{name}_{layout.prefix}{peer}_copy")
                        ops.append(make_op("Copy", [blob], [copy], layout.option(root), input_device_ids=[peer]))
                        blob, peer = copy, root
                    inputs.append(blob)
                    ids.append(peer)
                ops.append(make_op("Sum", inputs, [inputs[0]], layout.option(root), name=DPM_SUM_NAME,
                                   input_device_ids=ids))
        if to_all:
            ops.extend(self.broadcast(dict(zip(layout.devices, group))))
        return ops

    def broadcast(self, group: Group) -> list[OperatorDef]:
        return _copies(self.layout, group, self.blob_devices)

    def allgather(self, name: str, group: Sequence[str], outputs: Sequence[str]) -> list[OperatorDef]:
        return _allgather(self.layout, name, group, outputs, self.blob_devices)


class NcclReducer:
    """In-place NCCL collectives over every copy (CUDA replicas); host-side blobs are copied."""

    num_shards = 1

    def __init__(self, layout: DeviceLayout, blob_devices: BlobDevices) -> None:
        self.layout = layout
        self.blob_devices = blob_devices

    def allreduce(self, name: str, group: Sequence[str], to_all: bool = True) -> list[OperatorDef]:
        layout = self.layout
        return [make_op("NCCLAllreduce", group, group, layout.option(layout.master),
                        input_device_ids=list(layout.devices))]

    def broadcast(self, group: Group) -> list[OperatorDef]:
        layout = self.layout
        if len(layout.devices) < 2:
            return []
        device = self.blob_devices.get(group[layout.master])
        if device is not None and device.device_type != CUDA:  # e.g. a GPU replica's CPU counter
            return _copies(layout, group, self.blob_devices)
        blobs = [group[d] for d in layout.devices]
        return [make_op("NCCLBroadcast", blobs, blobs, layout.option(layout.master), root=0,
                        input_device_ids=list(layout.devices))]

    def allgather(self, name: str, group: Sequence[str], outputs: Sequence[str]) -> list[OperatorDef]:
        """Copies and a Concat, as the tree reducer (the copies' shapes differ, which NCCL collectives
        on whole blobs cannot take)."""
        return _allgather(self.layout, name, group, outputs, self.blob_devices)


WORLD_PREFIX = "graphpar_cw_"  # the communicator blobs: graphpar_cw_0, graphpar_cw_1, ...


class DistributedReducer:
    """Local reduction onto the first device, one collective across shards, local broadcast back."""

    def __init__(self, local: Reducer, num_shards: int, max_concurrent: int,
                 blob_devices: BlobDevices, order: str = "ring") -> None:
        self.layout = local.layout
        self.order = order  # the cross-shard Allreduce's order ("ring" or "tree")
        self.local = local
        self.num_shards = num_shards
        self.blob_devices = blob_devices
        self.worlds = [f"{WORLD_PREFIX}{k}" for k in range(max_concurrent)]
        self.issued = 0  # collectives built so far: the next one takes communicator issued % len(worlds)

    def world(self) -> str:
        """The communicator blob for the next collective (round robin, in build order on every shard)."""
        world = self.worlds[self.issued % len(self.worlds)]
        self.issued += 1
        return world

    def allreduce(self, name: str, group: Sequence[str], to_all: bool = True) -> list[OperatorDef]:
        layout, root = self.layout, group[0]
        ops = self.local.allreduce(name, group, to_all=False) if len(group) > 1 else []
        ops.append(make_op("Allreduce", [self.world(), root], [root], self._device(root), order=self.order))
        if to_all and len(group) > 1:
            ops.extend(self.local.broadcast(dict(zip(layout.devices, group))))
        return ops

    def broadcast(self, group: Group) -> list[OperatorDef]:
        source = group[self.layout.master]
        ops = [make_op("Broadcast", [self.world(), source], [source], self._device(source), root=0)]
        if len(group) > 1:
            ops.extend(self.local.broadcast(group))
        return ops

    def allgather(self, name: str, group: Sequence[str], outputs: Sequence[str]) -> list[OperatorDef]:
        """The local concatenation on the first device, then one cross-shard `Allgather` of it (shard
        order, so device order over all shards), then copies to the other outputs."""
        first = outputs[0]
        ops = self.local.allgather(name, group, outputs[:1])
        ops.append(make_op("Allgather", [self.world(), first], [first], self._device(first)))
        if len(outputs) > 1:
            ops.extend(self.local.broadcast(dict(zip(self.layout.devices, outputs))))
        return ops

    def _device(self, blob: str) -> DeviceOption:
        return self.blob_devices.get(blob) or self.layout.option(self.layout.master)


def make_reducer(layout: DeviceLayout, blob_devices: BlobDevices, use_nccl: bool = False,
                 peer_access: PeerAccess | None = None, num_shards: int = 1,
                 max_concurrent: int = 1, order: str = "ring") -> Reducer:
    """The reducer for Parallelize's options: NCCL for CUDA replicas with `use_nccl`, else Sum trees;
    wrapped in a `DistributedReducer` over `max_concurrent` communicators for several shards."""
    local: Reducer
    if use_nccl and layout.device_type == CUDA:
        local = NcclReducer(layout, blob_devices)
    else:
        local = TreeReducer(layout, blob_devices, peer_access)
    if num_shards > 1:
        return DistributedReducer(local, num_shards, max_concurrent, blob_devices, order)
    return local


def copies(reducer: Reducer) -> int:
    """How many copies of a blob the reducer combines: replicas times shards."""
    return len(reducer.layout.devices) * reducer.num_shards


def _allgather(layout: DeviceLayout, name: str, group: Sequence[str], outputs: Sequence[str],
               blob_devices: Mapping[str, DeviceOption]) -> list[OperatorDef]:
    """Copy every other device's blob to the first device, Concat them there (axis 0, device order)
    into outputs[0], and copy the result to the other outputs (Caffe2's sparse GPU all-reduce)."""
    master = layout.master
    ops, parts = [], [group[0]]
    for peer, blob in zip(layout.devices[1:], group[1:]):
        copy = layout.scoped(master, f"{name}_{layout.prefix}{peer}_copy")
        ops.append(make_op("Copy", [blob], [copy], layout.option(master), input_device_ids=[peer]))
        parts.append(copy)
    ops.append(make_op("Concat", parts, [outputs[0], f"{outputs[0]}_split_info"], layout.option(master), axis=0))
    if len(outputs) > 1:
        ops.extend(_copies(layout, dict(zip(layout.devices, outputs)), blob_devices))
    return ops


def _copies(layout: DeviceLayout, group: Group, blob_devices: Mapping[str, DeviceOption]) -> list[OperatorDef]:
    """One `Copy` from the first device's copy to each other copy, placed on the destination's device."""
    source = group[layout.master]
    source_device = blob_devices.get(source) or layout.option(layout.master)
    return [make_op("Copy", [source], [group[d]], copy_device(layout, d, group[d], blob_devices),
                    input_device_ids=[source_device.device_id])
            for d in layout.devices[1:]]
