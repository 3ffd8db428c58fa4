"""Passes: stop a step whose loss is NaN or infinite before it changes any param (`check_finite_loss`)."""

from __future__ import annotations

from graphpar.core.schema import Trait, has_trait
from graphpar.passes.common import make_op
from graphpar.passes.reducers import DistributedReducer
from graphpar.passes.state import ParallelState

CHECKED = "_losses_checked_across_shards"  # CheckFiniteAcrossShards' output: which shards had a non-finite loss


def check_finite_losses(state: ParallelState) -> None:
    """Append `CheckFinite(losses)` per replica that has losses, on its device (a forward builder that
    returns no loss, e.g. a barrier-only net, gets no check). Over several shards, nothing: see
    `check_finite_across_shards`.

    Needs: `build_replicas` (each replica's losses), and no gradient or update op yet.
    Guarantees: one check op per device, in device order, before every gradient and update op; since
    executors start no in-place update before every op preceding the first update has finished, and
    a failed run writes nothing back, a NaN or infinite loss fails the run with params, optimizer
    state and counters unchanged.
    """
    if state.options.num_shards > 1:
        return
    layout = state.layout
    state.model.net.Proto().ops.extend(
        make_op("CheckFinite", [str(b) for b in state.losses_by_device[device]], [], layout.option(device))
        for device in layout.devices if state.losses_by_device[device])


def check_finite_across_shards(state: ParallelState) -> None:
    """Over several shards: in the train net and the accumulate net, one `CheckFiniteAcrossShards` over
    every replica's losses right after the last op that writes one, and every later cross-shard
    collective waits for it (a control input on its output), so that every shard stops the step
    before any collective after the check when any shard's loss is not finite (a check on one shard
    only would let the others' collectives meet its next step's).

    Needs: every collective added (runs before `order_collectives`), no update before the losses,
    and a `DistributedReducer` (its first communicator, shared with the collectives after the check).
    Guarantees: the check precedes every update and follows every replica's losses, in the same place
    on every shard; no cross-shard collective after it starts before it returns.
    """
    reducer, layout = state.reducer, state.layout
    assert isinstance(reducer, DistributedReducer)
    devices = [device for device in layout.devices if state.losses_by_device[device]]
    losses = [str(b) for device in devices for b in state.losses_by_device[device]]
    if not losses:
        return
    nets = [state.model.net.Proto()] + ([state.accumulate_net.Proto()] if state.accumulate_net is not None else [])
    for net in nets:
        written = set(losses)
        after = max(i for i, op in enumerate(net.ops) if written.intersection(op.outputs)) + 1
        for op in net.ops[after:]:
            if has_trait(op, Trait.DISTRIBUTED):
                op.control_inputs.append(CHECKED)
        net.ops.insert(after, make_op("CheckFiniteAcrossShards", [reducer.worlds[0], *losses], [CHECKED],
                                      layout.option(layout.master),
                                      input_device_ids=[d for d in devices for _ in state.losses_by_device[d]]))
