"""Where logical devices live: `DeviceOption(CUDA, i)` -> `cuda:i`, or the CPU when simulating.

Set `GRAPHPAR_CUDA_ON_CPU=1` (or use `cuda_on_cpu()`) to place logical CUDA devices on the CPU, so
the GPU code paths of every pass, NCCL ops included (through their reference implementation), run on
machines without GPUs. Semantics are identical; only the placement changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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
