"""Where logical devices live: `DeviceOption(CUDA, i)` -> `cuda:i`, another GPU through a device
map, or the CPU when simulating.

Set `GRAPHPAR_CUDA_ON_CPU=1` (or use `cuda_on_cpu()`) to place logical CUDA devices on the CPU, so
the GPU code paths of every pass, NCCL ops included (through their reference implementation), run on
machines without GPUs. Semantics are identical; only the placement changes.

Set `GRAPHPAR_DEVICE_MAP=0,0,0,0` (or use `device_map([0, 0, 0, 0])`) to place logical CUDA device
i on physical GPU `map[i]`: four replicas then share GPU 0, each with its own streams and events,
and the cross-replica copies, tree all-reduce, inter-device batch norm and DeviceFeeder copies run
for real on one GPU. Code that inspects devices asks this module about *logical* devices
(`num_cuda_devices`, `device_properties`, `can_access_peer`, `check_balance`), so it describes the
map, and, when CUDA is simulated, the CPU, whatever GPUs the machine has.
"""

from __future__ import annotations

import operator
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from graphpar.core.ir import CPU, CUDA, DeviceOption
from graphpar.core.naming import parse_device_scope

_CPU = torch.device("cpu")
_cuda_on_cpu = os.environ.get("GRAPHPAR_CUDA_ON_CPU", "") not in ("", "0")
_UNSET: Any = object()
_map_override: Any = _UNSET  # set by device_map(); _UNSET: read GRAPHPAR_DEVICE_MAP


def cuda_is_simulated() -> bool:
    """True when logical CUDA devices are placed on the CPU."""
    return _cuda_on_cpu


@contextmanager
def cuda_on_cpu(enabled: bool = True) -> Iterator[None]:
    """Within the block, logical CUDA devices run on the CPU (nets must be created inside it)."""
    global _cuda_on_cpu
    old, _cuda_on_cpu = _cuda_on_cpu, enabled
    try:
        yield
    finally:
        _cuda_on_cpu = old


@cache
def _parse_map(text: str) -> tuple[int, ...] | None:
    if not text.strip():
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(re.fullmatch(r"-?[0-9]+", part) for part in parts):  # int() also takes '0_1', '+1', '١'
        raise ValueError(f"GRAPHPAR_DEVICE_MAP={text!r}: expected comma-separated physical GPU ids (digits), one "
                         f"per logical device, e.g. GRAPHPAR_DEVICE_MAP=0,0,0,0")
    return _checked_map(tuple(int(part) for part in parts), f"GRAPHPAR_DEVICE_MAP={text!r}")


def _checked_map(ids: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        if isinstance(ids, (str, bytes)) or any(isinstance(i, (bool, str)) for i in ids):
            raise TypeError
        checked = tuple(operator.index(i) for i in ids)
    except TypeError:
        raise TypeError(f"{what}: a device map is a list of int physical GPU ids, got {ids!r}") from None
    if not checked or min(checked) < 0:
        raise ValueError(f"{what}: a device map needs one physical GPU id >= 0 per logical device, got {list(ids)}")
    return checked


def current_device_map() -> tuple[int, ...] | None:
    """The physical GPU of each logical CUDA device (`device_map()`'s, else GRAPHPAR_DEVICE_MAP's), or None."""
    if _map_override is not _UNSET:
        return _map_override
    return _parse_map(os.environ.get("GRAPHPAR_DEVICE_MAP", ""))


@contextmanager
def device_map(physical: Sequence[int] | None) -> Iterator[None]:
    """Within the block, logical CUDA device i runs on physical GPU `physical[i]` (None: identity).

    Nets are placed when they are created (CreateNet, RunNetOnce) and blobs when they are fed, so
    create, feed and run inside the block. Overrides GRAPHPAR_DEVICE_MAP.
    """
    global _map_override
    new = None if physical is None else _checked_map(physical, "device_map")
    old, _map_override = _map_override, new
    try:
        yield
    finally:
        _map_override = old


def physical_gpu(logical: int) -> int:
    """The physical GPU that logical CUDA device `logical` runs on (the map's entry, else itself)."""
    mapping = current_device_map()
    if mapping is None:
        return logical
    if not 0 <= logical < len(mapping):
        raise RuntimeError(f"CUDA device {logical} is not in the device map {list(mapping)} (logical devices "
                           f"0-{len(mapping) - 1}); use fewer devices or extend GRAPHPAR_DEVICE_MAP / device_map")
    return mapping[logical]


def placement(option: DeviceOption | None) -> torch.device:
    """Where `option` runs on real hardware: `cuda:<physical GPU>` for CUDA, else the CPU (ignores
    simulation; `torch_device` is what kernels use)."""
    if option is None or option.device_type != CUDA:
        return _CPU
    return torch.device("cuda", physical_gpu(option.device_id))


def torch_device(option: DeviceOption | None) -> torch.device:
    """The torch device a DeviceOption maps to (the CPU for logical CUDA devices when simulating)."""
    if option is None or option.device_type != CUDA or _cuda_on_cpu:
        return _CPU
    device = placement(option)
    if current_device_map() is not None and device.index >= _real_gpu_count():
        raise RuntimeError(f"the device map {list(current_device_map() or ())} places CUDA device "
                           f"{option.device_id} on GPU {device.index}, but {_real_gpu_count()} GPU(s) exist")
    return device


def device_option_for_blob(name: str) -> DeviceOption | None:
    """The device implied by a blob's replica scope ('gpu_3/x' -> CUDA 3, 'cpu_1/x' -> CPU), or None."""
    parsed = parse_device_scope(name)
    if parsed is None:
        return None
    prefix, index = parsed
    return DeviceOption(CUDA if prefix == "gpu" else CPU, index)


def _real_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def num_cuda_devices() -> int:
    """Logical CUDA devices: the device map's length, else the real GPUs visible to torch (0 without)."""
    mapping = current_device_map()
    return len(mapping) if mapping is not None else _real_gpu_count()


def shares_a_gpu(device_ids: Sequence[int]) -> bool:
    """Whether two of these logical CUDA devices run on one physical GPU (through the device map)."""
    physical = [physical_gpu(d) for d in device_ids]
    return len(set(physical)) < len(physical)


def device_properties(logical: int) -> Any:
    """`torch.cuda.get_device_properties` of the GPU logical CUDA device `logical` runs on."""
    return torch.cuda.get_device_properties(physical_gpu(logical))


def can_access_peer(root: int, peer: int) -> bool:
    """Whether logical CUDA device `root` may read `peer`'s memory directly (always on one GPU, or
    when CUDA is simulated on the CPU)."""
    if _cuda_on_cpu:
        return True
    return _physical_peer_access(physical_gpu(root), physical_gpu(peer))


@cache
def _physical_peer_access(root: int, peer: int) -> bool:
    return root == peer or bool(torch.cuda.can_device_access_peer(root, peer))


def check_balance(device_ids: Sequence[int], threshold: float = 0.75) -> bool:
    """Warn (as `torch.nn.DataParallel` does) when the CUDA devices differ a lot: one has less than
    `threshold` of the memory, or else of the multiprocessor count, of another. Data parallelism runs
    at the pace of the slowest device. Logical devices on one GPU (device map) or simulated on the
    CPU are balanced. Returns whether it warned.
    """
    if len(device_ids) < 2 or _cuda_on_cpu or not torch.cuda.is_available():
        return False
    props = [device_properties(d) for d in device_ids]
    for what, value in (("memory", lambda p: p.total_memory), ("cores", lambda p: p.multi_processor_count)):
        values = [value(p) for p in props]
        low, high = values.index(min(values)), values.index(max(values))
        if values[low] < threshold * values[high]:
            warnings.warn(
                f"There is an imbalance between your GPUs: GPU {device_ids[low]} has less than "
                f"{threshold:.0%} of the {what} of GPU {device_ids[high]} ({values[low]} vs {values[high]}); "
                f"every step waits for the slowest device. You may want to leave GPU {device_ids[low]} "
                f"out of Parallelize's devices (or of CUDA_VISIBLE_DEVICES).", stacklevel=3)
            return True
    return False
