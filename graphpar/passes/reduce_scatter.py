"""Pass (`shard_gradients`, ZeRO stage 2): reduce-scatter every gradient instead of all-reducing it.

In reverse creation order (the last layer's gradients are ready first), each replica's gradient is
summed over every replica, but each replica gets only its part of the sum (`passes.shards` says which
part): `<grad>_shard`, which the sharded updates (`passes.shard_updates`) read. The reducer decides the
ops (`Reducer.reduce_scatter`): with Sum trees every element is added in the order the all-reduce adds
it, so the parts hold the all-reduce's bits.
"""

from __future__ import annotations

from graphpar.core.naming import shard_name
from graphpar.passes.allreduce import checked_group
from graphpar.passes.state import ParallelState


def reduce_scatter_gradients(state: ParallelState) -> None:
    """Reduce-scatter every data-parallel gradient, in reverse creation order.

    Input: `state.sharding` planned (`passes.shards.plan_shards`); the train net computes every
    replica's gradients. Guarantees: for each gradient, `state.sharding.grads[name]` maps every device
    to the blob holding its part of the summed gradient; the gradient blobs themselves keep the
    replica's own (unsummed) gradient.
    """
    sharding, reducer, net = state.sharding, state.reducer, state.model.net.Proto()
    if sharding is None:
        return
    for name in reversed(state.grad_names):
        copies = {device: str(blob) for device, blob in state.grouped[name].items()}  # dense: plan_shards checked
        group = checked_group(name, copies, state.layout, reducer.num_shards > 1)
        if group is None:
            continue
        shards = [shard_name(blob) for blob in group]
        net.ops.extend(reducer.reduce_scatter(name, group, shards, sharding.sizes[sharding.param_of_grad[name]]))
        sharding.grads[name] = dict(zip(state.layout.devices, shards))
