"""Pass: all-reduce (sum) every gradient across the replicas of one host.

With NCCL on CUDA: one in-place `NCCLAllreduce` per gradient, each chained to the previous collective
of the net by a control input (`common.chain_collectives`) so every device issues the collectives in
one fixed order (concurrent NCCL launches can deadlock). Otherwise a tree of `Sum` ops named "dpm" over device *positions*, the result on the
first device, then a `Copy` back to every other device. A peer without P2P access to the root of a
Sum is first copied to the root (Caffe2 issues #633/#659: a cross-GPU Sum without it read invalid
memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from graphpar.core.ir import CUDA, GradientSlice, NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.common import (
    DPM_SUM_NAME,
    BlobDevices,
    DeviceLayout,
    append_ops,
    broadcast_ops,
    chain_collectives,
    make_op,
)

PeerAccess = Callable[[int, int], bool]  # (root device id, peer device id) -> may root read peer's memory


def tree_levels(count: int) -> list[list[tuple[int, ...]]]:
    """The Sum tree over `count` device positions: levels of position tuples, root first in each.

    4, 8 and 16 devices reduce pairwise, doubling the stride each level (16: (0,1)…(14,15), then
    (0,2),(4,6),(8,10),(12,14), then (0,4),(8,12), then (0,8)), as Caffe2 did; any other count is
    one flat Sum of every position onto position 0. The root of the last level is position 0.
    """
    if count not in (4, 8, 16):
        return [[tuple(range(count))]]
    levels, stride = [], 1
    while stride < count:
        levels.append([(i, i + stride) for i in range(0, count, 2 * stride)])
        stride *= 2
    return levels


def allreduce_gradients(net: NetDef, names: Iterable[str], grouped: Mapping[str, Mapping[int, str]],
                        layout: DeviceLayout, blob_devices: BlobDevices, use_nccl: bool = False,
                        peer_access: PeerAccess | None = None, broadcast: bool = True) -> list[OperatorDef]:
    """Append the ops that sum each gradient in `names` (in that order) over every replica.

    Input: `net` computes every gradient; `grouped[name]` maps each device id to its copy (a group
    with a single copy, e.g. a gradient that is not data parallel, is skipped). Parallelize passes the
    gradients in reverse creation order, so the last layer's gradients, ready first, go first.
    Guarantees: after the ops, every copy (only the first device's with `broadcast=False`, used by
    shared CPU models) holds the sum. `peer_access` None means full access (CPU, simulated CUDA).
    Returns the ops added, all in `net`.

    Raises:
        ParallelizeError: a gradient misses a copy on some device.
        NotImplementedError: a sparse (GradientSlice) gradient.
    """
    if len(layout.devices) < 2:
        return []
    ops: list[OperatorDef] = []
    for name in names:
        group = checked_group(name, grouped[name], layout)
        if group is not None:
            ops.extend(allreduce_copies(name, group, layout, blob_devices, use_nccl, peer_access, broadcast))
    chain_collectives(net.ops, ops)
    return append_ops(net, ops)


def allreduce_copies(name: str, group: list[str], layout: DeviceLayout, blob_devices: BlobDevices,
                     use_nccl: bool = False, peer_access: PeerAccess | None = None,
                     broadcast: bool = True) -> list[OperatorDef]:
    """The ops that sum `group` (one copy of unscoped `name` per device, in device order) into every copy.

    With `use_nccl` on CUDA one in-place `NCCLAllreduce` (not yet chained: the caller chains the
    collectives it appends); otherwise the Sum tree onto the first device, then (`broadcast`) a Copy
    back to every other device. Used for gradients, gradient buckets and averaged computed params.
    """
    if use_nccl and layout.device_type == CUDA:
        return [make_op("NCCLAllreduce", group, group, layout.option(layout.master))]
    ops = _sum_tree(name, group, layout, peer_access)
    if broadcast:
        ops.extend(broadcast_ops(layout, dict(zip(layout.devices, group)), blob_devices))
    return ops


def checked_group(name: str, copies: Mapping[int, str], layout: DeviceLayout) -> list[str] | None:
    """The copies of gradient `name` in device order, or None for a single copy (nothing to reduce).

    Raises:
        ParallelizeError: a copy is missing on some device.
        NotImplementedError: a sparse (GradientSlice) gradient.
    """
    if len(copies) == 1:
        return None
    missing = [d for d in layout.devices if d not in copies]
    if missing:
        raise ParallelizeError(f"gradient {name!r} has no copy on device(s) {missing}; every replica must "
                               f"compute it (each device should have a copy)")
    if any(isinstance(copies[d], GradientSlice) for d in layout.devices):
        raise NotImplementedError(f"gradient {name!r} is sparse (GradientSlice); all-reducing sparse "
                                  f"gradients is not supported yet")
    return [str(copies[d]) for d in layout.devices]


def _sum_tree(name: str, group: list[str], layout: DeviceLayout,
              peer_access: PeerAccess | None) -> list[OperatorDef]:
    ops = []
    for level in tree_levels(len(group)):
        for positions in level:
            root = layout.devices[positions[0]]
            inputs = [group[positions[0]]]
            for position in positions[1:]:
                peer = layout.devices[position]
                blob = group[position]
                if peer_access is not None and not peer_access(root, peer):
                    copy = layout.scoped(root, f"{name}_{layout.prefix}{peer}_copy")
                    ops.append(make_op("Copy", [blob], [copy], layout.option(root)))
                    blob = copy
                inputs.append(blob)
            ops.append(make_op("Sum", inputs, [inputs[0]], layout.option(root), name=DPM_SUM_NAME))
    return ops
