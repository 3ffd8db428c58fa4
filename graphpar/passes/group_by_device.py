"""Pass: group per-replica blobs by their unscoped name, `name -> {device id: blob}`."""

from __future__ import annotations

from collections.abc import Iterable

from graphpar.core.ir import GradientSlice
from graphpar.errors import ParallelizeError
from graphpar.naming import stripBlobName
from graphpar.passes.common import DeviceLayout

Blob = str | GradientSlice


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
