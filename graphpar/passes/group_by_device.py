"""Passes: group per-replica blobs by their unscoped name, `name -> {device id: blob}`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from graphpar.core.ir import GradientSlice
from graphpar.core.naming import stripBlobName
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout
from graphpar.passes.state import ParallelState

Blob = str | GradientSlice
log = logging.getLogger(__name__)


def group_by_device(blobs: Iterable[Blob], layout: DeviceLayout) -> dict[str, dict[int, Blob]]:
    """Group replica blobs (params, computed params, gradients, sync blobs) by unscoped name.

    Input: blobs each inside one replica's scope (`gpu_3/fc_w`; a GradientSlice's indices and values
    in the same replica). Guarantees: an insertion-ordered dict, keys in the order of first appearance
    and each inner dict in the order the blobs came (the creation order of the replicas).

    Raises:
        ParallelizeError: a blob outside the replica scopes of `layout` (unscoped, another prefix, or a
            device that is not among `layout.devices`).
    """
    grouped: dict[str, dict[int, Blob]] = {}
    for blob in blobs:
        device = _replica(blob, layout)
        grouped.setdefault(stripBlobName(blob), {})[device] = blob
    return grouped


def _replica(blob: Blob, layout: DeviceLayout) -> int:
    if isinstance(blob, GradientSlice):
        devices = {layout.replica_of(str(part)) for part in blob}
        device = devices.pop() if len(devices) == 1 else None
    else:
        device = layout.replica_of(str(blob))
    if device is None:
        scopes = ", ".join(f"{layout.scope(d)}/" for d in layout.devices)
        raise ParallelizeError(f"blob {blob!r} is not in a replica name scope ({scopes}); data-parallel "
                               f"params and gradients must be created inside the builder functions")
    return device


def group_params(state: ParallelState) -> None:
    """Group the data-parallel params and computed params by device (Caffe2's `_param_names`,
    `_computed_param_names`); params created before Parallelize are left out."""
    model = state.model
    params = group_by_device([p for p in model.params if str(p) not in state.non_datapar], state.layout)
    computed = group_by_device([p for p in model.GetComputedParams("") if str(p) not in state.non_datapar],
                               state.layout)
    state.grouped.update(params)
    state.grouped.update(computed)
    state.param_names = list(params) + list(computed)
    state.computed_param_names = list(computed)


def group_gradients(state: ParallelState) -> None:
    """Group the data-parallel params' gradients by device, in param creation order (`_grad_names`)."""
    model = state.model
    grads = [model.param_to_grad[p] for p in model.params
             if p in model.param_to_grad and str(p) not in state.non_datapar]
    grouped = group_by_device(grads, state.layout)
    if not grouped:
        log.warning("Parallelize: model %r has no parameter gradients to all-reduce", model.name)
    state.grouped.update(grouped)
    state.grad_names = list(grouped)
