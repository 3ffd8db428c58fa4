"""The GPU balance warning (`devices.check_balance`, DataParallel's `_check_balance`), with device
properties monkeypatched: no GPU is needed."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from graphpar import data_parallel_model as dpm
from graphpar.devices import check_balance
from graphpar.model_helper import ModelHelper

GIB = 1 << 30


def _props(monkeypatch, table: dict[int, tuple[int, int]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=table[d][0], multi_processor_count=table[d][1]))


def test_memory_imbalance_names_the_smaller_device(monkeypatch):
    _props(monkeypatch, {0: (80 * GIB, 132), 1: (80 * GIB, 132), 2: (40 * GIB, 132)})
    with pytest.warns(UserWarning, match="GPU 2 has less than 75% of the memory of GPU 0.*leave GPU 2 out"):
        assert check_balance([0, 1, 2])


def test_core_imbalance_is_checked_when_memory_is_balanced(monkeypatch):
    _props(monkeypatch, {0: (16 * GIB, 80), 1: (16 * GIB, 40)})
    with pytest.warns(UserWarning, match="GPU 1 has less than 75% of the cores of GPU 0"):
        assert check_balance([0, 1])


def test_balanced_or_single_devices_do_not_warn(monkeypatch):
    _props(monkeypatch, {0: (80 * GIB, 132), 1: (61 * GIB, 100), 3: (80 * GIB, 132)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_balance([0, 1, 3])  # 61/80 and 100/132 are above 75%
        assert not check_balance([0])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert not check_balance([0, 1])  # no properties to read (a CPU-only torch)


def test_parallelize_on_cuda_devices_runs_the_check(monkeypatch):
    _props(monkeypatch, {0: (80 * GIB, 132), 1: (24 * GIB, 132)})
    monkeypatch.setattr(dpm, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(dpm, "can_access_peer", lambda root, peer: True)
    model = ModelHelper(name="balance_check", init_params=False)
    with pytest.warns(UserWarning, match="GPU 1 has less than 75% of the memory of GPU 0"):
        dpm.Parallelize(model, input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=lambda m, scale: [m.net.Relu("x", "y")], devices=[0, 1])
