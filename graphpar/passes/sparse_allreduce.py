"""Sparse gradients across replicas: concatenate every device's indices and values (an all-gather).

A sparse gradient (`GradientSlice`) names different rows on every device, so it is not summed:
as in Caffe2's GPU path, the indices and values of all devices are concatenated (device order) and
every replica gets the concatenation, so each applies the whole global sparse update (the update ops
sum duplicate rows). Caffe2 refused this on CPU replicas; graphpar does it on both.

The combined blobs are new (`{scope}/{indices}_concat`, `{scope}/{values}_concat`): the fed indices
are never overwritten. Afterwards each replica's `param_to_grad[p]` and `_device_grouped_blobs[name]`
name the combined slice, which the update builders then read. Several slices sharing one indices
blob (Caffe2's SparseDataParallelModelTestWithSharedIndices) share one concatenation of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from graphpar.core.ir import BlobReference, GradientSlice, OperatorDef
from graphpar.core.naming import stripBlobName
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout
from graphpar.passes.reducers import Reducer, copies
from graphpar.passes.state import ParallelState

Gathered = dict[tuple[str, ...], list[str]]  # the copies of one part, in device order -> its outputs


def is_sparse(copies: Mapping[int, object]) -> bool:
    """Whether a grouped gradient is sparse (its copies are GradientSlices)."""
    return any(isinstance(blob, GradientSlice) for blob in copies.values())


def _outputs(layout: DeviceLayout, part: str, to_all: bool) -> list[str]:
    devices = layout.devices if to_all else layout.devices[:1]
    return [layout.scoped(d, f"{stripBlobName(part)}_concat") for d in devices]


def _gather_part(parts: list[str], reducer: Reducer, gathered: Gathered, to_all: bool) -> tuple[list[OperatorDef],
                                                                                                 list[str]]:
    """The all-gather of one part (the indices or the values) unless an earlier slice did it."""
    key = tuple(parts)
    if key in gathered:
        return [], gathered[key]
    outputs = _outputs(reducer.layout, parts[0], to_all)
    gathered[key] = outputs
    return reducer.allgather(stripBlobName(parts[0]), parts, outputs), outputs


def allgather_slice(name: str, copies: Mapping[int, str | GradientSlice], reducer: Reducer, gathered: Gathered,
                    to_all: bool = True) -> tuple[list[OperatorDef], dict[int, GradientSlice]]:
    """The ops concatenating one sparse gradient's copies, and its combined slice per device.

    Raises:
        ParallelizeError: a copy is missing, or some copies are dense.
    """
    layout = reducer.layout
    missing = [d for d in layout.devices if d not in copies]
    dense = [d for d, blob in copies.items() if not isinstance(blob, GradientSlice)]
    if missing or dense:
        raise ParallelizeError(f"sparse gradient {name!r}: every replica must compute it as a GradientSlice "
                               f"(missing on {missing}, dense on {dense})")
    ops, combined = [], []
    for part in ("indices", "values"):
        part_ops, outputs = _gather_part([getattr(copies[d], part) for d in layout.devices], reducer, gathered,
                                         to_all)
        ops.extend(part_ops)
        combined.append(outputs)
    return ops, {d: GradientSlice(i, v) for d, i, v in zip(layout.devices, *combined)}


def allgather_slices(state: ParallelState, names: Iterable[str], gathered: Gathered,
                     to_all: bool = True) -> list[OperatorDef]:
    """`allgather_slice` for each sparse name (in order), with the state rebound to the combined slices;
    returns the ops (the caller places them). One replica has nothing to gather."""
    ops: list[OperatorDef] = []
    if copies(state.reducer) < 2:
        return ops
    for name in names:
        name_ops, combined = allgather_slice(name, state.grouped[name], state.reducer, gathered, to_all)
        ops.extend(name_ops)
        rebind(state, name, combined)
    return ops


def rebind(state: ParallelState, name: str, combined: Mapping[int, GradientSlice]) -> None:
    """Point `grouped[name]` and each replica's `param_to_grad` entry at the combined slices."""
    model, original = state.model, state.grouped[name]
    for param, grad in list(model.param_to_grad.items()):
        for device, blob in original.items():
            if grad == blob and device in combined:
                indices, values = combined[device]
                model.param_to_grad[param] = GradientSlice(BlobReference(indices), BlobReference(values))
    state.grouped[name] = {d: combined.get(d, blob) for d, blob in original.items()}
