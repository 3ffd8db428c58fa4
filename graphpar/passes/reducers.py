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

Sharded state (`shard_optimizer_state`, `shard_gradients`; see `passes.shard_updates`) adds three
methods over *parts*: a blob flattened and cut into one piece per replica of every shard, in global
replica order (shard s's device at position i owns part `s * len(devices) + i`). `reduce_scatter`
leaves each replica its part of a sum: the tree reducer adds each part with the Sum tree of its
all-reduce, on the part's owner, so every element is added in the same order as the all-reduce adds
it (the same bits); NCCL all-reduces and keeps each device's part; across shards the local sum goes
through one `ReduceScatter`. `gather_shards` concatenates every replica's part back into a whole blob
(copies and a `Concat` on the first device, across shards one `Allgather`) and `scatter_shards` cuts
the first device's blob into the parts (across shards shard 0's, broadcast first).

Cross-device ops name their inputs' devices in `input_device_ids`, so nothing parses device ids out of
blob names. Collectives are left unordered here: the `order_collectives` pass chains every collective
of a net in program order at the end of the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from graphpar.core.ir import CUDA, DeviceOption, OperatorDef
from graphpar.core.naming import flat_name, gathered_name, old_shape_name, part_name, split_info_name
from graphpar.core.trees import tree_levels
from graphpar.passes.common import DPM_SUM_NAME, BlobDevices, DeviceLayout, Group, copy_device, make_op

PeerAccess = Callable[[int, int], bool]  # (root device id, peer device id) -> may root read peer's memory


class Reducer(Protocol):
    """Builds the ops that combine or copy one blob's per-replica copies."""

    layout: DeviceLayout
    num_shards: int  # processes whose copies it combines too (1: this process's replicas only)
    shard_id: int  # this process's shard (0 on one process)

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

    def reduce_scatter(self, name: str, group: Sequence[str], shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        """Ops after which each `shards[i]` (1-D, on device i) holds this replica's part of the sum of the
        copies in `group`: each copy flattened and cut into `sizes` (one per replica of every shard, in
        global order). Used for gradients (`shard_gradients`)."""
        ...

    def gather_shards(self, name: str, shards: Sequence[str], outputs: Sequence[str], sizes: Sequence[int],
                      shape: Sequence[int]) -> list[OperatorDef]:
        """Ops after which every `outputs[i]` (one per replica, or only the first device's) holds every
        replica's part (`shards` here, the other shards' replicas' there) concatenated in global order
        and reshaped to `shape`. Used for params after a sharded update, and for checkpoints."""
        ...

    def scatter_shards(self, name: str, source: str, shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        """Ops after which each `shards[i]` holds replica i's part of the first device's `source` (shard
        0's, across shards). Used to resume sharded state from a checkpoint."""
        ...


class _InProcessShards:
    """Sharded state between the replicas of this process: parts copied together, or cut from a whole."""

    layout: DeviceLayout
    blob_devices: BlobDevices

    def gather_shards(self, name: str, shards: Sequence[str], outputs: Sequence[str], sizes: Sequence[int],
                      shape: Sequence[int]) -> list[OperatorDef]:
        return _gather(self.layout, name, shards, outputs, shape, self.blob_devices)

    def scatter_shards(self, name: str, source: str, shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        return _scatter(self.layout, source, shards, sizes)


class TreeReducer(_InProcessShards):
    """Sum trees onto the first device and copies back (CPU replicas, and CUDA without NCCL)."""

    num_shards, shard_id = 1, 0

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

    def reduce_scatter(self, name: str, group: Sequence[str], shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        """Each copy cut into parts (`FlattenToVec`, `Split`), then per part the all-reduce's Sum tree over
        device positions, every Sum on the part's owner: the same additions in the same order."""
        ops, parts = _parts(self.layout, group, sizes)
        for k, owner in enumerate(self.layout.devices):
            ops.extend(self._tree_onto(name, [blobs[k] for blobs in parts], shards[k], owner))
        return ops

    def _tree_onto(self, name: str, blobs: Sequence[str], out: str, owner: int) -> list[OperatorDef]:
        """The Sum tree of `allreduce` over `blobs` (one per device position), run on device `owner`,
        its root's sum in `out` and the other nodes' in temporaries there."""
        layout, ops = self.layout, []
        current, where = list(blobs), list(layout.devices)
        levels = tree_levels(len(blobs))
        for depth, level in enumerate(levels):
            for positions in level:
                inputs, ids = [], []
                for position in positions:
                    blob, device = current[position], where[position]
                    if device != owner and self.peer_access is not None and not self.peer_access(owner, device):
                        copy = layout.scoped(owner, f"{name}_shard_{layout.prefix}{device}_copy")
                        ops.append(make_op("Copy", [blob], [copy], layout.option(owner), input_device_ids=[device]))
                        blob, device = copy, owner
                    inputs.append(blob)
                    ids.append(device)
                target = out if depth == len(levels) - 1 else layout.scoped(owner, f"{name}_shard_sum_{positions[0]}")
                ops.append(make_op("Sum", inputs, [target], layout.option(owner), name=DPM_SUM_NAME,
                                   input_device_ids=ids))
                current[positions[0]], where[positions[0]] = target, owner
        return ops


class NcclReducer(_InProcessShards):
    """In-place NCCL collectives over every copy (CUDA replicas); host-side blobs are copied."""

    num_shards, shard_id = 1, 0

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

    def reduce_scatter(self, name: str, group: Sequence[str], shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        """One `NCCLAllreduce`, then each device keeps its part (`FlattenToVec`, `Slice`): the sums of
        the unsharded all-reduce, moving twice a reduce-scatter's bytes."""
        ops, start = self.allreduce(name, group), 0
        for k, device in enumerate(self.layout.devices):
            option, flat = self.layout.option(device), flat_name(group[k])
            ops += [make_op("FlattenToVec", [group[k]], [flat], option),
                    make_op("Slice", [flat], [shards[k]], option, starts=[start], ends=[start + sizes[k]])]
            start += sizes[k]
        return ops


WORLD_PREFIX = "graphpar_cw_"  # the communicator blobs: graphpar_cw_0, graphpar_cw_1, ...


class DistributedReducer:
    """Local reduction onto the first device, one collective across shards, local broadcast back."""

    def __init__(self, local: Reducer, num_shards: int, max_concurrent: int,
                 blob_devices: BlobDevices, order: str = "ring", shard_id: int = 0) -> None:
        self.layout = local.layout
        self.order = order  # the cross-shard Allreduce's order ("ring" or "tree")
        self.local = local
        self.num_shards = num_shards
        self.shard_id = shard_id
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

    def reduce_scatter(self, name: str, group: Sequence[str], shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        """The local sum onto the first device (the all-reduce's tree), then one cross-shard
        `ReduceScatter` of it into this shard's parts (in `order`), cut and copied to their devices."""
        layout, root, count = self.layout, group[0], len(group)
        ops = self.local.allreduce(name, group, to_all=False) if count > 1 else []
        flat, device = flat_name(root), self._device(root)
        ops.append(make_op("FlattenToVec", [root], [flat], device))
        chunks = [sum(sizes[s * count:(s + 1) * count]) for s in range(self.num_shards)]
        mine = list(sizes[self.shard_id * count:(self.shard_id + 1) * count])
        chunk = shards[0] if count == 1 else layout.scoped(layout.master, f"{name}_chunk")
        ops.append(make_op("ReduceScatter", [self.world(), flat], [chunk], device, split=chunks, order=self.order))
        if count > 1:
            ops.extend(_cut(layout, chunk, shards, mine, device))
        return ops

    def gather_shards(self, name: str, shards: Sequence[str], outputs: Sequence[str], sizes: Sequence[int],
                      shape: Sequence[int]) -> list[OperatorDef]:
        """The local parts concatenated on the first device, one cross-shard `Allgather` of them (shard
        order), reshaped, and copied to the other outputs."""
        layout, first = self.layout, outputs[0]
        chunk, ops = shards[0], []
        if len(shards) > 1:
            chunk = layout.scoped(layout.master, f"{name}_chunk")
            ops = _concat(layout, name, shards, chunk)
        flat, device = gathered_name(first), self._device(first)
        ops.append(make_op("Allgather", [self.world(), chunk], [flat], device))
        ops.append(make_op("Reshape", [flat], [first, old_shape_name(first)], device, shape=list(shape)))
        if len(outputs) > 1:
            ops.extend(self.local.broadcast(dict(zip(layout.devices, outputs))))
        return ops

    def scatter_shards(self, name: str, source: str, shards: Sequence[str],
                       sizes: Sequence[int]) -> list[OperatorDef]:
        """Shard 0's `source` broadcast (`Broadcast`), then this shard's parts cut from it."""
        count, device = len(shards), self._device(source)
        start = sum(sizes[:self.shard_id * count])
        mine = list(sizes[self.shard_id * count:(self.shard_id + 1) * count])
        flat, chunk = flat_name(source), self.layout.scoped(self.layout.master, f"{name}_chunk")
        return [make_op("Broadcast", [self.world(), source], [source], device, root=0),
                make_op("FlattenToVec", [source], [flat], device),
                make_op("Slice", [flat], [chunk], device, starts=[start], ends=[start + sum(mine)]),
                *_cut(self.layout, chunk, shards, mine, device)]

    def _device(self, blob: str) -> DeviceOption:
        return self.blob_devices.get(blob) or self.layout.option(self.layout.master)


def make_reducer(layout: DeviceLayout, blob_devices: BlobDevices, use_nccl: bool = False,
                 peer_access: PeerAccess | None = None, num_shards: int = 1,
                 max_concurrent: int = 1, order: str = "ring", shard_id: int = 0) -> Reducer:
    """The reducer for Parallelize's options: NCCL for CUDA replicas with `use_nccl`, else Sum trees;
    wrapped in a `DistributedReducer` over `max_concurrent` communicators for several shards (this
    process being `shard_id`)."""
    local: Reducer
    if use_nccl and layout.device_type == CUDA:
        local = NcclReducer(layout, blob_devices)
    else:
        local = TreeReducer(layout, blob_devices, peer_access)
    if num_shards > 1:
        return DistributedReducer(local, num_shards, max_concurrent, blob_devices, order, shard_id)
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


def _parts(layout: DeviceLayout, group: Sequence[str], sizes: Sequence[int]) -> tuple[list[OperatorDef], list[list[str]]]:
    """Each device's copy flattened and cut into `sizes` on its device: (the ops, per position its parts)."""
    ops, parts = [], []
    for device, blob in zip(layout.devices, group):
        option, flat = layout.option(device), flat_name(blob)
        names = [part_name(blob, k) for k in range(len(sizes))]
        ops += [make_op("FlattenToVec", [blob], [flat], option),
                make_op("Split", [flat], names, option, axis=0, split=list(sizes))]
        parts.append(names)
    return ops, parts


def _cut(layout: DeviceLayout, source: str, shards: Sequence[str], sizes: Sequence[int],
         device: DeviceOption) -> list[OperatorDef]:
    """1-D `source` (on the first device) cut into `sizes`: the first part into `shards[0]`, each other
    copied into its device's shard."""
    parts = [shards[0], *[part_name(source, k) for k in range(1, len(shards))]]
    ops = [make_op("Split", [source], parts, device, axis=0, split=list(sizes))]
    ops += [make_op("Copy", [part], [shard], layout.option(d), input_device_ids=[device.device_id])
            for d, part, shard in zip(layout.devices[1:], parts[1:], shards[1:])]
    return ops


def _scatter(layout: DeviceLayout, source: str, shards: Sequence[str], sizes: Sequence[int]) -> list[OperatorDef]:
    """The first device's `source` flattened and cut into every device's part (one process)."""
    device, flat = layout.option(layout.master), flat_name(source)
    return [make_op("FlattenToVec", [source], [flat], device), *_cut(layout, flat, shards, sizes, device)]


def _concat(layout: DeviceLayout, name: str, shards: Sequence[str], out: str) -> list[OperatorDef]:
    """Every device's part copied to the first device and concatenated there (device order) into `out`."""
    master = layout.master
    ops, parts = [], [shards[0]]
    for peer, blob in zip(layout.devices[1:], shards[1:]):
        copy = layout.scoped(master, f"{name}_{layout.prefix}{peer}_copy")
        ops.append(make_op("Copy", [blob], [copy], layout.option(master), input_device_ids=[peer]))
        parts.append(copy)
    ops.append(make_op("Concat", parts, [out, split_info_name(out)], layout.option(master), axis=0))
    return ops


def _gather(layout: DeviceLayout, name: str, shards: Sequence[str], outputs: Sequence[str], shape: Sequence[int],
            blob_devices: Mapping[str, DeviceOption]) -> list[OperatorDef]:
    """Every part concatenated on the first device, reshaped into `outputs[0]`, copied to the others."""
    first, option = outputs[0], layout.option(layout.master)
    flat = gathered_name(first)
    ops = _concat(layout, name, shards, flat)
    ops.append(make_op("Reshape", [flat], [first, old_shape_name(first)], option, shape=list(shape)))
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
