"""Feeding every replica: refuse a step for which some replicas got a new batch and others did not.

A replica whose input was not fed again trains on its previous batch, silently: the gradient
all-reduce mixes that stale batch into every step. Before each `data_parallel_model.RunNet`, each
fed input (a blob the train net reads in a replica scope that neither the model's init nets nor the
net itself create, and that is not a param) is compared across replicas: either every replica's copy
was fed since the last run, or none was (re-running one fixed batch is allowed). `FeedBlob` always
stores a new tensor, so "fed again" is "another tensor object"; the check costs a few dictionary
look-ups per input and device, and holds only weak references.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import NetDef
from graphpar.core.naming import stripBlobName
from graphpar.passes.common import DeviceLayout


class FeedTracker:
    """The fed inputs of one model's train net, and the tensors its last run read."""

    def __init__(self, layout: DeviceLayout, net: NetDef, init_nets: list[NetDef], params: list[str]) -> None:
        created = {b for init in init_nets for b in dataflow(init).first_write}
        flow = dataflow(net)
        groups: dict[str, list[str]] = {}
        for blob in flow.loads:  # what a run reads, not what the net declares (a declared input may be unread)
            if layout.replica_of(blob) is None or blob in created or blob in flow.first_write:
                continue
            name = stripBlobName(blob)
            if name not in params:
                groups.setdefault(name, []).append(blob)
        self.groups = {name: blobs for name, blobs in groups.items() if len(blobs) > 1}
        self.last: dict[str, weakref.ref] = {}

    def check(self, blobs: Mapping[str, torch.Tensor], what: str) -> None:
        """Raise RuntimeError if some replicas' copies of an input were fed since the last run and others not."""
        if not self.last:
            return
        for group in self.groups.values():
            fresh = [blob for blob in group if blob in blobs and self.last.get(blob, _dead)() is not blobs[blob]]
            if fresh and len(fresh) < len(group):
                stale = [blob for blob in group if blob not in fresh]
                raise RuntimeError(
                    f"{what}: {', '.join(map(repr, fresh))} {'was' if len(fresh) == 1 else 'were'} fed since the "
                    f"last run but {', '.join(map(repr, stale))} {'was' if len(stale) == 1 else 'were'} not, so "
                    f"{'that replica' if len(stale) == 1 else 'those replicas'} would train on the previous batch "
                    f"again. Feed every device (graphpar.data.feed_batch splits one batch over them); nothing "
                    f"ran")

    def check_rows(self, blobs: Mapping[str, torch.Tensor], what: str) -> None:
        """Raise ValueError if a replica's fed arrays all have zero rows (an empty batch on that replica
        trains nothing there and biases the all-reduced gradient towards the others)."""
        replicas: dict[str, list[bool]] = {}
        for group in self.groups.values():
            for blob in group:
                tensor = blobs.get(blob)
                if tensor is not None and tensor.dim() > 0:
                    replicas.setdefault(blob.split("/", 1)[0], []).append(tensor.shape[0] == 0)
        empty = [scope for scope, rows in replicas.items() if all(rows)]
        if empty:
            raise ValueError(f"{what}: replica(s) {', '.join(empty)} were fed an empty batch (every fed input "
                             f"has zero rows); an empty batch on one replica would bias the gradient towards the "
                             f"others. Feed every device rows (graphpar.data.feed refuses empty batches); nothing "
                             f"ran")

    def remember(self, blobs: Mapping[str, torch.Tensor]) -> None:
        """Note the tensors the run just read."""
        self.last = {blob: weakref.ref(blobs[blob]) for group in self.groups.values() for blob in group
                     if blob in blobs}


def _dead() -> None:
    return None
