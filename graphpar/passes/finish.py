"""Passes that set up and finish the nets: executor settings, collective order, inputs, net lists."""

from __future__ import annotations

from collections.abc import Sequence

from graphpar.core.ir import OperatorDef
from graphpar.core.naming import (
    COMPILE_BACKEND_ARG,
    COMPILE_MODE_ARG,
    DYNAMIC_MEMORY_ARG,
    FIRST_ITER_ARG,
    KEEP_ARG,
    STATIC_SHAPES_ARG,
)
from graphpar.core.schema import Trait, has_trait
from graphpar.passes.common import declare_external_inputs
from graphpar.passes.state import ParallelState


def configure_train_net(state: ParallelState) -> None:
    """The train net's executor (`net_type`, and `compile`'s backend and mode), `num_workers = devices *
    num_threads_per_device` (plus `max_concurrent_distributed_ops` across shards) and, with
    `static_shapes`, the net argument promising fixed input shapes (a copy of the net, such as the
    accumulate net, keeps it)."""
    proto, options = state.model.net.Proto(), state.options
    proto.type = options.net_type
    if options.compile is not None:
        proto.args[COMPILE_BACKEND_ARG] = options.compile.backend
        if options.compile.mode is not None:
            proto.args[COMPILE_MODE_ARG] = options.compile.mode
    if options.static_shapes:
        proto.args[STATIC_SHAPES_ARG] = 1
    proto.num_workers = len(state.layout.devices) * options.num_threads_per_device
    if state.reducer.num_shards > 1:  # a worker per collective in flight, as Caffe2's 8 extra
        proto.num_workers += options.max_concurrent_distributed_ops


def mark_first_iteration_serial(state: ParallelState) -> None:
    """Caffe2's hint `first_iter_only_one_worker=1` on the train net (a serial first iteration)."""
    state.model.net.Proto().args[FIRST_ITER_ARG] = 1


def chain_collectives(ops: Sequence[OperatorDef]) -> None:
    """Give each collective op of `ops` (Trait.COLLECTIVE) a control input on the first output of the
    collective before it on the same channel, so they run in program order whatever the executor.

    Concurrent collective launches can deadlock (single-process NCCL; cross-host collectives wait on
    peers), so every collective of a net runs in one fixed order, whichever pass added it. Collectives
    across processes (Trait.DISTRIBUTED) are ordered per communicator (their input 0): each
    communicator is a channel of its own, so up to one collective per communicator is in flight.
    """
    previous: dict[str | None, str] = {}
    for op in ops:
        if not has_trait(op, Trait.COLLECTIVE):
            continue
        channel = op.inputs[0] if has_trait(op, Trait.DISTRIBUTED) else None
        before = previous.get(channel)
        if before is not None and before not in op.control_inputs:
            op.control_inputs.append(before)
        if op.outputs:
            previous[channel] = op.outputs[0]


def order_collectives(state: ParallelState) -> None:
    """Chain the collectives of every model net in program order (see `chain_collectives`)."""
    for net in state.netdefs():
        chain_collectives(net.ops)


def declare_inputs(state: ParallelState) -> None:
    """Declare, in every model net, the blobs read before they are written as external inputs."""
    for net in state.netdefs():
        declare_external_inputs(net)


def free_intermediates(state: ParallelState) -> None:
    """`dynamic_memory_management`: the train net frees intermediates at their last use, keeping each
    replica's losses and the user's `blobs_to_keep` (on every replica) besides its persistent blobs."""
    layout = state.layout
    keep = [layout.scoped(d, name) for d in layout.devices for name in state.options.blobs_to_keep]
    keep += [str(loss) for losses in state.losses_by_device.values() for loss in losses]
    args = state.model.net.Proto().args
    args[DYNAMIC_MEMORY_ARG] = 1
    args[KEEP_ARG] = list(dict.fromkeys([*args.get(KEEP_ARG, ()), *keep]))


def set_net_lists(state: ParallelState) -> None:
    """The nets `RunInitNet` and `RunNet` run: `[param_init_net]` and `[net]` (Caffe2's lists)."""
    state.init_nets = [state.model.param_init_net]
    state.nets = [state.model.net]
