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
several processes, `TrainingSampler` / `InferenceSampler` (Detectron2's, sharded by rank).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphpar.core.naming import BATCH_WEIGHT, device_scoped
from graphpar.runtime import workspace

__all__ = ["ArrayLoader", "DataContainer", "DeviceFeeder", "EpochSampler", "Fed",  # noqa: F822
           "InferenceSampler", "Prepared", "chunk_sizes", "collate", "feed", "feed_batch", "flatten", "gather",
           "TrainingSampler", "minibatches", "prepare", "scatter", "split_batch"]


def __getattr__(name: str) -> Any:
    if name == "DeviceFeeder":  # imported on first use: it needs threads and torch
        from graphpar.training.feeder import DeviceFeeder

        return DeviceFeeder
    raise AttributeError(f"module 'graphpar.data' has no attribute {name!r}")


# ---- leaves ----------------------------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist before torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: Any) -> bool:
    """A leaf that is split along the batch axis: a numpy array or tensor with at least one axis."""
    return (isinstance(value, np.ndarray) or _is_tensor(value)) and value.ndim > 0


def _take(value: Any, dim: int, start: int, stop: int) -> Any:
    if isinstance(value, np.ndarray):
        return value[(slice(None),) * dim + (slice(start, stop),)]
    return value.narrow(dim, start, stop - start)


@dataclass
class DataContainer:
    """A field of a batch with its own feeding rules, as MMCV's `DataContainer`.

    Args:
        data: an array / tensor (or, after `collate`, a list with one entry per device chunk).
        stack: `collate` pads the samples to a common shape and stacks them into one array per chunk;
            otherwise it keeps a list of the samples per chunk.
        padding_value: the value padding fills with.
        pad_dims: how many trailing axes are padded to the largest sample of the chunk (None: none,
            the samples must have equal shapes).
        cpu_only: kept on the host: never fed as a blob; `feed` hands it to the caller per device
            (for hooks and Python ops), e.g. image metadata.
    """

    data: Any
    stack: bool = False
    padding_value: float = 0
    cpu_only: bool = False
    pad_dims: int | None = 2

    def __post_init__(self) -> None:
        if self.pad_dims not in (None, 1, 2, 3):
            raise ValueError(f"DataContainer: pad_dims must be None, 1, 2 or 3, got {self.pad_dims!r}")

    @property
    def fed(self) -> bool:
        """Whether `feed` writes it as a blob (stacked arrays that are not cpu_only)."""
        return self.stack and not self.cpu_only


# ---- chunk sizes and scatter -----------------------------------------------------------------------


def chunk_sizes(n: int, num_devices: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Rows per device: `sizes` checked, or n // N + (i < n % N) for device position i.

    Raises:
        ValueError: `num_devices` is not a positive int; `sizes` has the wrong length, a size < 1 or a
            sum other than n; or n < N (a device would get no rows: an empty batch trains nothing
            and would bias the gradient towards the others).
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int (the device count), got {num_devices!r}")
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != num_devices or min(sizes) < 1 or sum(sizes) != n:
            raise ValueError(f"chunk sizes {sizes} must be {num_devices} sizes >= 1 that add up to the batch "
                             f"of {n}")
        return sizes
    if n < num_devices:
        raise ValueError(f"a batch of {n} rows cannot give each of {num_devices} devices at least one row; "
                         f"use a batch of at least {num_devices} (drop_last=True in the DataLoader drops a "
                         f"short last batch)")
    return [n // num_devices + (i < n % num_devices) for i in range(num_devices)]


def flatten(batch: Any, prefix: str = "") -> dict[str, Any]:
    """{blob name: leaf} of a nested batch: dict keys joined by '_', list/tuple items by their index.

    Raises:
        ValueError: two paths give the same name ({"a_b": x, "a": {"b": y}}), or a key is not a
            non-empty str without '/'.
    """
    out: dict[str, Any] = {}

    def visit(value: Any, name: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                if not isinstance(key, str) or not key or "/" in key:
                    raise ValueError(f"batch key {key!r} under {name or 'the top'} must be a non-empty str "
                                     f"without '/' (it becomes part of a blob name)")
                visit(item, f"{name}_{key}" if name else key)
        elif isinstance(value, (list, tuple)) and value and not isinstance(value, str):
            for k, item in enumerate(value):
                visit(item, f"{name}_{k}" if name else str(k))
        else:
            if name in out:
                raise ValueError(f"two fields of the batch both become blob {name!r}; rename one")
            out[name] = value

    visit(batch, prefix)
    return out


def _batch_size(batch: Any, dim: int) -> int | None:
    """The common size of axis `dim` of the array leaves (None if there are none).

    Raises:
        ValueError: leaves of different sizes (naming them), or an array leaf with too few axes.
    """
    sizes: dict[str, int] = {}
    for name, leaf in _arrays(_unwrap_for_size(batch), "batch"):
        if leaf.ndim <= dim:
            raise ValueError(f"batch field {name} of shape {tuple(leaf.shape)} has no axis {dim} to split")
        sizes[name] = int(leaf.shape[dim])
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the fields of a batch must have the same batch size (axis {dim}), got {sizes}; "
                         f"fix the loader so every field has one row per sample")
    return next(iter(sizes.values()), None)


def _arrays(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) of every array leaf, paths like batch['meta'][0] (any keys: scatter takes them)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _arrays(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            yield from _arrays(item, f"{path}[{k}]")
    elif _is_array(value):
        yield path, value


def _unwrap_for_size(batch: Any) -> Any:
    """The batch with DataContainers holding one array replaced by it (collated ones, split by
    chunk already, and cpu_only ones are left out of the size check)."""
    if isinstance(batch, DataContainer):
        return batch.data if batch.fed and not isinstance(batch.data, list) else None
    if isinstance(batch, Mapping):
        return {k: _unwrap_for_size(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [_unwrap_for_size(v) for v in batch]
    return batch


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def scatter(batch: Any, num_devices: int, dim: int = 0, sizes: Sequence[int] | None = None) -> list[Any]:
    """Split a nested batch into one structure per device, as `torch.nn.parallel.scatter` does.

    dicts, lists, tuples and namedtuples are rebuilt per device with their own type; arrays and
    tensors are split along `dim` into views (see `chunk_sizes`); other leaves are shared by every
    device. A `DataContainer` whose `data` is a list (from `collate`) gives device i its item i (a
    list of L > N chunks: ceil(L / N) consecutive chunks per device, as MMCV's scatter); one holding
    an array is split like an array. The result keeps DataContainers (with per-device
    data) so `feed` can tell which fields stay on the host.

    Raises:
        ValueError: see `chunk_sizes`; array leaves of different batch sizes; a collated
            DataContainer with fewer chunks than devices, or grouped so that a device gets none.
    """
    n = _batch_size(batch, dim)
    if n is None:  # nothing to split by rows (collated DataContainers are split by chunk)
        chunk_sizes(num_devices, num_devices)  # checks num_devices
        bounds: list[int] = []
    else:
        bounds = np.cumsum([0, *chunk_sizes(n, num_devices, sizes)]).tolist()

    def split(value: Any) -> list[Any]:
        if isinstance(value, DataContainer):
            if isinstance(value.data, list):
                parts = _group_chunks(value, num_devices)
            else:
                parts = split(value.data)
            return [DataContainer(p, value.stack, value.padding_value, value.cpu_only, value.pad_dims)
                    for p in parts]
        if _is_array(value):
            return [_take(value, dim, bounds[i], bounds[i + 1]) for i in range(num_devices)]
        if isinstance(value, Mapping) and value:
            columns = {k: split(v) for k, v in value.items()}
            return [type(value)((k, columns[k][i]) for k in value) for i in range(num_devices)]
        if _is_namedtuple(value):
            columns = [split(v) for v in value]
            return [type(value)(*(c[i] for c in columns)) for i in range(num_devices)]
        if isinstance(value, (list, tuple)) and value:
            columns = [split(v) for v in value]
            return [type(value)(c[i] for c in columns) for i in range(num_devices)]
        return [value for _ in range(num_devices)]

    return split(batch)


def _group_chunks(container: DataContainer, num_devices: int) -> list[Any]:
    """A collated DataContainer's chunks per device: one each, or, as MMCV's scatter of a list longer
    than the device count, ceil(L / N) consecutive chunks per device, merged (lists joined; stacked
    chunks re-padded to the group's largest sample and stacked)."""
    chunks = container.data
    if len(chunks) == num_devices:
        return chunks
    per = -(-len(chunks) // num_devices)
    groups = [chunks[i * per:(i + 1) * per] for i in range(num_devices)]
    if len(chunks) < num_devices or not groups[-1]:
        raise ValueError(f"a collated DataContainer has {len(chunks)} chunks for {num_devices} devices: grouped "
                         f"{per} per device, device {next(i for i, g in enumerate(groups) if not g)} would get "
                         f"none; collate with samples_per_device = batch / devices")
    if not container.stack:
        return [[sample for chunk in group for sample in chunk] for group in groups]
    return [_pad_and_stack([sample for chunk in group for sample in chunk], container.padding_value,
                           container.pad_dims) for group in groups]


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


@dataclass
class Prepared:
    """A batch scattered and checked for one model's devices, ready to feed (`prepare`'s result, a
    `DeviceFeeder`'s items). `blobs[i]`: device i's {scoped blob name: value}. `ready[i]`, when set,
    is an event that `feed` makes device i's current stream wait for (a host-to-device copy on a
    side stream, through `copier`) before it feeds that device."""

    devices: tuple[int, ...]
    prefix: str
    blobs: list[dict[str, Any]]
    names: list[str]
    rows: list[int]
    host: list[dict[str, Any]]
    ready: list[Any] | None = None
    copier: Any = None
    device: list[dict[str, list[Any]]] = field(default_factory=list)


def prepare(model: Any, batch: Any, dim: int = 0, sizes: Sequence[int] | None = None) -> Prepared:
    """Everything `feed` does but writing: scatter `batch` over the model's devices and check it.

    Touches no workspace, so a `DeviceFeeder` runs it on its own thread. Raises as `feed`.
    """
    devices = model.GetDevices()
    if isinstance(batch, (list, tuple)):
        raise ValueError(_unnamed(model, batch))
    count = len(devices)
    allowed = bool(getattr(getattr(getattr(model, "_parallel", None), "options", None), "uneven_batches", False))
    n = _batch_size(batch, dim)
    if n == 0:
        raise ValueError(_EMPTY.format(what="has no rows"))
    if n is not None and sizes is None and n % count and not allowed:
        raise ValueError(f"feed: a batch of {n} cannot be split evenly over {count} devices; use a batch size "
                         f"that is a multiple of {count} (drop_last=True drops a short last batch), or "
                         f"Parallelize(..., uneven_batches=True) to weight each device's loss by its rows")
    blobs: list[dict[str, Any]] = []
    host: list[dict[str, Any]] = []
    ragged: list[dict[str, list[Any]]] = []
    for d, chunk in zip(devices, scatter(batch, count, dim, sizes)):
        fed, kept, lists = {}, {}, {}
        for name, leaf in flatten(chunk).items():
            target = fed if _feedable(leaf) else kept
            target[name] = leaf.data if isinstance(leaf, DataContainer) else leaf
            if _ragged(leaf):
                lists[name] = _on_device(leaf.data, model._device_prefix, d, name)
        blobs.append(fed)
        host.append(kept)
        ragged.append(lists)
    if not blobs[0]:
        raise ValueError(_EMPTY.format(what="has no array to feed"))
    rows = [_rows(per_device, dim) for per_device in blobs]
    if min(rows) == 0:
        raise ValueError(_EMPTY.format(what=f"gives a device no rows (rows per device: {rows})"))
    total = sum(rows)
    if len(set(rows)) > 1 and not allowed:
        raise ValueError(f"feed: rows per device {rows} differ; Parallelize(..., uneven_batches=True) is needed "
                         f"so each device's loss is weighted by its rows (or give every device {total // count})")
    prefix = model._device_prefix
    scoped = [{device_scoped(prefix, d, name): value for name, value in per_device.items()}
              for d, per_device in zip(devices, blobs)]
    if allowed:
        for d, r, per_device in zip(devices, rows, scoped):
            per_device[device_scoped(prefix, d, BATCH_WEIGHT)] = np.float32(count * r / total)
    return Prepared(tuple(devices), prefix, scoped, list(blobs[0]), rows, host, device=ragged)


def _ragged(leaf: Any) -> bool:
    """A DataContainer(stack=False), not cpu_only, holding a list of arrays: goes to its device as a list."""
    return (isinstance(leaf, DataContainer) and not leaf.stack and not leaf.cpu_only
            and isinstance(leaf.data, list) and all(isinstance(x, np.ndarray) or _is_tensor(x) for x in leaf.data))


def _on_device(samples: list[Any], prefix: str, device_id: int, name: str) -> list[Any]:
    """Each sample as a torch tensor on the torch device of replica `{prefix}_{device_id}` (a tensor
    already there is kept as it is)."""
    import torch

    from graphpar.core.ir import CPU, CUDA, DeviceOption
    from graphpar.platform.devices import torch_device

    target = torch_device(DeviceOption(CUDA if prefix == "gpu" else CPU, device_id))
    return [torch.as_tensor(sample).to(target) for sample in samples]


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


def _unnamed(model: Any, batch: Sequence[Any]) -> str:
    """The error for a batch that is a bare tuple or list: it shows the dict form with the model's inputs."""
    names = _inputs_of(model)
    keys = names if len(names) == len(batch) else [f"name{k}" for k in range(len(batch))]
    example = ", ".join(f"{key!r}: batch[{k}]" for k, key in enumerate(keys))
    reads = f" (the model reads {', '.join(map(repr, names))})" if names else ""
    return (f"feed: the batch is a {type(batch).__name__} of {len(batch)} fields, which have no blob names; pass a "
            f"dict keyed by blob name{reads}: feed(model, {{{example}}}), e.g. for a DataLoader over a "
            f"TensorDataset: for x, y in loader: feed(model, {{'data': x, 'label': y}})")


def _inputs_of(model: Any) -> list[str]:
    """The unscoped names of what a batch feeds: the blobs the first replica reads that are not params
    and that no init net or op of the net creates (best effort: [] when the model has no nets)."""
    try:
        scope = device_scoped(model._device_prefix, model.GetDevices()[0], "")
        nets = [model.param_init_net.Proto(), model.net.Proto()]
        created = {b for net in nets for op in net.ops for b in op.outputs}
        params = {str(p) for p in model.GetParams()}
        return [b[len(scope):] for b in model.net.Proto().external_inputs
                if b.startswith(scope) and b not in created and b not in params and b[len(scope):] != BATCH_WEIGHT]
    except Exception:  # noqa: BLE001 - only a hint for an error message
        return []


_EMPTY = ("feed: the batch {what}; an empty batch trains nothing, and on one replica it would bias the "
          "gradient towards the others: drop it in the loader (drop_last=True, or filter empty batches)")


def _rows(blobs: Mapping[str, Any], dim: int) -> int:
    sizes = {name: int(value.shape[dim]) for name, value in blobs.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the fields of a batch must have the same batch size (axis {dim}), got {sizes}; "
                         f"fix the loader so every field has one row per sample")
    return next(iter(sizes.values()))


def _feedable(leaf: Any) -> bool:
    if isinstance(leaf, DataContainer):
        return leaf.fed and _is_array(leaf.data)
    return _is_array(leaf)


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
    single = isinstance(names, str)
    target = None if output_device is None else _output_device(model, output_device)
    out = {}
    for name in [names] if single else list(names):
        scoped = [device_scoped(model._device_prefix, d, name) for d in devices]
        if target is None:
            parts = [workspace.FetchBlob(n) for n in scoped]
            out[name] = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts, axis=dim)
        else:
            import torch

            tensors = [workspace.FetchTensor(n).to(target) for n in scoped]
            out[name] = torch.stack(tensors) if tensors[0].ndim == 0 else torch.cat(tensors, dim=dim)
    return out[names] if single else out


def _output_device(model: Any, output_device: int | str) -> Any:
    import torch

    from graphpar.core.ir import CPU, CUDA, DeviceOption
    from graphpar.platform.devices import torch_device

    if output_device in (-1, "cpu"):
        return torch.device("cpu")
    if isinstance(output_device, bool) or output_device not in model.GetDevices():
        raise ValueError(f"gather: output_device must be None (numpy on the host), -1 or 'cpu', or one of the "
                         f"model's devices {model._device_prefix}_{model.GetDevices()}, got {output_device!r}")
    return torch_device(DeviceOption(CUDA if model._device_prefix == "gpu" else CPU, output_device))


# ---- collate ---------------------------------------------------------------------------------------


def collate(samples: Sequence[Any], samples_per_device: int = 1) -> Any:
    """Batch a list of samples (dicts / tuples of arrays, numbers, DataContainers), as MMCV's collate.

    Plain arrays and numbers are stacked (np.stack: equal shapes). A `DataContainer` field becomes one
    DataContainer whose `data` has one entry per device chunk of `samples_per_device` samples: with
    `stack`, the chunk's samples padded with `padding_value` on their last `pad_dims` axes to the
    largest of the chunk, then stacked; otherwise the list of samples. Other leaves (str, None, ...)
    become a list. `scatter` / `feed` give chunk i to device i.

    Raises:
        ValueError: no samples, samples_per_device < 1, samples whose structures differ, stacked
            samples whose unpadded axes differ.
    """
    if not samples:
        raise ValueError("collate: no samples")
    if isinstance(samples_per_device, bool) or not isinstance(samples_per_device, int) or samples_per_device < 1:
        raise ValueError(f"collate: samples_per_device must be a positive int, got {samples_per_device!r}")
    first = samples[0]
    if isinstance(first, DataContainer):
        chunks = [samples[i:i + samples_per_device] for i in range(0, len(samples), samples_per_device)]
        if first.stack:
            data = [_pad_and_stack([s.data for s in chunk], first.padding_value, first.pad_dims) for chunk in chunks]
        else:
            data = [[s.data for s in chunk] for chunk in chunks]
        return DataContainer(data, first.stack, first.padding_value, first.cpu_only, first.pad_dims)
    if isinstance(first, Mapping):
        if any(not isinstance(s, Mapping) or s.keys() != first.keys() for s in samples):
            raise ValueError(f"collate: every sample must have the keys {list(first)}")
        return type(first)((k, collate([s[k] for s in samples], samples_per_device)) for k in first)
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        if any(len(s) != len(first) for s in samples):
            raise ValueError("collate: samples of different lengths")
        columns = [collate([s[k] for s in samples], samples_per_device) for k in range(len(first))]
        return type(first)(*columns) if _is_namedtuple(first) else type(first)(columns)
    if _is_tensor(first):
        import torch

        return torch.stack(list(samples))
    if isinstance(first, (np.ndarray, np.generic, int, float, bool)):
        return np.stack([np.asarray(s) for s in samples])
    return list(samples)


def _pad_and_stack(arrays: list[Any], value: float, pad_dims: int | None) -> Any:
    tensors = _is_tensor(arrays[0])
    shapes = [tuple(a.shape) for a in arrays]
    keep = len(shapes[0]) - (pad_dims or 0)
    if any(len(s) != len(shapes[0]) or s[:keep] != shapes[0][:keep] for s in shapes):
        raise ValueError(f"collate: stacked samples of shapes {shapes} differ outside the last {pad_dims or 0} "
                         f"padded axes")
    target = tuple(max(s[k] for s in shapes) for k in range(len(shapes[0])))
    if tensors:
        out = arrays[0].new_full((len(arrays), *target), value)
    else:
        out = np.full((len(arrays), *target), value, dtype=np.asarray(arrays[0]).dtype)
    for k, a in enumerate(arrays):
        out[(k, *(slice(0, d) for d in a.shape))] = a
    return out


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
