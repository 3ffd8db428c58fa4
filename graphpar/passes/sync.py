"""Pass: keep per-replica state equal by broadcasting it from the first device.

Three users: the initial sync at the end of `param_init_net` (every blob the init net creates in a
replica scope: params, computed params, optimizer state), `AddBlobSync` (user blobs, at the end of
any net), and the checkpoint sync net that `FinalizeAfterCheckpoint` runs after a load.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from graphpar.core.ir import CPU, DeviceOption, NetDef, OperatorDef
from graphpar.core.naming import parse_device_scope, shard_name, stripBlobName
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout, declare_external_inputs, make_op
from graphpar.passes.finish import chain_collectives
from graphpar.passes.group_by_device import group_by_device
from graphpar.passes.reducers import DistributedReducer, Reducer
from graphpar.passes.state import ParallelState


def replica_init_outputs(init_net: NetDef, layout: DeviceLayout) -> list[str]:
    """Every blob the init net writes inside a replica scope, once each, in order of first write."""
    found = dict.fromkeys(b for op in init_net.ops for b in op.outputs if layout.replica_of(b) is not None)
    return list(found)


def compute_blobs_to_sync(init_net: NetDef, layout: DeviceLayout, params: Collection[str],
                          computed_params: Sequence[str], shared_model: bool = False,
                          ) -> tuple[list[str], list[str]]:
    """The blobs to broadcast after init and their unscoped names, both in a fixed order.

    Input: `init_net` after every builder ran; `params` and `computed_params` are the data-parallel
    replica blobs. Guarantees: `(blobs, names)` with blobs ordered by device position then first
    write, names by first write; every name has a copy created for the first device. A shared model
    (one set of params for all CPU replicas) syncs only its computed params.

    Raises:
        ParallelizeError: a param or computed param that the init net does not create (a model built
            with init_params=False cannot be trained), or a blob created for some device but not
            for the first one.
    """
    outputs = replica_init_outputs(init_net, layout)
    missing = sorted((set(map(str, params)) | set(map(str, computed_params))) - set(outputs))
    if missing:
        raise ParallelizeError(f"Some params are not instantiated in param_init_net: {missing}. Create "
                               f"params with model.create_param / brew helpers in a model with "
                               f"init_params=True")
    blobs = [str(b) for b in computed_params] if shared_model else outputs
    names = list(dict.fromkeys(stripBlobName(b) for b in blobs))
    present = set(blobs)
    absent = [n for n in names if layout.scoped(layout.master, n) not in present]
    if absent:
        raise ParallelizeError(f"blobs {absent} are created in param_init_net for some devices but not "
                               f"for the first device {layout.master}, so they cannot be synced from it")
    position: dict[int | None, int] = {d: i for i, d in enumerate(layout.devices)}
    order = {b: i for i, b in enumerate(blobs)}
    blobs = sorted(blobs, key=lambda b: (position.get(layout.replica_of(b), len(position)), order[b]))
    return blobs, names


def sync_blobs(net: NetDef, names: Iterable[str], reducer: Reducer) -> list[OperatorDef]:
    """Append, per unscoped name in order, the reducer's broadcast from the first device's blob.

    Input: the first device's copy exists when `net` reaches the end. Guarantees: afterwards every
    replica holds the first device's value (destinations are created if needed). Returns the ops added.
    """
    layout = reducer.layout
    ops = [op for name in names for op in reducer.broadcast(layout.group(name))]
    net.ops.extend(ops)
    return ops


def check_unprefixed(names: Iterable[str], layout: DeviceLayout) -> list[str]:
    """The names as plain strs, after checking none is inside a device scope of the layout's prefix.

    Names that merely start with the prefix ('cpu_time' in a CPU model) are plain names; Caffe2
    refused every name starting with the prefix.

    Raises:
        ParallelizeError: a name such as 'gpu_0/x' or 'gpu_9/x' (pass 'x': it names the blob on every
            device).
    """
    names = [str(n) for n in names]
    scoped = [n for n in names if (parse_device_scope(n) or ("",))[0] == layout.prefix]
    if scoped:
        raise ParallelizeError(f"blob sync needs unprefixed names, got {scoped}; pass "
                               f"{[stripBlobName(n) for n in scoped]}")
    return names


def checkpoint_sync_names(blobs: Iterable[str], known: Collection[str], layout: DeviceLayout) -> list[str]:
    """The unscoped names a checkpoint sync broadcasts for `blobs` (scoped or unscoped names).

    A name in a replica scope ('gpu_0/fc_w') or the unscoped name of a known replicated blob ('fc_w')
    is synced. Any other unscoped name is a global blob with a single copy (e.g.
    `optimizer_iteration`), which needs no broadcast on one host; Caffe2 raised ValueError on such names.

    Raises:
        ParallelizeError: a name in the scope of a device that is not a replica ('cpu_0/fc_w' for a
            model on devices 1 and 2, or a 'gpu_*' name for CPU replicas): typically a checkpoint
            saved from other devices, whose values would otherwise be silently left unused.
    """
    names, foreign = [], []
    for blob in map(str, blobs):
        if layout.replica_of(blob) is not None:
            names.append(stripBlobName(blob))
        elif parse_device_scope(blob) is not None:
            foreign.append(blob)
        elif blob in known:
            names.append(blob)
    if foreign:
        scopes = ", ".join(f"{layout.scope(d)}/" for d in layout.devices)
        raise ParallelizeError(f"blobs {foreign} are not in this model's replica scopes ({scopes}), so they "
                               f"cannot be broadcast to the replicas; was the checkpoint saved with other "
                               f"devices? Resume with the same first device ({layout.scope(layout.master)}/)")
    return list(dict.fromkeys(names))


def checkpoint_sync_net(name: str, names: Sequence[str], reducer: Reducer, counters: Sequence[str] = ()) -> NetDef:
    """A new net that broadcasts each name's first-device blob to every replica (sources are inputs),
    and, across shards, each unscoped `counters` blob from shard 0 (on one process they have one copy)."""
    net = NetDef(name)
    sync_blobs(net, names, reducer)
    if isinstance(reducer, DistributedReducer):
        net.ops.extend(make_op("Broadcast", [reducer.world(), c], [c], DeviceOption(CPU, 0), root=0) for c in counters)
    chain_collectives(net.ops)
    declare_external_inputs(net)
    return net


def compute_sync_blobs(state: ParallelState) -> None:
    """Find the blobs the initial sync broadcasts (`compute_blobs_to_sync`) and group them by device;
    sharded optimizer state is not synced (each replica fills its own part, `passes.shard_updates`)."""
    grouped, layout = state.grouped, state.layout
    computed = [str(b) for name in state.computed_param_names for b in grouped[name].values()]
    params = [str(b) for name in state.param_names for b in grouped[name].values()]
    blobs, names = compute_blobs_to_sync(state.model.param_init_net.Proto(), layout, params, computed,
                                         state.options.shared_model)
    if state.sharding is not None:
        parts = {shard_name(name) for name in state.sharding.state}
        blobs = [b for b in blobs if stripBlobName(b) not in parts]
        names = [n for n in names if n not in parts]
    grouped.update(group_by_device(blobs, layout))
    state.sync_names = names


def initial_sync(state: ParallelState) -> None:
    """Broadcast every sync blob from the first device at the end of `param_init_net`, so every
    replica starts identical."""
    sync_blobs(state.model.param_init_net.Proto(), state.sync_names, state.reducer)


def forward_only_sync_names(state: ParallelState) -> None:
    """A forward-only model syncs nothing, but remembers the names of its replicas' init outputs."""
    outputs = replica_init_outputs(state.model.param_init_net.Proto(), state.layout)
    state.sync_names = list(dict.fromkeys(stripBlobName(b) for b in outputs))
