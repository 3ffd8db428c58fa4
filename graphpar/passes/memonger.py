"""Pass: blobs whose lifetimes do not overlap share one name (Caffe2's memonger, `share_grad_blobs`).

Each replica's gradient blobs (written only by gradient ops), and with `recycle_activations` its
forward activations too, are given names from a pool: a blob takes over the name of a blob whose
last use came strictly before its first, so a run holds one value per pool name instead of one per
blob (the old value is released when the name is rebound, and a freeing run frees fewer, larger
slots). Never shared: param gradients (the updates and the all-reduce read them), blobs that any
cross-device op touches (collectives, copies, the all-reduce Sums) or an aliasing op names
(`Effects.aliases`: the names share one tensor), blobs read before they are
written (params, inputs), external outputs, blobs read by the model's other nets, and excluded
names. Sharing only renames blobs, so results are bit-identical; the dependency graph of the
renamed net orders the reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import NetDef
from graphpar.core.naming import shared_blob_name
from graphpar.core.schema import crosses_devices, effects_of
from graphpar.passes.state import ParallelState


def share_blobs(net: NetDef, namescope: str, shareable: Callable[[str], bool],
                dont_share: Collection[str] = (), specs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Rename, in place, the blobs of `net` in `namescope` that `shareable` accepts so that blobs with
    disjoint lifetimes share names; returns {old name: shared name}.

    Input: a valid net. Guarantees: the renamed net computes the same values; a shared name is never
    held by two blobs at once (one's last use is strictly before the other's first write); blobs that
    `shareable` rejects, `dont_share`, blobs read before written, external outputs and blobs touched
    by cross-device ops keep their names. With `specs` (blob -> shape/dtype spec), a free name last
    used by a blob of the same spec is preferred, so buffers could be reused as they are.
    """
    flow = dataflow(net)
    lifetimes, written = flow.lifetimes, flow.first_write
    # blobs read before any op writes them are inputs of the net
    fixed = set(dont_share) | set(net.external_inputs) | set(net.external_outputs) | _cross_device(net) | flow.read_first
    candidates = sorted((lifetimes[b][0], b) for b in written
                        if b.startswith(namescope) and b not in fixed and shareable(b))
    free: list[tuple[int, str, Any]] = []  # (last use of its current holder, shared name, holder's spec)
    renames: dict[str, str] = {}
    taken, pool = set(lifetimes), 0
    for first, blob in candidates:
        spec = specs.get(blob) if specs else None
        usable = [entry for entry in free if entry[0] < first]
        choice = next((e for e in usable if spec is not None and e[2] == spec), usable[0] if usable else None)
        if choice is None:
            name = shared_blob_name(namescope, pool)
            pool += 1
            while name in taken:
                name += "_"
            taken.add(name)
        else:
            free.remove(choice)
            name = choice[1]
        renames[blob] = name
        free.append((lifetimes[blob][1], name, spec))
    _rename(net, renames)
    return renames


def _cross_device(net: NetDef) -> set[str]:
    """Blobs of ops that cross devices (`core.schema.crosses_devices`) or alias (their names share a tensor)."""
    return {b for op in net.ops if crosses_devices(op) or effects_of(op).aliases for b in (*op.inputs, *op.outputs)}


def _rename(net: NetDef, renames: Mapping[str, str]) -> None:
    if not renames:
        return
    for op in net.ops:
        op.inputs = [renames.get(b, b) for b in op.inputs]
        op.outputs = [renames.get(b, b) for b in op.outputs]
        op.control_inputs = [renames.get(b, b) for b in op.control_inputs]


def optimize_memory(state: ParallelState, excluded: Collection[str] = (), recycle_activations: bool = False,
                    specs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """`share_blobs` on the train net for every replica (Caffe2's `OptimizeGradientMemory`).

    Gradients are the blobs only gradient ops write; with `recycle_activations`, every other blob
    of the replica too, except params, computed params and losses. `excluded` are unscoped names kept
    on every replica. Returns every rename.
    """
    model, layout = state.model, state.layout
    net = model.net.Proto()
    keep = {str(g) for g in model.param_to_grad.values()} | {str(p) for p in model.GetAllParams("")}
    keep |= {str(loss) for losses in state.losses_by_device.values() for loss in losses}
    for other in (model.param_init_net.Proto(),):
        keep |= {b for op in other.ops for b in (*op.inputs, *op.outputs)}
    by_gradient_ops_only = {b for op in net.ops if op.is_gradient_op for b in op.outputs}
    by_gradient_ops_only -= {b for op in net.ops if not op.is_gradient_op for b in op.outputs}

    def shareable(blob: str) -> bool:
        return recycle_activations or blob in by_gradient_ops_only

    renames = {}
    for device in layout.devices:
        scope = layout.scoped(device, "")
        dont_share = keep | {scope + name for name in excluded}
        renames.update(share_blobs(net, scope, shareable, dont_share, specs))
    return renames


def share_gradient_memory(state: ParallelState) -> None:
    """`optimize_gradient_memory`: each replica's gradient blobs share names (see the module doc)."""
    optimize_memory(state)

