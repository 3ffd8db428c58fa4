"""Sharded state (`shard_optimizer_state`, `shard_gradients`; ZeRO stages 1 and 2): how each param is
cut into one part per replica, and the nets that gather and cut sharded state for checkpoints.

With N replicas in all (devices times shards), a param of n elements is flattened and cut into N
contiguous parts of n // N or n // N + 1 elements (the first n % N parts one longer; a param smaller
than N leaves some replicas an empty part), in global replica order: shard s's device at position i
owns part `s * len(devices) + i`. No padding, so nothing is ever summed or updated twice. Every
sharded blob of a replica (its part of the gradient, of the param, of each optimizer state blob) is
`<blob>_shard` in its scope (`core.naming.shard_name`).

Checkpoints keep one format: `state_gather_net` writes every sharded state blob, whole, under the
first device's unsharded name (`cpu_0/fc_w_momentum`), which `GetCheckpointParams` lists, and
`state_scatter_net` cuts such a blob (loaded from any checkpoint, sharded or not) back into the
parts, so a checkpoint moves between sharded and unsharded runs and between device and process counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphpar.core.ir import GradientSlice, NetDef, OperatorDef
from graphpar.core.naming import DYNAMIC_MEMORY_ARG, KEEP_ARG, shard_name, stripBlobName
from graphpar.errors import ParallelizeError
from graphpar.passes.bucketing import param_specs
from graphpar.passes.common import DeviceLayout, declare_external_inputs
from graphpar.passes.finish import chain_collectives
from graphpar.passes.reducers import copies

if TYPE_CHECKING:
    from graphpar.passes.state import ParallelState

log = logging.getLogger(__name__)


def split_sizes(numel: int, parts: int) -> tuple[int, ...]:
    """`numel` elements cut into `parts` contiguous sizes differing by at most one, the longer first."""
    base, extra = divmod(numel, parts)
    return tuple(base + (k < extra) for k in range(parts))


@dataclass
class Sharding:
    """How the params of a parallelized model are sharded (kept as `ParallelState.sharding`).

    `sizes[param]`: the part sizes of each (unscoped) param, one per replica of every shard, in global
    order; `shapes[param]` its shape. `first`: the global index of this process's first replica.
    `param_of_grad`: unscoped gradient -> its param. `grads` (shard_gradients): unscoped gradient ->
    {device: the blob holding that replica's part of the summed gradient}. `state`: each sharded
    optimizer state blob (unscoped, unsharded name) -> its param (filled by `passes.shard_updates`).
    """

    first: int
    sizes: dict[str, tuple[int, ...]]
    shapes: dict[str, tuple[int, ...]]
    param_of_grad: dict[str, str]
    grads: dict[str, dict[int, str]] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)

    def local(self, param: str, devices: int) -> tuple[int, ...]:
        """The sizes of this process's `devices` parts of `param`."""
        return self.sizes[param][self.first:self.first + devices]

    def bounds(self, param: str, position: int) -> tuple[int, int]:
        """[start, end) of the part of `param` that this process's device at `position` owns."""
        sizes, k = self.sizes[param], self.first + position
        start = sum(sizes[:k])
        return start, start + sizes[k]


def plan_shards(state: ParallelState) -> None:
    """Cut every data-parallel param with a gradient into one part per replica (`state.sharding`), or
    leave `state.sharding` None with a single replica (nothing to shard).

    Input: the gradients grouped (`state.grad_names`). Guarantees: `state.sharding.sizes` and `shapes`
    for each such param (shapes from shape inference on param_init_net).

    Raises:
        ParallelizeError: a sparse (GradientSlice) gradient, or a param whose size cannot be inferred.
    """
    reducer, layout, model = state.reducer, state.layout, state.model
    if copies(reducer) < 2:
        log.info("Parallelize(%r): one replica, nothing to shard", model.name)
        return
    master = layout.master
    sparse = [stripBlobName(str(p)) for p, g in model.param_to_grad.items()
              if isinstance(g, GradientSlice) and layout.replica_of(str(p)) == master]
    if sparse:
        raise ParallelizeError(f"Parallelize: shard_optimizer_state does not support sparse (GradientSlice) "
                               f"gradients, and params {sparse} have sparse ones (embedding lookups): their rows "
                               f"are updated where they are looked up, which no fixed cut of the param follows. "
                               f"Use shard_optimizer_state=False for this model")
    param_of_grad = {stripBlobName(str(g)): stripBlobName(str(p)) for p, g in model.param_to_grad.items()
                     if layout.replica_of(str(p)) == master and stripBlobName(str(g)) in state.grad_names}
    needs = ("shard_optimizer_state", "use shard_optimizer_state=False")
    specs = param_specs(model.param_init_net.Proto(), [layout.scoped(master, p) for p in param_of_grad.values()],
                        needs)
    state.sharding = Sharding(first=reducer.shard_id * len(layout.devices),
                              sizes={stripBlobName(b): split_sizes(s.numel, copies(reducer)) for b, s in specs.items()},
                              shapes={stripBlobName(b): tuple(s.shape) for b, s in specs.items()},
                              param_of_grad=param_of_grad)


def state_gather_net(name: str, state: ParallelState, names: Iterable[str]) -> NetDef:
    """A net writing each sharded state blob of `names` (unscoped), whole, under the first device's
    name: every replica's part gathered (across shards too, so every shard runs it)."""
    layout, sharding, ops = state.layout, _sharding(state), []
    for blob in names:
        param = sharding.state[blob]
        ops += state.reducer.gather_shards(blob, _parts(layout, blob), [layout.scoped(layout.master, blob)],
                                           sharding.sizes[param], sharding.shapes[param])
    return _net(name, ops, [layout.scoped(layout.master, blob) for blob in names])


def state_scatter_net(name: str, state: ParallelState, names: Iterable[str]) -> NetDef:
    """A net cutting each of `names` (unscoped sharded state), read whole from the first device (shard
    0's, across shards), into every replica's part."""
    layout, sharding, ops = state.layout, _sharding(state), []
    for blob in names:
        ops += state.reducer.scatter_shards(blob, layout.scoped(layout.master, blob), _parts(layout, blob),
                                            sharding.sizes[sharding.state[blob]])
    return _net(name, ops, [part for blob in names for part in _parts(layout, blob)])


def _sharding(state: ParallelState) -> Sharding:
    if state.sharding is None:
        raise ParallelizeError(f"model {state.model.name!r} has no sharded state")
    return state.sharding


def _parts(layout: DeviceLayout, blob: str) -> list[str]:
    """Every replica's part of unscoped `blob`, in device order."""
    return [shard_name(layout.scoped(d, blob)) for d in layout.devices]


def _net(name: str, ops: list[OperatorDef], keep: list[str]) -> NetDef:
    """A net of `ops` that keeps only `keep` (and what it reads) once it ran: no temporary copy of the
    state outlives it."""
    net = NetDef(name, ops, args={DYNAMIC_MEMORY_ARG: 1, KEEP_ARG: keep})
    chain_collectives(net.ops)
    declare_external_inputs(net)
    return net
