"""Feeding batches to a data-parallel model: scatter nested batches over the devices, feed them, gather outputs.

The rules (docs/feeding.md has the long form):

- *Leaves.* numpy arrays and torch tensors with a batch axis are split along `dim`; every other leaf
  (str, number, None, metadata dicts of those, 0-d arrays) is replicated: each device gets the same
  object, as `torch.nn.parallel.scatter` does. A `DataContainer` is split by its own rules.
- *Chunk sizes.* A batch of n rows over N devices gives device i `n // N + (i < n % N)` rows (the
  first `n % N` devices one more), or the sizes passed. Every array leaf must have the same n.
- *Feeding.* Blob names come from the keys: `{"img": x, "meta": {"boxes": b}}` feeds `img` and
  `meta_boxes`; list and tuple items add their index (`boxes_0`). `feed` writes `{prefix}_{id}/{name}`.
  A batch is therefore a dict keyed by blob name: a bare tuple or list (a `TensorDataset`'s `(x, y)`)
  names nothing and is refused, with the dict form in the message.
  Leaves that are not arrays are not fed; `feed` hands them back per device (`Fed.host`).
- *Uneven chunks* are refused, naming the fix, unless the model was parallelized with
  `uneven_batches=True`; then each device's loss gradient is weighted by its real share.
  Empty chunks and arrays of different batch sizes are always refused.

Samplers and a loader: `EpochSampler` (one seeded permutation per epoch), `ArrayLoader`, and, for
several processes, `TrainingSampler` / `InferenceSampler` (Detectron2's, sharded by rank). Splitting and
checking a batch (`scatter`, `prepare`, `collate`, `DataContainer`) lives in `graphpar.training.batches`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphpar.core.naming import device_scoped
from graphpar.runtime import workspace
from graphpar.training.batches import (
    DataContainer,
    Prepared,
    _is_tensor,
    chunk_sizes,
    collate,
    flatten,
    pad_to_devices,
    prepare,
    scatter,
)
from graphpar.training.feeder import DeviceFeeder

__all__ = ["ArrayLoader", "DataContainer", "DeviceFeeder", "EpochSampler", "Fed",
           "InferenceSampler", "Prepared", "chunk_sizes", "collate", "feed", "feed_batch", "flatten", "gather",
           "TrainingSampler", "minibatches", "pad_to_devices", "prepare", "scatter", "split_batch"]


# ---- feeding ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fed:
    """What `feed` did: the unscoped blob names it wrote, the rows per device, per device the leaves
    it did not feed (cpu_only DataContainers, metadata) under their flattened names (`host`), and
    per device its ragged fields (`DataContainer(stack=False)`, not cpu_only) as lists of tensors on
    that device (`device`: what a Python op or a hook such as `trainer.last_fed` reads)."""

    names: list[str]
    sizes: list[int]
    host: list[dict[str, Any]]
    device: list[dict[str, list[Any]]] = field(default_factory=list)


def feed(model: Any, batch: Any, dim: int = 0, sizes: Sequence[int] | None = None) -> Fed:
    """Scatter `batch` over the model's devices and feed each device its chunk as `{prefix}_{id}/{name}`.

    Device i of `model.GetDevices()` gets the i-th chunk; names follow `flatten`. Everything is
    checked before the first blob is written, so a batch that is refused feeds nothing. With
    `Parallelize(uneven_batches=True)` it also feeds each replica's `_batch_weight` (N·n_d/n).
    `batch` may be a `Prepared` one (from `prepare` or a `DeviceFeeder`) for this model. A contiguous
    chunk of a tensor already on its replica's GPU is stored without a copy (the blob aliases the
    caller's tensor, as MMCV's scatter); everything else is copied, as `FeedBlob` does.

    Raises:
        RuntimeError: the model was not parallelized.
        ValueError: an empty batch (no rows, a device without rows, or no array to feed); fields
            of different batch sizes; chunks of different sizes when the model does not allow them
            (the message names the fixes); see `chunk_sizes`; a batch prepared for other devices.
        TypeError: a value cannot be fed (see workspace.FeedBlob).
    """
    if not isinstance(batch, Prepared):
        batch = prepare(model, batch, dim, sizes)
    elif batch.devices != tuple(model.GetDevices()) or batch.prefix != model._device_prefix:
        raise ValueError(f"feed: the batch was prepared for devices {batch.prefix}_{list(batch.devices)}, not this "
                         f"model's {model._device_prefix}_{model.GetDevices()}; give the DeviceFeeder this model")
    if batch.ready is not None:
        for d, event, per_device in zip(batch.devices, batch.ready, batch.blobs):
            batch.copier.wait(d, event, per_device.values())
    _feed_all([item for per_device in batch.blobs for item in per_device.items()])
    return Fed(batch.names, batch.rows, batch.host, batch.device)


def _feed_all(prepared: list[tuple[str, Any]]) -> None:
    """Feed every (name, value); if one fails, restore what was there before (nothing changes). A tensor
    already on its blob's GPU is stored as it is (`Workspace.feed_blob(alias=True)`)."""
    ws = workspace.get_workspace()
    before = {name: ws.blobs.get(name) for name, _ in prepared}
    try:
        for name, value in prepared:
            ws.feed_blob(name, value, alias=True)
    except BaseException:
        for name, old in before.items():
            if old is None:
                ws.blobs.pop(name, None)
            else:
                ws.blobs[name] = old
        raise


def feed_batch(model: Any, blobs: Mapping[str, np.ndarray]) -> None:
    """Feed each unscoped blob (e.g. {"data": x, "label": y}) to every replica of a parallelized model.

    Device i of `model._devices` gets the i-th contiguous chunk of the batch, so N devices together
    see exactly the batch one device would. `feed` with a flat mapping; nothing is fed if it raises.

    Raises:
        RuntimeError: the model was not parallelized (see ModelHelper.GetDevices).
        ValueError: an empty batch (zero rows), blobs with different batch sizes, or a batch size
            that is not a multiple of the device count (without uneven_batches); see `feed`.
        TypeError: a value cannot be fed (see workspace.FeedBlob).
    """
    feed(model, {name: np.asarray(value) if not _is_tensor(value) else value for name, value in blobs.items()})


def gather(model: Any, names: str | Sequence[str], dim: int = 0, output_device: int | str | None = None) -> Any:
    """Concatenate each named output of every replica along `dim`, in device order.

    0-d outputs (a loss per replica) are stacked into a vector, one value per device, as
    `DataParallel`'s gather does. `names` is one unscoped name (returns one result) or a list (returns
    {name: result}). `output_device`, as DataParallel's: None (default) gives numpy arrays on the host;
    a device id of the model's kind gives a torch tensor on that device (`gpu_1` -> cuda:1; a CPU
    model's ids are all the CPU), and -1 or "cpu" a torch tensor on the CPU. The result is a new
    tensor, not a view of a blob.

    Raises:
        RuntimeError: the model was not parallelized. MissingBlobError: a replica lacks the blob.
        ValueError: an output_device that is not None, -1, "cpu" or one of the model's device ids.
    """
    devices = model.GetDevices()
    target = None if output_device is None else _output_device(model, output_device)
    out: dict[str, Any] = {}
    wanted: list[str] = [names] if isinstance(names, str) else list(names)
    for name in wanted:
        scoped = [device_scoped(model._device_prefix, d, name) for d in devices]
        if target is None:
            parts = [workspace.FetchBlob(n) for n in scoped]
            out[name] = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts, axis=dim)
        else:
            import torch

            tensors = [workspace.FetchTensor(n).to(target) for n in scoped]
            out[name] = torch.stack(tensors) if tensors[0].ndim == 0 else torch.cat(tensors, dim=dim)
    return out[names] if isinstance(names, str) else out


def _output_device(model: Any, output_device: int | str) -> Any:
    import torch

    from graphpar.core.ir import CPU, CUDA, DeviceOption
    from graphpar.platform.devices import torch_device

    if output_device in (-1, "cpu"):
        return torch.device("cpu")
    if isinstance(output_device, bool) or output_device not in model.GetDevices():
        raise ValueError(f"gather: output_device must be None (numpy on the host), -1 or 'cpu', or one of the "
                         f"model's devices {model._device_prefix}_{model.GetDevices()}, got {output_device!r}")
    return torch_device(DeviceOption(CUDA if model._device_prefix == "gpu" else CPU, int(output_device)))


# ---- samplers and a loader for arrays ---------------------------------------------------------------


class EpochSampler:
    """The indices of `size` samples, one pass per iteration: a permutation that depends only on
    `seed` and the epoch (`set_epoch`, which `engine.Trainer` calls), so a resumed run sees the
    same order; in order without `shuffle`. Usable as a `torch.utils.data.DataLoader` sampler."""

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"EpochSampler: size must be an int >= 1, got {size!r}")
        self.size, self.shuffle, self.seed, self.epoch = size, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist())


class ArrayLoader:
    """Batches of in-memory arrays: `{name: array[indices]}` for `batch_size` indices at a time of
    `sampler` (default `EpochSampler(len, shuffle, seed)`); a final partial batch is dropped with
    `drop_last`. Has a length (batches per epoch) and `set_epoch`, as `engine.Trainer` expects.

    Raises:
        ValueError: no arrays, arrays of different lengths, batch_size < 1, or no full batch.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, sampler: Any = None) -> None:
        lengths = {name: len(a) for name, a in arrays.items()}
        if not lengths or len(set(lengths.values())) > 1:
            raise ValueError(f"ArrayLoader: needs arrays of one length, got {lengths}")
        n = next(iter(lengths.values()))
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ArrayLoader: batch_size must be an int >= 1, got {batch_size!r}")
        if drop_last and batch_size > n:
            raise ValueError(f"ArrayLoader: batch_size {batch_size} is larger than the {n} samples; use at most {n}")
        self.arrays, self.batch_size, self.drop_last = dict(arrays), batch_size, drop_last
        self.sampler = sampler if sampler is not None else EpochSampler(n, shuffle, seed)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        order = np.fromiter(self.sampler, dtype=np.int64)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start:start + self.batch_size]
            yield {name: a[index] for name, a in self.arrays.items()}


# ---- minibatch indices -----------------------------------------------------------------------------


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
    from graphpar.parallel import launch

    rank = launch.get_rank() if rank is None else rank
    world = launch.get_world_size() if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"a sampler needs world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")
    return rank, world


class TrainingSampler:
    """Detectron2's infinite training sampler: every process draws the same seeded stream of epochs
    (each a permutation of `range(size)` when `shuffle`, else in order) and takes every `world`-th
    index starting at its `rank`, so the shards' indices are disjoint and together cover each epoch.
    All shards must use the same `seed`; `seed=None` (Detectron2's default) is one random seed that
    the processes agree on (`comm.shared_random_seed`, a collective: every process builds its sampler
    at the same point).

    Raises:
        ValueError: size < 1; a bad rank or world; `seed=None` with `world` > 1 but no group of that
            many processes to agree with (pass the same `seed` everywhere instead).
    """

    def __init__(self, size: int, shuffle: bool = True, seed: int | None = 0, rank: int | None = None,
                 world: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"TrainingSampler: size must be >= 1, got {size}")
        self.size, self.shuffle = size, shuffle
        self.rank, self.world = _shard_of(rank, world)
        if seed is None:
            from graphpar.parallel import comm, launch

            if self.world != launch.get_world_size():
                raise ValueError(f"TrainingSampler(seed=None): world={self.world} processes cannot agree on a "
                                 f"random seed in a group of {launch.get_world_size()}; pass seed= (the same "
                                 f"on every process)")
            seed = comm.shared_random_seed()
        self.seed = seed

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
