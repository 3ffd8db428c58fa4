"""Nested batches over a model's devices: the leaf rules, `DataContainer`, `collate`, chunk sizes,
`scatter`, and `prepare` (everything `data.feed` does but writing, so a `DeviceFeeder` thread runs it).

`graphpar.data` re-exports every public name here; its docstring (and docs/feeding.md) states the rules.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphpar.core.naming import BATCH_WEIGHT, device_scoped

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
            kind: Any = type(value)  # a dict, OrderedDict, ...: rebuilt as its own type
            by_key = {k: split(v) for k, v in value.items()}
            return [kind((k, by_key[k][i]) for k in value) for i in range(num_devices)]
        if _is_namedtuple(value):
            columns = [split(v) for v in value]
            return [type(value)(*(c[i] for c in columns)) for i in range(num_devices)]
        if isinstance(value, (list, tuple)) and value:
            columns = [split(v) for v in value]
            return [type(value)(c[i] for c in columns) for i in range(num_devices)]
        return [value for _ in range(num_devices)]

    return split(batch)


def pad_to_devices(batch: Any, num_devices: int, dim: int = 0) -> tuple[Any, int | None]:
    """A batch with fewer rows than devices, padded to one row per device, and its own row count.

    Every array (and DataContainer holding one) gets copies of its last row along `dim` until it has
    `num_devices` rows; other leaves stay as they are. A batch with at least `num_devices` rows (or
    none to count) is returned as it is, with None. Device i then holds row i, so the outputs of the
    first `rows` devices are the batch's own (evaluation: `inference_on_dataset`).

    Raises:
        ValueError: array leaves of different batch sizes (see `scatter`).
    """
    n = _batch_size(batch, dim)
    if n is None or n == 0 or n >= num_devices:
        return batch, None

    def pad(value: Any) -> Any:
        if isinstance(value, DataContainer):
            data = value.data if isinstance(value.data, list) else pad(value.data)
            return DataContainer(data, value.stack, value.padding_value, value.cpu_only, value.pad_dims)
        if _is_array(value):
            last = _take(value, dim, n - 1, n)
            copies = [value, *[last] * (num_devices - n)]
            if isinstance(value, np.ndarray):
                return np.concatenate(copies, axis=dim)
            return sys.modules["torch"].cat(copies, dim=dim)
        if isinstance(value, Mapping) and value:
            kind: Any = type(value)
            return kind((k, pad(v)) for k, v in value.items())
        if _is_namedtuple(value):
            return type(value)(*(pad(v) for v in value))
        if isinstance(value, (list, tuple)) and value:
            return type(value)(pad(v) for v in value)
        return value

    return pad(batch), n


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
        fed: dict[str, Any] = {}
        kept: dict[str, Any] = {}
        lists: dict[str, list[Any]] = {}
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
        kind: Any = type(first)
        return kind((k, collate([s[k] for s in samples], samples_per_device)) for k in first)
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
        index = (k, *(slice(0, d) for d in a.shape))  # `out[k, *x]` would be 3.11 syntax
        out[index] = a
    return out
