"""Where logical devices live: `DeviceOption(CUDA, i)` -> `cuda:i`, or the CPU when simulating.

Set `GRAPHPAR_CUDA_ON_CPU=1` (or use `cuda_on_cpu()`) to place logical CUDA devices on the CPU, so
the GPU code paths of every pass, NCCL ops included (through their reference implementation), run on
machines without GPUs. Semantics are identical; only the placement changes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from graphpar.core.ir import CPU, CUDA, DeviceOption
from graphpar.naming import parse_device_scope

_CPU = torch.device("cpu")
_cuda_on_cpu = os.environ.get("GRAPHPAR_CUDA_ON_CPU", "") not in ("", "0")


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


def torch_device(option: DeviceOption | None) -> torch.device:
    """The torch device a DeviceOption maps to."""
    if option is None or option.device_type != CUDA or _cuda_on_cpu:
        return _CPU
    return torch.device("cuda", option.device_id)


def device_option_for_blob(name: str) -> DeviceOption | None:
    """The device implied by a blob's replica scope ('gpu_3/x' -> CUDA 3, 'cpu_1/x' -> CPU), or None."""
    parsed = parse_device_scope(name)
    if parsed is None:
        return None
    prefix, index = parsed
    return DeviceOption(CUDA if prefix == "gpu" else CPU, index)


def num_cuda_devices() -> int:
    """Real CUDA devices visible to torch (0 on machines without GPUs)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_balance(device_ids: Sequence[int], threshold: float = 0.75) -> bool:
    """Warn (as `torch.nn.DataParallel` does) when the CUDA devices differ a lot: one has less than
    `threshold` of the memory, or else of the multiprocessor count, of another. Data parallelism runs
    at the pace of the slowest device. Returns whether it warned.
    """
    if len(device_ids) < 2 or not torch.cuda.is_available():
        return False
    props = [torch.cuda.get_device_properties(d) for d in device_ids]
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
