"""Several logical CUDA devices on one physical GPU (`devices.device_map`, GRAPHPAR_DEVICE_MAP).

On the CPU the placement is checked by recording where the executor and FeedBlob would put every
logical CUDA device on real GPUs, while the nets run on the CPU; training through the map equals one
device on the concatenated batch (inter-device batch norm, Sum tree, cross-replica copies). The
`cuda` test runs four replicas on the one real GPU.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import graphpar.executor.plan as plan
from graphpar import data_parallel_model as dpm
from graphpar import devices, workspace
from graphpar.core.ir import CUDA, DeviceOption
from graphpar.errors import ParallelizeError
from graphpar.feeder import CudaCopier
from graphpar.model_helper import ModelHelper
from tests.fake_gpus import fake_gpus
from tests.parallel import test_sync_bn
from tests.parallel.test_sync_bn import _compare, _conv_bn_net, _parallelize, _train


@pytest.fixture
def resolved(monkeypatch: pytest.MonkeyPatch) -> dict[int, set[torch.device]]:
    """{logical CUDA device: the real devices the executor and FeedBlob would place it on}; the
    kernels themselves run on the CPU."""
    seen: dict[int, set[torch.device]] = {}

    def record(option: DeviceOption | None) -> torch.device:
        if option is not None and option.device_type == CUDA:
            seen.setdefault(option.device_id, set()).add(devices.placement(option))
        return torch.device("cpu")

    monkeypatch.setattr(plan, "torch_device", record)
    return seen


@pytest.fixture(scope="module")
def one_device_run() -> list:
    return _train([0], gpu=False, combine=False)


@pytest.mark.parametrize("mapping", [[0, 0, 0, 0], [1, 1, 0, 0]])
def test_mapped_replicas_are_placed_on_their_gpu_and_train_like_one_device(resolved, one_device_run, mapping):
    with devices.device_map(mapping):
        runs = _train([0, 1, 2, 3], gpu=True, combine=True)
    assert resolved == {d: {torch.device("cuda", gpu)} for d, gpu in enumerate(mapping)}
    for step, (got, expected) in enumerate(zip(runs, one_device_run), start=1):
        assert _compare(got, expected, step) > 60


def test_the_map_comes_from_the_environment_or_the_context(monkeypatch):
    monkeypatch.setenv("GRAPHPAR_DEVICE_MAP", "0,0,1")
    assert devices.current_device_map() == (0, 0, 1) and devices.num_cuda_devices() == 3
    assert [devices.physical_gpu(d) for d in range(3)] == [0, 0, 1]
    with devices.device_map([2, 2]):
        assert devices.current_device_map() == (2, 2) and devices.shares_a_gpu([0, 1])
        with devices.device_map(None):
            assert devices.current_device_map() is None and devices.physical_gpu(5) == 5
    with pytest.raises(RuntimeError, match=r"CUDA device 3 is not in the device map \[0, 0, 1\]"):
        devices.physical_gpu(3)
    with devices.cuda_on_cpu(), pytest.raises(ParallelizeError, match=r"CUDA device\(s\) \[3\] do not exist"):
        _parallelize(_conv_bn_net, [0, 3], gpu=True, combine=False)  # outside the map, simulated or not
    with devices.cuda_on_cpu():  # Parallelize's default devices: the map's logical devices
        model = ModelHelper(name="mapped_default", init_params=False)
        dpm.Parallelize(model, input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=lambda m, scale: [m.net.Relu("x", "y")])
    assert model.GetDevices() == [0, 1, 2]


@pytest.mark.parametrize(("text", "error", "match"), [
    ("0,a", ValueError, "expected comma-separated physical GPU ids.*GRAPHPAR_DEVICE_MAP=0,0,0,0"),
    ("0_1", ValueError, "expected comma-separated physical GPU ids"),  # issue 32 item 12: int() read it as 1
    ("+1", ValueError, "expected comma-separated physical GPU ids"),
    ("0,\u0661", ValueError, "expected comma-separated physical GPU ids"),  # an Arabic-Indic digit one
    ("1.0", ValueError, "expected comma-separated physical GPU ids"),
    ("0,-1", ValueError, r"one physical GPU id >= 0 per logical device, got \[0, -1\]"),
])
def test_a_bad_map_is_refused_naming_the_fix(monkeypatch, text, error, match):
    monkeypatch.setenv("GRAPHPAR_DEVICE_MAP", text)
    with pytest.raises(error, match=match):
        devices.current_device_map()
    for bad in ([True, 0], [0.0], "0,0", 0):
        with pytest.raises(TypeError, match="a list of int physical GPU ids"), devices.device_map(bad):
            pass


def test_a_map_of_digits_and_commas_is_read_with_spaces_around_ids(monkeypatch):
    monkeypatch.setenv("GRAPHPAR_DEVICE_MAP", " 0, 1 ,1")
    assert devices.current_device_map() == (0, 1, 1)


def test_a_map_onto_a_missing_gpu_is_refused_where_the_device_is_placed(monkeypatch):
    fake_gpus(monkeypatch, 1)
    with devices.device_map([0, 0]):
        assert devices.torch_device(DeviceOption(CUDA, 1)) == torch.device("cuda", 0)
    with devices.device_map([0, 1]), pytest.raises(RuntimeError, match="on GPU 1, but 1 GPU"):
        devices.torch_device(DeviceOption(CUDA, 1))


def test_nccl_with_two_replicas_on_one_gpu_is_refused_before_anything_changes():
    model = ModelHelper(name="mapped_nccl")
    with devices.device_map([0, 0]), devices.cuda_on_cpu():
        with pytest.raises(ParallelizeError, match=r"use_nccl=True needs a distinct GPU per replica.*GPUs \[0, 0\]"):
            _parallelize(_conv_bn_net, [0, 1], gpu=True, combine=True, model=model, use_nccl=True)
        assert model.net.Proto().ops == [] and model.param_init_net.Proto().ops == []
    with devices.device_map([1, 0]), devices.cuda_on_cpu():  # one replica per GPU: NCCL is fine
        _parallelize(_conv_bn_net, [0, 1], gpu=True, combine=True, use_nccl=True)


def test_replicas_sharing_a_gpu_have_their_own_feeder_side_streams(monkeypatch):
    fake_gpus(monkeypatch, 1)
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    copier = CudaCopier()
    with devices.device_map([0, 0]):
        assert copier._stream(0) is not copier._stream(1) and copier._stream(1) is copier._stream(1)
    assert made == [torch.device("cuda", 0)] * 2


@pytest.mark.cuda
def test_four_replicas_on_the_real_gpu_train_like_one_replica_on_the_whole_batch(monkeypatch):
    """The real thing: per-replica streams and events, copies, the Sum tree and inter-device batch
    norm on one GPU (float64, so the bounds stay tight)."""
    monkeypatch.setattr(test_sync_bn, "cuda_on_cpu", lambda enabled=True: contextlib.nullcontext())
    expected = _train([0], gpu=True, combine=False)
    with devices.device_map([0, 0, 0, 0]):
        runs = _train([0, 1, 2, 3], gpu=True, combine=True)
        assert workspace.FetchTensor("gpu_3/conv1_w").device == torch.device("cuda", 0)
    for step, (got, want) in enumerate(zip(runs, expected), start=1):
        assert _compare(got, want, step) > 60
    assert np.isfinite(runs[-1]["loss"][0]).all()
