"""Feeding batches to a data-parallel model: split along the batch axis, one contiguous chunk per device."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from graphpar import workspace
from graphpar.naming import device_scoped


def split_batch(array: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split `array` along axis 0 into `parts` equal contiguous chunks, in device order.

    Raises:
        ValueError: the batch size is not a multiple of `parts`.
    """
    if parts < 1 or len(array) % parts:
        raise ValueError(f"a batch of {len(array)} cannot be split evenly over {parts} devices; "
                         f"use a batch size that is a multiple of {parts}")
    size = len(array) // parts
    return [array[i * size:(i + 1) * size] for i in range(parts)]


def feed_batch(model, blobs: Mapping[str, np.ndarray]) -> None:
    """Feed each unscoped blob (e.g. {"data": x, "label": y}) to every replica of a parallelized model.

    Device i of `model._devices` gets the i-th contiguous chunk of the batch, so N devices together
    see exactly the batch one device would.
    """
    devices = model._devices
    chunks = {name: split_batch(np.asarray(value), len(devices)) for name, value in blobs.items()}
    for name, parts in chunks.items():
        for device_id, part in zip(devices, parts):
            workspace.FeedBlob(device_scoped(model._device_prefix, device_id, name), part)


def minibatches(n: int, batch_size: int, rng: np.random.Generator | None = None,
                drop_last: bool = True) -> Iterator[np.ndarray]:
    """Index arrays of successive minibatches over `n` samples (shuffled when `rng` is given)."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]
