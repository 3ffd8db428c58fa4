"""Passes for `shared_model` (CPU only): all replicas read the first device's parameters.

Each replica still computes its own gradients, which are summed onto the first device; only the
first device's params get update ops, and the other replicas' params disappear.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from graphpar.core.ir import NetDef
from graphpar.core.naming import stripBlobName
from graphpar.passes.common import DeviceLayout
from graphpar.passes.state import ParallelState


def _foreign(blob: str, layout: DeviceLayout) -> bool:
    replica = layout.replica_of(blob)
    return replica is not None and replica != layout.master


def prune_parameters_for_sharing(model: Any, layout: DeviceLayout) -> None:
    """Drop the other replicas' params from `params`, `param_to_grad`, `weights` and `biases`.

    Input: a model whose gradients are all-reduced onto the first device. Guarantees: optimizers
    built afterwards update only the first device's params. Params outside every replica scope
    (created before Parallelize) are kept; Caffe2 dropped those too.
    """
    model.params = [p for p in model.params if not _foreign(p, layout)]
    model.param_to_grad = {p: g for p, g in model.param_to_grad.items() if not _foreign(p, layout)}
    model.weights = [w for w in model.weights if not _foreign(w, layout)]
    model.biases = [b for b in model.biases if not _foreign(b, layout)]


def remap_shared_parameters(nets: Collection[NetDef], all_params: Collection[str], layout: DeviceLayout) -> None:
    """Delete the ops that write other replicas' params and read the first device's copy instead.

    Input: `all_params` are every replica's params (before pruning). Guarantees: no op of `nets`
    reads or writes a param of a replica other than the first; external inputs are renamed too.
    """
    foreign = {str(p) for p in all_params if _foreign(str(p), layout)}

    def master(blob: str) -> str:
        return layout.scoped(layout.master, stripBlobName(blob)) if blob in foreign else blob

    for net in nets:
        net.ops = [op for op in net.ops if not foreign.intersection(op.outputs)]
        for op in net.ops:
            op.inputs = [master(b) for b in op.inputs]
        net.external_inputs = list(dict.fromkeys(master(b) for b in net.external_inputs))


def prune_shared_params(state: ParallelState) -> None:
    """Remember every replica's params, then keep only the first device's (`prune_parameters_for_sharing`)."""
    state.all_params = [str(p) for p in state.model.GetParams("")]
    prune_parameters_for_sharing(state.model, state.layout)


def remap_shared_params(state: ParallelState) -> None:
    """`remap_shared_parameters` on the model's nets, for the params remembered before pruning."""
    remap_shared_parameters(state.netdefs(), state.all_params, state.layout)
