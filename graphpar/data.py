"""Feeding batches to a data-parallel model: split along the batch axis, one contiguous chunk per device;
samplers that shard a dataset over processes (`TrainingSampler`, `InferenceSampler`, as Detectron2)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from graphpar import workspace
from graphpar.naming import device_scoped


def split_batch(array: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split `array` along axis 0 into `parts` equal contiguous chunks (views), in device order.

    Raises:
        ValueError: `parts` is not a positive int, `array` has no batch axis, or the batch size is
            not a multiple of `parts`.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"split_batch: parts must be a positive int (the device count), got {parts!r}")
    if np.ndim(array) == 0:
        raise ValueError("split_batch: cannot split a scalar; pass an array whose axis 0 is the batch")
    if len(array) % parts:
        raise ValueError(f"a batch of {len(array)} cannot be split evenly over {parts} devices; "
                         f"use a batch size that is a multiple of {parts}")
    size = len(array) // parts
    return [array[i * size:(i + 1) * size] for i in range(parts)]


def feed_batch(model: Any, blobs: Mapping[str, np.ndarray]) -> None:
    """Feed each unscoped blob (e.g. {"data": x, "label": y}) to every replica of a parallelized model.

    Device i of `model._devices` gets the i-th contiguous chunk of the batch, so N devices together
    see exactly the batch one device would. Every blob is split before any is fed, so a batch that
    does not split feeds nothing.

    Raises:
        RuntimeError: the model was not parallelized (see ModelHelper.GetDevices).
        ValueError: a batch size is not a multiple of the device count (see split_batch).
        TypeError: a value cannot be fed (see workspace.FeedBlob).
    """
    devices = model.GetDevices()
    chunks = {name: split_batch(np.asarray(value), len(devices)) for name, value in blobs.items()}
    for name, parts in chunks.items():
        for device_id, part in zip(devices, parts):
            workspace.FeedBlob(device_scoped(model._device_prefix, device_id, name), part)


def minibatches(n: int, batch_size: int, rng: np.random.Generator | None = None,
                drop_last: bool = True) -> Iterator[np.ndarray]:
    """Index arrays of successive minibatches over `n` samples (shuffled when `rng` is given).

    With `drop_last` (the default) a final partial batch is skipped, so every batch has
    `batch_size` indices; without it the last one may be shorter.

    Raises:
        ValueError: `n` is negative or `batch_size` is not a positive int (at the call, not at the
            first `next()`).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"minibatches: batch_size must be a positive int, got {batch_size!r}")
    if n < 0:
        raise ValueError(f"minibatches: the sample count must be >= 0, got {n!r}")
    order = rng.permutation(n) if rng is not None else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    return (order[start:start + batch_size] for start in range(0, stop, batch_size))


def _shard_of(rank: int | None, world: int | None) -> tuple[int, int]:
    """(rank, world size): given, else graphpar.launch's (torch.distributed's, or RANK / WORLD_SIZE)."""
    from graphpar import launch

    rank = launch.get_rank() if rank is None else rank
    world = launch.get_world_size() if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"a sampler needs world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")
    return rank, world


class TrainingSampler:
    """Detectron2's infinite training sampler: every process draws the same seeded stream of epochs
    (each a permutation of `range(size)` when `shuffle`, else in order) and takes every `world`-th
    index starting at its `rank`, so the shards' indices are disjoint and together cover each epoch.
    All shards must use the same `seed`."""

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"TrainingSampler: size must be >= 1, got {size}")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world = _shard_of(rank, world)

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng(self.seed)
        position = 0
        while True:
            epoch = rng.permutation(self.size) if self.shuffle else np.arange(self.size)
            for index in epoch:
                if position % self.world == self.rank:
                    yield int(index)
                position += 1


class InferenceSampler:
    """Detectron2's inference sampler: shard `rank` of `world` gets one contiguous range of
    `range(size)`; the first `size % world` shards get one index more, so nothing is repeated or lost."""

    def __init__(self, size: int, rank: int | None = None, world: int | None = None) -> None:
        if size < 0:
            raise ValueError(f"InferenceSampler: size must be >= 0, got {size}")
        rank, world = _shard_of(rank, world)
        base, left = divmod(size, world)
        begin = rank * base + min(rank, left)
        self.indices = range(begin, begin + base + (rank < left))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
