"""Pass: interleave the replicas' operators, "like combining decks of cards" (Caffe2's `_InterleaveOps`).

Parallelize records replica 0's ops, then replica 1's, and so on. Inter-device batch norm needs every
replica's j-th op side by side, so that the cross-device sums of one batch-norm layer sit between
that layer's ops on every device; the executors then also move all replicas along the critical path
together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.state import ParallelState


def interleave_ops(netdef: NetDef, devices: Sequence[int],
                   replica_of: Callable[[str], int | None] | None = None) -> NetDef:
    """Reorder `netdef.ops` in place to op 0 of every device, then op 1 of every device, and so on.

    Input invariant: every op belongs to one replica: with `replica_of` (blob name -> device id or
    None, e.g. `DeviceLayout.replica_of`), that of the first replica blob it writes, else reads;
    otherwise, or for an op without replica blobs, the position of its device option's `device_id`
    in `devices` (ids need not be 0..N-1; an op without an option takes the net's, else CPU 0). The
    blobs decide first because a GPU replica's host-side ops (a copy to the CPU, a CPU counter) run
    on CPU device 0 whatever the replica. No op reads what another replica writes; every replica
    records the same number of ops with the same types in the same order. Guarantees:
    `netdef.ops[j * N + p]` is the j-th op of the device at position p, each replica's ops keep their
    relative order (so its program is unchanged), and no op is added or removed. Returns `netdef`.

    Raises:
        ParallelizeError: an op runs on a device not in `devices`, or the replicas differ (naming the
            first op index where they do, its type on each device, and each device's op count).
            The net is unchanged then.
    """
    position = {device: index for index, device in enumerate(devices)}
    if len(position) != len(devices) or not devices:
        raise ParallelizeError(f"interleave_ops: devices must be distinct and non-empty, got {list(devices)}")
    decks: list[list[OperatorDef]] = [[] for _ in devices]
    for index, op in enumerate(netdef.ops):
        device = _replica(op, replica_of) if replica_of is not None else None
        if device is None:
            device = netdef.op_device(op).device_id
        if device not in position:
            raise ParallelizeError(
                f"interleave_ops: net {netdef.name!r} op #{index} {op.type} runs on device {device}, which "
                f"is not one of the replicas {list(devices)}; every op must belong to one replica")
        decks[position[device]].append(op)
    _check_same_programs(netdef.name, devices, decks)
    netdef.ops = [op for ops in zip(*decks) for op in ops]
    return netdef


def _replica(op: OperatorDef, replica_of: Callable[[str], int | None]) -> int | None:
    """The replica of the first replica blob `op` writes, else reads, else None."""
    for blob in (*op.outputs, *op.inputs):
        replica = replica_of(blob)
        if replica is not None:
            return replica
    return None


def _check_same_programs(net_name: str, devices: Sequence[int], decks: list[list[OperatorDef]]) -> None:
    """Raise on the first op index where the replicas' op types (or op counts) differ."""
    counts = [len(deck) for deck in decks]
    for j in range(max(counts)):
        types = [deck[j].type if j < len(deck) else "<no op>" for deck in decks]
        if len(set(types)) > 1:
            per_device = ", ".join(f"device {d}: {t}" for d, t in zip(devices, types))
            per_count = ", ".join(f"device {d}: {c}" for d, c in zip(devices, counts))
            raise ParallelizeError(
                f"interleave_ops: net {net_name!r}: the replicas differ at op index {j} ({per_device}); op "
                f"counts ({per_count}). Interleaving (combine_spatial_bn) needs every device to record the "
                f"same ops in the same order: build each replica identically")


def interleave(state: ParallelState) -> None:
    """`interleave_ops` on the train net, replicas told apart by their name scopes (`combine_spatial_bn`)."""
    layout = state.layout
    interleave_ops(state.model.net.Proto(), layout.devices, layout.replica_of)
