"""The memory model: which blobs a run keeps, and the per-run frame that holds the rest.

A run reads its inputs from the workspace into a frame (a list indexed by slot), executes its steps
on the frame, and writes its outputs back to the workspace only when every step has succeeded, so a
failed run leaves the workspace's persistent blobs (below) as they were. Once a net has run, its
transient blobs belong to it: their previous values leave the workspace when its next run starts and
are released as the run rewrites them (keeping them alive through the run would double the memory its
intermediates take), so after a failed run they are absent rather than stale.

*Persistent* blobs outlive a run: those the net reads before writing them (params, optimizer state,
fed inputs, counters), its external outputs, and the names in the net's `blobs_to_keep` argument.
The others are *transient* intermediates. By default every blob is written back (Caffe2's behaviour:
any blob can be fetched after a run). With the net argument `dynamic_memory_management` set, an
executor frees each transient slot right after its last use and the run keeps only persistent blobs
(transients left over in the workspace from earlier runs are removed, never left stale); `keep_all`
(a compile option for introspection) turns that off.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import NetDef
from graphpar.core.naming import DYNAMIC_MEMORY_ARG, KEEP_ARG
from graphpar.executor.failure import missing_at_run
from graphpar.executor.runtime import runtime_of

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet



@dataclass(frozen=True)
class Load:
    """A blob read from the workspace when a run starts: its slot, name, and the first op reading it."""

    slot: int
    name: str
    reader: int
    position: int  # the reader's input index


@dataclass(frozen=True)
class FrameLayout:
    """How a net's blobs map to frame slots and what a run loads, frees, stores and drops.

    Freeing works on *versions*: each write of a blob starts one, read by the ops up to the next
    write. A transient version can be freed once every op that uses it has run, whatever order the
    steps run in (any order that respects the plan's dependencies): an executor that launches in a
    fixed order frees after each step what `frees_in(order)` lists for it (the last user of each
    version in that order); one that launches dynamically counts each version's users down
    (`releases`, `version_slots`, `version_users`). A version whose user writes the next version in
    place is not freed: the rebinding releases it.
    """

    names: tuple[str, ...]  # the blob of each slot
    slot: Mapping[str, int]
    loads: tuple[Load, ...]
    store_slots: tuple[int, ...]  # the slots written back when the run succeeds...
    store_names: tuple[str, ...]  # ...under these names
    stale: tuple[tuple[int, str], ...]  # (slot, name) of the transient blobs the net writes
    drops: tuple[str, ...]  # transient names removed from the workspace when the run succeeds
    releases: tuple[tuple[int, ...], ...]  # per step: the freeable versions it uses
    version_slots: tuple[int, ...]  # per freeable version: its slot
    version_users: tuple[int, ...]  # per freeable version: how many steps use it
    persistent: frozenset[str]

    @property
    def frees_memory(self) -> bool:
        """Whether an executor should free slots during the run."""
        return bool(self.version_slots)

    def frees_in(self, order: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Per step: the slots to free right after it when the steps of `order` run in that order (the
        versions whose last user it is there); empty when the run frees nothing. `order` may be any
        order that respects the plan's dependencies, or part of one: a version is freed after its last
        user within `order`, so a part must hold every step that runs after it."""
        frees: list[list[int]] = [[] for _ in self.releases]
        if not self.version_slots:
            return tuple(map(tuple, frees))
        last: dict[int, int] = {}
        for j in order:
            for v in self.releases[j]:
                last[v] = j
        for v, j in sorted(last.items()):
            frees[j].append(self.version_slots[v])
        return tuple(map(tuple, frees))


def layout_frame(netdef: NetDef, keep_all: bool = False) -> FrameLayout:
    """The frame layout of `netdef` (data inputs and outputs only: control inputs are dependencies)."""
    flow = dataflow(netdef)
    slot = {blob: k for k, blob in enumerate(flow.data_blobs)}
    loads = [Load(slot[blob], blob, *load) for blob, load in flow.loads.items()]
    written = flow.first_write
    keep = netdef.args.get(KEEP_ARG) or ()
    persistent = frozenset(flow.loads) | set(netdef.external_outputs) | set(keep)
    freeing = bool(netdef.args.get(DYNAMIC_MEMORY_ARG)) and not keep_all
    versions = [(v.blob, v.users) for v in flow.versions if v.blob not in persistent and not v.rewritten_in_place] \
        if freeing else []
    releases: list[list[int]] = [[] for _ in netdef.ops]
    for v, (_blob, users) in enumerate(versions):
        for user in users:
            releases[user].append(v)
    stored = [b for b in written if not freeing or b in persistent]
    drops = tuple(b for b in written if freeing and b not in persistent)
    stale = tuple((slot[b], b) for b in written if b not in persistent)
    return FrameLayout(tuple(slot), slot, tuple(loads), tuple(slot[b] for b in stored), tuple(stored), stale, drops,
                       tuple(map(tuple, releases)),
                       tuple(slot[blob] for blob, _ in versions), tuple(len(users) for _, users in versions),
                       persistent)


def open_frame(plan: CompiledNet, blobs: MutableMapping[str, torch.Tensor]) -> list:
    """A fresh frame for one run of `plan`, holding the blobs it reads from the workspace (whose stale
    transient blobs it removes).

    Raises MissingBlobError (naming the op that needs it) for a blob removed since CreateNet; the
    workspace is then unchanged.
    """
    layout = plan.frame
    frame: list = [None] * len(layout.names)
    try:
        for load in layout.loads:
            frame[load.slot] = blobs[load.name]
    except KeyError as exc:
        raise missing_at_run(plan, exc.args[0]) from None
    if runtime_of(plan).committed:  # the previous values move into the frame: each dies when its op rewrites it
        for slot, name in layout.stale:
            frame[slot] = blobs.pop(name, None)
    return frame


class StateCheck(NamedTuple):
    """A blob that update step `step` changes in place, and the shape and dtype it had at CreateNet."""

    step: int
    slot: int
    name: str
    shape: torch.Size
    dtype: torch.dtype


class StateGuard:
    """Checked before the second phase of every run (`executor.plan.CompiledNet`): each blob an update changes
    in place must still have the shape and dtype it had at CreateNet (not fed or loaded anew since with
    others), so that no update runs on it and the state stays as it was.

    The tensors last found good are remembered in the plan's runtime (`verified`, weakly: the guard
    must not count as a holder, see `executor.program.claim`): a blob whose tensor is the same object
    as then (in-place updates keep their tensors) costs one identity test.
    """

    def __init__(self, checks: tuple[StateCheck, ...]) -> None:
        self.checks = checks

    def check(self, frame: list, verified: list) -> None:
        """Raise StateChanged, naming the update and the blob, if a state blob's shape or dtype changed
        (`verified`: the runtime's list of the tensors last found good, one per check, updated)."""
        for k, check in enumerate(self.checks):
            value = frame[check.slot]
            if verified[k] is not None and verified[k]() is value:
                continue
            if value.shape != check.shape or value.dtype is not check.dtype:
                raise StateChanged(check.step, (
                    f"state blob {check.name!r}, which this op updates in place, is {list(value.shape)} "
                    f"{str(value.dtype).removeprefix('torch.')} but was {list(check.shape)} "
                    f"{str(check.dtype).removeprefix('torch.')} at CreateNet (it was fed or loaded with "
                    f"another shape or dtype since); no state was updated. Feed it with its shape and "
                    f"dtype, or CreateNet(..., overwrite=True) if the model changed"))
            verified[k] = weakref.ref(value)


class StateChanged(ValueError):
    """Raised by `StateGuard.check`: `step` is the update whose in-place state changed shape or dtype."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


def commit(plan: CompiledNet, frame: list, blobs: dict[str, torch.Tensor]) -> None:
    """Write a successful run's results back to the workspace (and drop freed transients)."""
    layout = plan.frame
    blobs.update(zip(layout.store_names, map(frame.__getitem__, layout.store_slots)))  # a loop in C
    for name in layout.drops:
        blobs.pop(name, None)
    runtime_of(plan).committed = True
