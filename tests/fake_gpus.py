"""A machine with a given number of GPUs, faked for the tests: torch.cuda's device queries
(`is_available`, `device_count`, `get_device_properties`, `can_device_access_peer`) answer as on that
machine, so code that *inspects* devices can be tested without one. Nothing can run on the fake GPUs.

`GRAPHPAR_FAKE_GPUS=<n>` fakes n GPUs for every test of a pytest run (tests/conftest.py), so the
tests that once failed on a 1-GPU machine are re-run as if on one (tests/test_gpu_counts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from types import SimpleNamespace

import pytest
import torch

GIB = 1 << 30


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, total_memory: int = 80 * GIB, cores: int = 132,
              peer: Callable[[int, int], bool] | None = None) -> None:
    """Make torch.cuda describe `count` identical GPUs (0: a machine without CUDA). Device ids out of
    range raise as torch does; `peer(a, b)` answers `can_device_access_peer` (default: all pairs)."""

    def checked(device: int) -> int:
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= index < count:
            raise AssertionError(f"Invalid device id {index} (fake machine with {count} GPUs)")
        return index

    def properties(device: int) -> SimpleNamespace:
        return SimpleNamespace(name=f"Fake GPU {checked(device)}", total_memory=total_memory,
                               multi_processor_count=cores)

    def can_access(a: int, b: int) -> bool:
        return (peer or (lambda x, y: True))(checked(a), checked(b))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", can_access)
    from graphpar import devices, workspace

    monkeypatch.setattr(workspace, "has_gpu_support", count > 0)  # read from torch when graphpar is imported
    monkeypatch.setattr(workspace, "has_cuda_support", count > 0)

    # a fresh cache of the P2P answers for this machine (the old one comes back after the test)
    monkeypatch.setattr(devices, "_physical_peer_access", cache(devices._physical_peer_access.__wrapped__))
