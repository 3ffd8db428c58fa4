"""Detectron2's data-loading surface: datasets of dicts, a mapper, samplers sharded over the processes,
and loaders whose batches `graphpar.data.feed` takes.

    DatasetCatalog.register("digits_train", lambda: [{"image": x, "label": y}, ...])
    loader = build_train_loader(DatasetCatalog.get("digits_train"), mapper, total_batch_size=64)
    batch = next(iter(loader))          # this process's share of the global batch, collated

A dataset is a list of dicts (one per sample); `mapper(dict) -> sample` turns one into what the model
reads (e.g. {"data": array, "label": int}), and `graphpar.data.collate` stacks the samples into a batch.
The training sampler is infinite and shuffled by a seed every process shares: process r of W takes
every W-th index from r on, so the processes together draw the one global order (Detectron2's
`TrainingSampler`, from `graphpar.data`). Inference shards the dataset into contiguous parts
(`graphpar.data.InferenceSampler`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.data as torchdata

from graphpar.parallel import comm
from graphpar.training.data import InferenceSampler, TrainingSampler, collate

__all__ = ["AspectRatioGroupedDataset", "DatasetCatalog", "DatasetFromList", "InferenceSampler", "MapDataset",
           "ToIterableDataset", "TrainingSampler", "build_test_loader", "build_train_loader",
           "single_device_batch_size"]

log = logging.getLogger(__name__)


class _Catalog(dict):
    """name -> a function returning the dataset (a list of dicts), as Detectron2's DatasetCatalog."""

    def register(self, name: str, func: Callable[[], list[dict]]) -> None:
        if not callable(func):
            raise TypeError(f"DatasetCatalog.register({name!r}): needs a function returning a list of dicts")
        if name in self:
            raise ValueError(f"DatasetCatalog: dataset {name!r} is already registered")
        self[name] = func

    def get(self, name: str) -> list[dict]:  # type: ignore[override]
        if name not in self:
            raise KeyError(f"DatasetCatalog: no dataset {name!r}; registered: {sorted(self)}")
        return self[name]()


DatasetCatalog = _Catalog()


class DatasetFromList(torchdata.Dataset):
    """A map-style dataset over a list (copied per item when `copy`, so a mapper may change its dict)."""

    def __init__(self, items: Sequence[Any], copy: bool = True) -> None:
        self._items, self._copy = list(items), copy

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Any:
        item = self._items[index]
        return dict(item) if self._copy and isinstance(item, dict) else item


class MapDataset(torchdata.Dataset):
    """`map_func` over a dataset. A sample it maps to None (a failed read, an image without boxes) is
    replaced by another one, as Detectron2 does: first retried, then a random other index (seeded),
    warning every 3 failures in a row; more than `max_retries` in a row raise.

    Raises:
        RuntimeError: `max_retries` consecutive samples failed (naming the last index).
    """

    def __init__(self, dataset: Any, map_func: Callable[[Any], Any], max_retries: int = 100, seed: int = 42) -> None:
        self._dataset, self._map_func, self._max_retries = dataset, map_func, max_retries
        self._rng = random.Random(seed)
        self._fallback = set(range(len(dataset)))

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Any:
        current = int(index)
        for retry in range(1, self._max_retries + 1):
            data = self._map_func(self._dataset[current])
            if data is not None:
                self._fallback.add(current)
                return data
            self._fallback.discard(current)
            if retry % 3 == 0:
                log.warning("MapDataset: %d samples in a row failed to map (last index %d); trying another", retry,
                            current)
            if not self._fallback:
                break
            current = self._rng.sample(sorted(self._fallback), k=1)[0]
        raise RuntimeError(f"MapDataset: {self._max_retries} samples in a row mapped to None (starting at index "
                           f"{index}); the mapper fails on every sample it tried")


class ToIterableDataset(torchdata.IterableDataset):
    """An iterable dataset from a map-style `dataset` and a `sampler` of its indices. With DataLoader
    workers, worker w of K takes the sampler's w-th, (w+K)-th, ... index (when `shard_sampler`), so
    the workers together yield each index once, in the sampler's order per worker."""

    def __init__(self, dataset: Any, sampler: Any, shard_sampler: bool = True) -> None:
        if isinstance(dataset, torchdata.IterableDataset):
            raise TypeError("ToIterableDataset: the dataset is iterable already")
        self.dataset, self.sampler, self.shard_sampler = dataset, sampler, shard_sampler

    def __iter__(self) -> Iterator[Any]:
        indices: Any = self.sampler
        info = torchdata.get_worker_info()
        if self.shard_sampler and info is not None and info.num_workers > 1:
            indices = itertools.islice(indices, info.id, None, info.num_workers)
        for index in indices:
            yield self.dataset[index]

    def __len__(self) -> int:
        return len(self.sampler)


class AspectRatioGroupedDataset(torchdata.IterableDataset):
    """Batches of `batch_size` samples of one orientation (width > height, or not), from an iterable of
    samples with "width" and "height": a batch of one orientation pads less (Detectron2's grouping).
    Yields lists of samples."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self) -> Iterator[list[Any]]:
        buckets: list[list[Any]] = [[], []]
        for sample in self.dataset:
            try:
                bucket = buckets[0 if sample["width"] > sample["height"] else 1]
            except (KeyError, TypeError):
                raise ValueError("AspectRatioGroupedDataset: every sample needs 'width' and 'height' (or turn "
                                 "DATALOADER.ASPECT_RATIO_GROUPING off)") from None
            bucket.append(sample)
            if len(bucket) == self.batch_size:
                yield bucket[:]
                del bucket[:]


def single_device_batch_size(total_batch_size: int, num_devices: int, world: int | None = None) -> int:
    """Samples per device for a global batch over `num_devices` devices in each of `world`
    processes (SOLVER.IMS_PER_BATCH / every device; `world` defaults to the world size).

    Raises:
        ValueError: the global batch does not split evenly over every device.
    """
    world = comm.get_world_size() if world is None else world
    every = num_devices * world
    if total_batch_size < every or total_batch_size % every:
        raise ValueError(f"SOLVER.IMS_PER_BATCH={total_batch_size} must be a multiple of the {every} devices "
                         f"({world} processes x {num_devices} devices) that share it, e.g. "
                         f"{max(every, total_batch_size // every * every)}")
    return total_batch_size // every


def build_train_loader(dataset: Any, mapper: Callable[[Any], Any] | None = None, total_batch_size: int = 16,
                       sampler: Any = None, aspect_ratio_grouping: bool = False, num_workers: int = 0,
                       seed: int = 0, num_devices: int = 1) -> torchdata.DataLoader:
    """An infinite loader of this process's share of each global batch (`total_batch_size` over every
    device of every process; checked by `single_device_batch_size`), each a `collate`d batch of
    `mapper(sample)`s, as Detectron2's `build_detection_train_loader`. `dataset` is a list (of dicts)
    or a map-style dataset; `sampler` defaults to a `TrainingSampler` seeded with `seed`."""
    per_device = single_device_batch_size(total_batch_size, num_devices)
    per_process, batch = per_device * num_devices, functools.partial(collate, samples_per_device=per_device)
    if isinstance(dataset, list):
        dataset = DatasetFromList(dataset)
    if mapper is not None:
        dataset = MapDataset(dataset, mapper)
    sampler = TrainingSampler(len(dataset), seed=seed) if sampler is None else sampler
    iterable = ToIterableDataset(dataset, sampler)
    if aspect_ratio_grouping:
        grouped = AspectRatioGroupedDataset(iterable, per_process)
        return torchdata.DataLoader(grouped, batch_size=None, num_workers=num_workers, collate_fn=batch)
    return torchdata.DataLoader(iterable, batch_size=per_process, num_workers=num_workers, drop_last=True,
                                collate_fn=batch)


def build_test_loader(dataset: Any, mapper: Callable[[Any], Any] | None = None, batch_size: int = 1,
                      num_workers: int = 0) -> torchdata.DataLoader:
    """This process's contiguous part of `dataset` (`InferenceSampler`), every sample once, in batches
    of `batch_size` (the last may be smaller), as Detectron2's `build_detection_test_loader`."""
    if isinstance(dataset, list):
        dataset = DatasetFromList(dataset)
    if mapper is not None:
        dataset = MapDataset(dataset, mapper)
    return torchdata.DataLoader(dataset, batch_size=batch_size, sampler=InferenceSampler(len(dataset)),
                                num_workers=num_workers, collate_fn=collate)
