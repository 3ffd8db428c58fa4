"""Load order: what a workspace remembers of a checkpoint load until the loaded values are in use.

`checkpoint.load` records every blob it feeds in `Workspace.loaded` (name -> file). An entry stays
until the value is used (a run reads or writes it), replaced (FeedBlob, remove, reset), or
broadcast to the replicas (`FinalizeAfterCheckpoint`). While entries remain, every run is checked
first, so that two mistakes of resuming raise instead of training from the wrong values:

- a run that reads a *replica* of a loaded blob (`cpu_1/fc_w` after loading `cpu_0/fc_w`, or a
  replica's part `cpu_0/fc_w_momentum_shard` of sharded state after loading `cpu_0/fc_w_momentum`),
  i.e. `FinalizeAfterCheckpoint` was skipped (replicas would differ forever, or train from the
  initial state) or the checkpoint was saved with another first device (the model would train from
  its initial values);
- a run that overwrites a loaded blob without reading it, i.e. the checkpoint was loaded before the
  init net ran (the loaded values would be thrown away).

The checks cost nothing once the loaded values are in use (an empty dict is all a run looks at).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from graphpar.core.naming import parse_device_scope, stripBlobName, unsharded_name
from graphpar.errors import CheckpointError

RESUME_ORDER = ("RunInitNet, then checkpoint.load(path, model=model) (which maps the file's names onto the "
                "model's first device), then FinalizeAfterCheckpoint(model), then RunNet")


def unsynced_replicas(reads: Iterable[str], loaded: Mapping[str, str]) -> list[tuple[str, str]]:
    """(loaded blob, a replica of it in `reads` that was not loaded) pairs: same unscoped name, another
    replica scope; or a replica's part of it (`_shard`), in any scope."""
    scoped: dict[str, list[str]] = {}
    for name in loaded:
        if parse_device_scope(name) is not None:
            scoped.setdefault(stripBlobName(name), []).append(name)
    if not scoped:
        return []
    pairs: list[tuple[str, str]] = []
    for read in reads:
        scope = parse_device_scope(read)
        if scope is None or read in loaded:  # a replica loaded from the file too holds its saved value
            continue
        unscoped = stripBlobName(read)
        pairs.extend((name, read) for name in scoped.get(unsharded_name(unscoped) or unscoped, ()))
    return pairs


def check_run(net_name: str, reads: Iterable[str], overwrites: Iterable[str], loaded: Mapping[str, str]) -> None:
    """Raise CheckpointError if running a net that reads `reads` and overwrites (writes without reading)
    `overwrites` would misuse values loaded from a checkpoint (see the module docstring)."""
    overwritten = [name for name in overwrites if name in loaded]
    if overwritten:
        raise CheckpointError(
            f"net {net_name!r} would overwrite blobs loaded from checkpoint {loaded[overwritten[0]]!r} "
            f"({_some(overwritten)}) without reading them: the checkpoint was loaded before the init net ran, "
            f"and its values would be thrown away. Resume in this order: {RESUME_ORDER}")
    pairs = unsynced_replicas(reads, loaded)
    if pairs:
        name, replica = pairs[0]
        raise CheckpointError(
            f"net {net_name!r} reads {replica!r}, a replica of {name!r} loaded from checkpoint "
            f"{loaded[name]!r} ({len(pairs)} such blobs), which was not broadcast to the replicas: call "
            f"FinalizeAfterCheckpoint(model) after loading. If the checkpoint was saved with another first "
            f"device than the model's, load it with checkpoint.load(path, model=model). Order: {RESUME_ORDER}")


def _some(names: list[str]) -> str:
    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
