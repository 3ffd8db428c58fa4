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

import copy
import functools
import itertools
import logging
import pickle
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
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
    """A map-style dataset over a list, as Detectron2's.

    `serialize` (default) pickles every item into one byte buffer (Detectron2's `NumpySerializedList`):
    each `dataset[i]` is a fresh object, a deep copy, so a mapper may edit what it gets in place, and
    DataLoader workers share one buffer instead of touching every item's reference count. Without it,
    `copy` deep-copies each item (`copy.deepcopy`); with neither, the item itself comes back.

    Raises:
        TypeError: an item cannot be pickled (with `serialize`; pass serialize=False).
    """

    def __init__(self, items: Sequence[Any], copy: bool = True, serialize: bool = True) -> None:
        self._copy, self._serialize = copy, bool(serialize)
        self._items: Any = _SerializedList(items) if self._serialize else list(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Any:
        item = self._items[index]
        return copy.deepcopy(item) if self._copy and not self._serialize else item


class _SerializedList:
    """A list kept as its items' pickles, end to end in one uint8 array (item i: bytes ends[i-1]:ends[i])."""

    def __init__(self, items: Sequence[Any]) -> None:
        pickles = []
        for k, item in enumerate(items):
            try:
                pickles.append(np.frombuffer(pickle.dumps(item, protocol=-1), dtype=np.uint8))
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise TypeError(f"DatasetFromList: item {k} cannot be pickled ({exc}); pass serialize=False") from None
        self._ends = np.cumsum([len(p) for p in pickles], dtype=np.int64)
        self._bytes = np.concatenate(pickles) if pickles else np.zeros(0, np.uint8)
        log.debug("DatasetFromList: %d items serialized into %.2f MiB", len(pickles), self._bytes.nbytes / 2**20)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> Any:
        index = range(len(self._ends))[index]  # IndexError as a list's, negative indices too
        start = int(self._ends[index - 1]) if index else 0
        data: Any = self._bytes[start:int(self._ends[index])]  # a uint8 array: a buffer (numpy's stubs do not say so)
        return pickle.loads(memoryview(data))


class MapDataset(torchdata.Dataset):
    """`map_func` over a dataset. A sample it maps to None (a failed read, an image without boxes) is
    replaced by another one, as Detectron2 does: first retried, then a random other index (seeded),
    warning every 3 failures in a row; more than `max_retries` in a row raise. Over an iterable
    dataset, the samples are mapped in order and those mapped to None are left out (Detectron2's).

    Raises:
        ValueError: `max_retries` is not an int >= 1.
        RuntimeError (when read): `max_retries` consecutive samples failed, or every sample did.
    """

    def __new__(cls, dataset: Any, map_func: Callable[[Any], Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(dataset, torchdata.IterableDataset):  # Detectron2: mapped in order, None dropped
            return _MapIterableDataset(dataset, map_func)
        return super().__new__(cls)

    def __init__(self, dataset: Any, map_func: Callable[[Any], Any], max_retries: int = 100, seed: int = 42) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 1:
            raise ValueError(f"MapDataset: max_retries must be an int >= 1 (samples tried in a row before an error), "
                             f"got {max_retries!r}")
        self._dataset, self._map_func, self._max_retries = dataset, map_func, max_retries
        self._rng = random.Random(seed)
        self._fallback = set(range(len(dataset)))

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Any:
        current, tried = int(index), 0
        for tried in range(1, self._max_retries + 1):
            data = self._map_func(self._dataset[current])
            if data is not None:
                self._fallback.add(current)
                return data
            self._fallback.discard(current)
            if tried % 3 == 0:
                log.warning("MapDataset: %d samples in a row failed to map (last index %d); trying another", tried,
                            current)
            if not self._fallback:
                raise RuntimeError(f"MapDataset: every sample of the dataset mapped to None ({tried} tried in a row, "
                                   f"starting at index {index}); the mapper fails on all of them")
            current = self._rng.sample(sorted(self._fallback), k=1)[0]
        raise RuntimeError(f"MapDataset: {tried} samples in a row mapped to None (starting at index {index}; "
                           f"max_retries={self._max_retries}); the mapper fails on every sample it tried")


class _MapIterableDataset(torchdata.IterableDataset):
    """`MapDataset` of an iterable dataset: each sample mapped in order, those mapped to None left out."""

    def __init__(self, dataset: Any, map_func: Callable[[Any], Any]) -> None:
        self._dataset, self._map_func = dataset, map_func

    def __iter__(self) -> Iterator[Any]:
        return (data for data in map(self._map_func, self._dataset) if data is not None)


class ToIterableDataset(torchdata.IterableDataset):
    """An iterable dataset from a map-style `dataset` and a `sampler` of its indices. With DataLoader
    workers (when `shard_sampler`), worker w of K takes the sampler's chunks w, w + K, w + 2K, ... of
    `shard_chunk_size` indices, so the workers together yield each index once; with the chunk the
    DataLoader's batch size, batch k is the sampler's k-th chunk however many workers there are (the
    DataLoader takes batches from the workers in turn), as Detectron2's."""

    def __init__(self, dataset: Any, sampler: Any, shard_sampler: bool = True, shard_chunk_size: int = 1) -> None:
        if isinstance(dataset, torchdata.IterableDataset):
            raise TypeError("ToIterableDataset: the dataset is iterable already")
        if isinstance(shard_chunk_size, bool) or not isinstance(shard_chunk_size, int) or shard_chunk_size < 1:
            raise ValueError(f"ToIterableDataset: shard_chunk_size must be an int >= 1, got {shard_chunk_size!r}")
        self.dataset, self.sampler, self.shard_sampler = dataset, sampler, shard_sampler
        self.shard_chunk_size = shard_chunk_size

    def __iter__(self) -> Iterator[Any]:
        indices: Any = self.sampler
        info = torchdata.get_worker_info()
        if self.shard_sampler and info is not None and info.num_workers > 1:
            indices = _worker_chunks(iter(indices), info.id, info.num_workers, self.shard_chunk_size)
        for index in indices:
            yield self.dataset[index]

    def __len__(self) -> int:
        return len(self.sampler)


def _worker_chunks(indices: Iterator[Any], worker: int, workers: int, chunk: int) -> Iterator[Any]:
    """Worker `worker`'s share of `indices`: chunks worker, worker + workers, ... of `chunk` indices."""
    for k in itertools.count():
        part = list(itertools.islice(indices, chunk))
        if not part:
            return
        if k % workers == worker:
            yield from part


class AspectRatioGroupedDataset(torchdata.IterableDataset):
    """Batches of `batch_size` samples of one orientation (width > height, or not), from an iterable of
    samples with "width" and "height": a batch of one orientation pads less (Detectron2's grouping).
    Yields lists of samples."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"AspectRatioGroupedDataset: batch_size must be an int >= 1, got {batch_size!r}")
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


def build_train_loader(dataset: Any, mapper: Callable[[Any], Any] | None = None, total_batch_size: int | None = None,
                       sampler: Any = None, aspect_ratio_grouping: bool = False, num_workers: int = 0,
                       seed: int | None = 0, num_devices: int = 1, *, collate_fn: Callable[[list], Any] | None = None,
                       drop_last: bool = True, single_gpu_batch_size: int | None = None) -> Any:
    """An infinite loader of this process's share of each global batch, each `collate`d from
    `mapper(sample)`s, as Detectron2's `build_detection_train_loader`.

    The batch: `total_batch_size` over every device of every process (checked by
    `single_device_batch_size`), or `single_gpu_batch_size` samples per device (not both). `dataset`
    is a list (of dicts; serialized, see `DatasetFromList`), a map-style dataset read in the order of
    `sampler` (default a `TrainingSampler` seeded with `seed`; None: a random seed every process shares), or an iterable dataset read as it
    yields (its sampler must be None; it shards itself over processes and workers). `collate_fn`
    turns this process's list of samples into a batch (default `graphpar.data.collate`, split per
    device); `drop_last=False` keeps a short last batch of a finite sampler. The batches do not depend
    on `num_workers` (`ToIterableDataset`'s chunks are the batches).

    Raises:
        ValueError: a batch size missing, given twice or not splitting over the devices; a sampler
            with an iterable dataset; aspect_ratio_grouping with drop_last=False.
    """
    per_device = _batch_size(total_batch_size, single_gpu_batch_size, num_devices)
    per_process = per_device * num_devices
    batch = collate_fn or functools.partial(collate, samples_per_device=per_device)
    if aspect_ratio_grouping and not drop_last:
        raise ValueError("build_train_loader: aspect_ratio_grouping drops incomplete batches; it needs drop_last=True")
    if isinstance(dataset, list):
        dataset = DatasetFromList(dataset, copy=False)
    if mapper is not None:
        dataset = MapDataset(dataset, mapper)
    if isinstance(dataset, torchdata.IterableDataset):
        if sampler is not None:
            raise ValueError("build_train_loader: an iterable dataset yields its samples itself: pass sampler=None")
    else:
        sampler = TrainingSampler(len(dataset), seed=seed) if sampler is None else sampler
        dataset = ToIterableDataset(dataset, sampler, shard_chunk_size=per_process)
    if aspect_ratio_grouping:
        grouped = AspectRatioGroupedDataset(dataset, per_process)
        return torchdata.DataLoader(grouped, batch_size=None, num_workers=num_workers, collate_fn=batch)
    return torchdata.DataLoader(dataset, batch_size=per_process, num_workers=num_workers, drop_last=drop_last,
                                collate_fn=batch)


def _batch_size(total: int | None, per_device: int | None, num_devices: int) -> int:
    """Samples per device from build_train_loader's total_batch_size or single_gpu_batch_size."""
    if (total is None) == (per_device is None):
        raise ValueError(f"build_train_loader: pass total_batch_size (the global batch) or single_gpu_batch_size "
                         f"(per device), exactly one (got {total!r} and {per_device!r})")
    if total is not None:  # per_device is None
        return single_device_batch_size(total, num_devices)
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
        raise ValueError(f"build_train_loader: single_gpu_batch_size must be an int >= 1, got {per_device!r}")
    return per_device


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
