"""Pass: create the communicators the cross-shard collectives use, and the pre-training barrier.

The `DistributedReducer` (`passes.reducers`) makes every collective read a communicator blob
(`graphpar_cw_<k>`). This pass creates the ones used, with `CreateCommonWorld` ops in
`param_init_net` right before its first collective (so the fills before keep their op indices, and
with them their random streams), on the rendezvous' store. The first one also checks that every
shard built the same model (`model_signature`), so a shard with other params, another device count
or another collective order fails at `RunInitNet` on every shard instead of deadlocking. A barrier
net (`barrier_net_timeout_sec`) joins the init nets: `RunInitNet` returns on no shard before every
shard has initialised.
"""

from __future__ import annotations

from graphpar.core.ir import CPU, DeviceOption, NetDef, OperatorDef
from graphpar.core.naming import stripBlobName, unsharded_name
from graphpar.core.net import Net
from graphpar.core.schema import Trait, has_trait
from graphpar.passes.common import make_op
from graphpar.passes.reducers import WORLD_PREFIX, DistributedReducer
from graphpar.passes.state import ParallelState
from graphpar.platform import distributed
from graphpar.platform.distributed import Rendezvous

BARRIER_WORLD = "graphpar_barrier_cw"  # RunInitNet's pre-training barrier
SYNC_WORLD = "graphpar_sync_cw"  # Synchronize's barrier


def model_signature(state: ParallelState) -> str:
    """What every shard must agree on: device count, params and their shapes, the cross-shard
    collectives of the init and train nets in order (but those on a group of shards' communicator),
    and the first replica's learning-rate and update ops with their arguments (lr, policy, momentum,
    ...: shards with other optimizer settings would train apart). Unscoped names, so device ids may
    differ; sharded optimizer state by its whole shape (each shard fills parts of its own sizes)."""
    layout = state.layout
    lines = [f"{len(layout.devices)} {layout.prefix} devices"]
    for op in state.model.param_init_net.Proto().ops:
        outputs = [stripBlobName(b) for b in op.outputs if layout.replica_of(b) == layout.master]
        if outputs:
            lines.append(f"init {op.type} {outputs} {_whole_shape(state, outputs[0], op.args.get('shape', ''))}")
    for label, net in (("init", state.model.param_init_net.Proto()), ("train", state.model.net.Proto())):
        lines.extend(f"{label} {op.type} {op.inputs[0]} {[stripBlobName(b) for b in op.inputs[1:]]}"
                     for op in net.ops if has_trait(op, Trait.DISTRIBUTED)
                     and op.inputs[0] not in state.group_worlds)  # a group's: the same within the group
    # types and arguments, not names: an optimizer's blob names count the optimizers a process built
    # num_batches: how many replicas batch norm combines, which differs between groups of shards
    lines.extend(f"update {op.type} {sorted((k, v) for k, v in op.args.items() if k != 'num_batches')}"
                 for op in state.model.net.Proto().ops if _first_replica_update(state, op))
    return "\n".join(lines)


def _whole_shape(state: ParallelState, blob: str, shape: object) -> object:
    """`shape`, or the whole shape of the sharded state `blob` is a part of (unscoped names)."""
    whole = unsharded_name(blob)
    if state.sharding is None or whole not in state.sharding.state:
        return shape
    return list(state.sharding.shapes[state.sharding.state[whole]])


def _first_replica_update(state: ParallelState, op: OperatorDef) -> bool:
    """A learning-rate or update op (or any op writing a param) of the first replica or outside replicas."""
    layout, params = state.layout, set(state.param_names)
    if has_trait(op, Trait.DISTRIBUTED) or any(layout.replica_of(b) not in (None, layout.master) for b in op.outputs):
        return False
    return (has_trait(op, Trait.LEARNING_RATE) or has_trait(op, Trait.INPLACE_UPDATE)
            or any(layout.replica_of(b) == layout.master and stripBlobName(b) in params for b in op.outputs))


def create_world_op(rendezvous: Rendezvous, name: str, timeout_sec: float, store: tuple[list[str], int],
                    signature: str = "", group: tuple[int, ...] | None = None) -> OperatorDef:
    """A `CreateCommonWorld` writing blob `name` on `store` (`store_of(rendezvous)`): over every shard,
    or over the shards of `group` (this shard among them), met under a name of the group's own, so
    that the groups of one model (the same blob on every shard) do not meet each other."""
    inputs, handle = store
    size, rank, key = rendezvous.num_shards, rendezvous.shard_id, name
    if group is not None:
        size, rank, key = len(group), group.index(rendezvous.shard_id), f"{name}/{'-'.join(map(str, group))}"
    op = make_op("CreateCommonWorld", inputs, [name], DeviceOption(CPU, 0), name, size=size, rank=rank,
                 engine=rendezvous.engine, timeout_ms=int(timeout_sec * 1000), store=handle, signature=signature,
                 transport=rendezvous.transport, interface=rendezvous.interface)
    if group is not None:
        op.args["name"] = key  # the op's argument (make_op's `name` is the op's own name)
    return op


def store_of(rendezvous: Rendezvous) -> tuple[list[str], int]:
    """CreateCommonWorld's inputs and `store` argument for the kv_handler: a blob name is input 0; a
    Store is registered in this process (`graphpar.distributed`); None means the default group."""
    kv = rendezvous.kv_handler
    if isinstance(kv, str):
        return [kv], distributed.DEFAULT_STORE
    if kv is None:
        return [], distributed.DEFAULT_STORE
    return [], distributed.register_store(kv)


def create_common_worlds(state: ParallelState) -> None:
    """Create the communicators the collectives of every model net read (BMUF's global nets included),
    before the first collective of `param_init_net`; keep only those for later collectives
    (AddBlobSync, checkpoints); add the barrier net to the init nets."""
    reducer, rendezvous, options = state.reducer, state.options.rendezvous, state.options
    assert isinstance(reducer, DistributedReducer) and rendezvous is not None
    listed = [entry[0] if isinstance(entry, tuple) else entry for entry in (*state.init_nets, *state.nets)]
    nets = [*state.netdefs(), *(net.Proto() for net in listed)]  # BMUF's global nets too
    used = {op.inputs[0] for net in nets for op in net.ops if has_trait(op, Trait.DISTRIBUTED)} - set(state.group_worlds)
    reducer.worlds = [w for w in reducer.worlds if w in used] or reducer.worlds[:1]
    worlds = sorted(used | set(reducer.worlds), key=lambda w: int(w[len(WORLD_PREFIX):]))
    signature, store = model_signature(state), store_of(rendezvous)
    creates = [create_world_op(rendezvous, world, rendezvous.timeout_sec, store, signature if k == 0 else "")
               for k, world in enumerate(worlds)]
    creates += [create_world_op(rendezvous, world, rendezvous.timeout_sec, store, group=group)
                for world, group in state.group_worlds.items()]
    init = state.model.param_init_net.Proto()
    first = next((i for i, op in enumerate(init.ops) if has_trait(op, Trait.DISTRIBUTED)), len(init.ops))
    init.ops[first:first] = creates
    state.init_nets.append(Net(barrier_net("pre_training_barrier", rendezvous, options.barrier_net_timeout_sec,
                                           store)))


def barrier_net(name: str, rendezvous: Rendezvous, timeout_sec: float, store: tuple[list[str], int],
                world: str = BARRIER_WORLD) -> NetDef:
    """A net that creates communicator `world` with `timeout_sec` and waits at a barrier on it."""
    return NetDef(name, [create_world_op(rendezvous, world, timeout_sec, store),
                         make_op("Barrier", [world], [], DeviceOption(CPU, 0))], list(store[0]))
