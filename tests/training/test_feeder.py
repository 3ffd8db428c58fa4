"""DeviceFeeder: order, epochs, errors with their traceback, bounded prefetch, clean shutdown, overlap,
the side-stream copy path (a recording copier on logical CUDA devices), and the trainer fed by it."""

from __future__ import annotations

import functools
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.ir import CUDA
from graphpar.data import DataContainer, DeviceFeeder, Prepared, collate, feed
from graphpar.devices import cuda_on_cpu
from graphpar.engine import HookBase, IterationTimer, LRScheduler, PeriodicWriter, Trainer
from graphpar.feeder import CudaCopier
from graphpar.model_helper import ModelHelper
from tests.training.test_trainer import _batches, _model, _params

_names = iter(range(10**6))


def _relu_model(devices=(0, 1), gpu: bool = False) -> ModelHelper:
    model = ModelHelper(name=f"feeder_{next(_names)}", init_params=False)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, scale: [m.net.Relu("x", "y")],
                    devices=list(devices), cpu_device=not gpu)
    return model


def _numbered(count: int, rows: int = 4) -> list[dict]:
    return [{"x": np.full((rows, 2), k, dtype=np.float32), "id": k} for k in range(count)]


def _feeder_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "graphpar-DeviceFeeder"]


def test_order_is_kept_and_no_batch_is_lost_or_repeated_across_epochs():
    model = _relu_model()
    with DeviceFeeder(_numbered(5), model, depth=2) as feeder:
        assert len(feeder) == 5
        for _ in range(3):  # epochs
            seen = []
            for batch in feeder:
                assert isinstance(batch, Prepared)
                fed = feed(model, batch)
                seen.append(fed.host[0]["id"])
                assert workspace.FetchBlob("cpu_1/x")[0, 0] == fed.host[1]["id"]
            assert seen == [0, 1, 2, 3, 4]
    assert _feeder_threads() == []


def bad_loader():
    yield {"x": np.ones((2, 2), dtype=np.float32)}
    raise KeyError("sample 17 is corrupt")


def test_a_loader_error_is_raised_in_the_caller_with_its_traceback():
    model = _relu_model()
    feeder = DeviceFeeder(bad_loader(), model)
    batches = iter(feeder)
    next(batches)
    with pytest.raises(KeyError, match="sample 17 is corrupt") as info:
        next(batches)
    assert "bad_loader" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert any("DeviceFeeder's loading thread" in note for note in info.value.__notes__)
    assert _feeder_threads() == []  # the failed epoch's thread is gone


def test_a_batch_the_model_refuses_is_raised_in_the_caller():
    model = _relu_model()
    with DeviceFeeder([{"x": np.ones((3, 2), dtype=np.float32)}], model) as feeder:
        with pytest.raises(ValueError, match="batch of 3 cannot be split evenly over 2 devices"):
            next(iter(feeder))


class _Flaky(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 6:
            raise ValueError("bad sample 6")
        return {"x": torch.full((2,), float(index))}


def test_dataloader_workers_and_their_errors():
    model = _relu_model()
    loader = torch.utils.data.DataLoader(_Flaky(), batch_size=2, num_workers=2)
    with DeviceFeeder(loader, model) as feeder:
        batches = iter(feeder)
        for k in range(3):
            fed = feed(model, next(batches))
            np.testing.assert_array_equal(workspace.FetchBlob("cpu_1/x")[:, 0], [2 * k + 1])
        with pytest.raises(ValueError, match="bad sample 6"):
            next(batches)
    assert fed.sizes == [1, 1]


def test_prefetch_is_bounded_and_close_stops_the_thread_mid_epoch():
    pulled = []

    def loader():
        for k in range(100):
            pulled.append(k)
            yield {"x": np.full((2, 2), k, dtype=np.float32)}

    model = _relu_model()
    feeder = DeviceFeeder(loader(), model, depth=3)
    batches = iter(feeder)
    next(batches)
    time.sleep(0.3)
    assert len(pulled) <= 1 + 3 + 1  # the one taken, a full queue, one waiting to be put
    feeder.close()
    assert _feeder_threads() == [] and len(pulled) <= 5
    with pytest.raises(StopIteration):
        next(batches)


def test_loading_overlaps_the_step():
    delay, count = 0.05, 8

    def slow_loader():
        for k in range(count):
            time.sleep(delay)  # loading takes as long as a step
            yield {"x": np.full((2, 2), k, dtype=np.float32)}

    model = _relu_model()
    start = time.perf_counter()
    with DeviceFeeder(slow_loader(), model) as feeder:
        for batch in feeder:
            feed(model, batch)
            time.sleep(delay)  # the step
    overlapped = time.perf_counter() - start
    assert overlapped < 0.75 * 2 * delay * count  # serial would take 2 * delay * count


class _RecordingCopier:
    """Stands in for CudaCopier: records copies, events and waits (CPU tensors stay where they are)."""

    def __init__(self):
        self.calls = []

    def copy(self, device, value):
        self.calls.append(("copy", device, tuple(value.shape)))
        return torch.as_tensor(value).clone()

    def record(self, device):
        event = ("event", device, len(self.calls))
        self.calls.append(event)
        return event

    def wait(self, device, event, values):
        assert workspace.HasBlob(f"gpu_{device}/x") is False or event[2] > 0
        self.calls.append(("wait", device, event, len(list(values))))


def test_side_stream_copy_path_on_logical_cuda_devices():
    copier = _RecordingCopier()
    with cuda_on_cpu():
        model = _relu_model(devices=(3, 1), gpu=True)
        with DeviceFeeder(_numbered(2), model, copier=copier) as feeder:
            batches = list(feeder)
        assert copier.calls[:4] == [("copy", 3, (2, 2)), ("copy", 1, (2, 2)),
                                    ("event", 3, 2), ("event", 1, 3)]  # copies, then one event per device
        copier.calls.clear()
        feed(model, batches[1])
        assert copier.calls == [("wait", 3, ("event", 3, 6), 1), ("wait", 1, ("event", 1, 7), 1)]
        np.testing.assert_array_equal(workspace.FetchBlob("gpu_1/x"), np.ones((2, 2)))
        other = _relu_model(devices=(0, 1), gpu=True)
        with pytest.raises(ValueError, match=r"prepared for devices gpu_\[3, 1\], not this model's gpu_\[0, 1\]"):
            feed(other, batches[0])


def test_a_batch_already_on_its_device_is_used_as_it_is(monkeypatch):
    """The meta device stands in for a GPU. CudaCopier neither pins nor copies a tensor already on its
    device (it raised "cannot pin ... only dense CPU tensors can be pinned"), and feed stores the
    chunks of such a tensor without copying them: the blobs alias the caller's tensor."""
    import graphpar.feeder

    gpu = torch.device("meta")
    monkeypatch.setattr(graphpar.feeder, "torch_device", lambda option: gpu)
    x = torch.empty(4, 2, device=gpu)
    assert CudaCopier().copy(1, x) is x
    monkeypatch.setattr(workspace, "checked_torch_device",
                        lambda option, where: gpu if option.device_type == CUDA else torch.device("cpu"))
    ws = workspace.get_workspace()
    with cuda_on_cpu():
        model = _relu_model(devices=(0, 1), gpu=True)
        feed(model, {"x": x})
        assert [ws.blobs[f"gpu_{d}/x"]._base is x for d in (0, 1)] == [True, True]  # views of x's rows
        feed(model, {"x": x}, dim=1)  # columns are not contiguous: a copy on the device
        assert ws.blobs["gpu_0/x"]._base is None and ws.blobs["gpu_0/x"].device == gpu
        workspace.FeedBlob("gpu_0/x", x)  # Caffe2's FeedBlob always copies
        assert ws.blobs["gpu_0/x"] is not x and ws.blobs["gpu_0/x"]._base is None
        host = torch.ones(4, 2)
        feed(_relu_model(devices=(0, 1)), {"x": host})  # host values are copied as before
        assert ws.blobs["cpu_0/x"]._base is None


class _HostCopier(CudaCopier):
    """CudaCopier with its copies left on the CPU: its streams, events and waits are torch.cuda's."""

    def copy(self, device, value):
        self._stream(device)
        return torch.as_tensor(value).clone()


def test_under_a_device_map_the_feeder_waits_on_the_gpu_each_replica_runs_on(monkeypatch):
    """Four replicas on GPU 0 of a (fake) 1-GPU machine: each waits for its copies on the current
    stream of GPU 0. (It asked for the current stream of logical device 3: "Invalid device id".)"""
    import graphpar.feeder
    from graphpar import devices
    from tests.fake_cuda import FakeCuda
    from tests.fake_gpus import fake_gpus

    fake_gpus(monkeypatch, 1)
    fake = FakeCuda(gpus=1).install(monkeypatch)
    monkeypatch.setattr(graphpar.feeder, "torch_device", devices.placement)  # where it runs on the GPUs
    with devices.device_map([0, 0, 0, 0]), cuda_on_cpu():
        model = _relu_model(devices=(0, 1, 2, 3), gpu=True)
        with DeviceFeeder(_numbered(1, rows=8), model, copier=_HostCopier()) as feeder:
            (batch,) = list(feeder)
        fake.log.clear()
        feed(model, batch)
        np.testing.assert_array_equal(workspace.FetchBlob("gpu_3/x"), np.zeros((2, 2)))
    waits = [entry for entry in fake.log if entry[0] == "wait"]
    assert [stream for _, stream, _ in waits] == ["default@cuda:0"] * 4
    assert [event for _, _, event in waits] == [str(event) for event in batch.ready]


def _gpu_mlp(name: str) -> ModelHelper:
    model = ModelHelper(name=name)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, scale: [m.net.Scale(m.net.SoftmaxWithLoss(
                        [brew.fc(m, "data", "pred", dim_in=4, dim_out=3), "label"], ["softmax", "xent"])[1],
                        "loss", scale=scale)],
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.2, momentum=0.9), devices=[0, 1])
    return model


def test_a_trainer_on_cuda_replicas_copies_numpy_batches_through_the_side_stream_copier():
    """A Trainer fed numpy batches on real CUDA replicas stages them as a DeviceFeeder does (pinned
    memory, a side stream per device, the step's stream waiting for an event): no blocking copy per
    blob. The copier here records; the run equals the plain one."""
    data = _batches()
    with cuda_on_cpu():
        workspace.ResetWorkspace()
        workspace.SetSeed(1)
        plain = _gpu_mlp("copier_plain")
        Trainer(plain, data, max_iter=5).train()
        expected = _params(plain)
        workspace.ResetWorkspace()
        workspace.SetSeed(1)
        model, copier = _gpu_mlp("copier_staged"), _RecordingCopier()
        trainer = Trainer(model, data, max_iter=5, copier=copier)
        trainer.train()
        for name, value in _params(model).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)
        assert Trainer(model, data).copier is None  # CUDA replicas placed on the CPU: feed copies
    kinds = [call[0] for call in copier.calls]
    assert kinds.count("copy") == 2 * 2 * 5 and kinds.count("wait") == 2 * 6  # data+label per device; init too
    assert isinstance(Trainer(model, data).copier, CudaCopier)  # real CUDA replicas (outside the simulation)
    assert Trainer(model, DeviceFeeder(data, model)).copier is None  # the feeder stages them already
    assert Trainer(_model(), data).copier is None  # CPU replicas


@pytest.mark.cuda
def test_a_loader_of_cuda_tensors_feeds_them_as_they_are():
    model = _relu_model(devices=(0,), gpu=True)
    x = torch.arange(8.0, device="cuda").reshape(4, 2)
    with DeviceFeeder([{"x": x}, {"x": x.cpu()}], model) as feeder:
        on_device, from_host = list(feeder)
    feed(model, on_device)
    assert workspace.FetchTensor("gpu_0/x").data_ptr() == x.data_ptr()
    feed(model, from_host)  # pinned, then copied on the side stream
    torch.cuda.synchronize()
    np.testing.assert_array_equal(workspace.FetchBlob("gpu_0/x"), x.cpu().numpy())


def test_the_trainer_fed_by_a_device_feeder_equals_the_plain_loader():
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    plain = Trainer(_model(), _batches(), max_iter=6)
    plain.train()
    expected = _params(plain.model)
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    model = _model()
    with DeviceFeeder(_batches(), model) as feeder:
        Trainer(model, feeder, max_iter=6).train()
    for name, value in _params(model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert _feeder_threads() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        DeviceFeeder([], _relu_model(), depth=0)
    with pytest.raises(Exception, match="Parallelize"):
        DeviceFeeder([], ModelHelper(name=f"feeder_plain_{next(_names)}"))


class _Images(torch.utils.data.Dataset):
    """Dicts of variable-size images, labels and metadata."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        h, w = 6 + i % 5, 7 + i % 3
        return {"img": DataContainer(rng.random((3, h, w), dtype=np.float32), stack=True),
                "label": np.int32(i % 4), "meta": DataContainer({"id": i, "shape": (h, w)}, cpu_only=True)}


def _image_net(m, scale):
    h = brew.relu(m, brew.conv(m, "img", "conv", dim_in=3, dim_out=8, kernel=3, pad=1), "relu")
    pred = brew.fc(m, m.net.AveragePool([h], "gap", global_pooling=1), "pred", dim_in=8, dim_out=4)
    _, loss = m.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [m.net.Scale(loss, "scaled_loss", scale=scale)]


def test_a_dataloader_of_dicts_with_variable_size_images_and_metadata_trains_through_the_trainer(capsys):
    workspace.ResetWorkspace()
    model = ModelHelper(name=f"feeder_images_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_image_net,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=[0, 1], cpu_device=True)
    loader = torch.utils.data.DataLoader(_Images(), batch_size=8, num_workers=2,
                                         collate_fn=functools.partial(collate, samples_per_device=4))
    seen = []

    class Metadata(HookBase):  # cpu_only fields reach the hooks, per device
        def after_step(self):
            seen.extend(m["id"] for m in self.trainer.last_fed.host[1]["meta"])

    with DeviceFeeder(loader, model) as feeder:
        trainer = Trainer(model, feeder, [IterationTimer(), LRScheduler(), PeriodicWriter(None, 4), Metadata()],
                          max_iter=6)
        trainer.train()
    assert seen == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31, 4, 5, 6, 7, 12, 13, 14, 15]
    assert len(trainer.storage.history["scaled_loss"]) == 6 and "iter 6/6" in capsys.readouterr().out
    assert _feeder_threads() == []


def test_a_feeder_dropped_without_close_stops_its_thread():
    import gc

    def endless():
        k = 0
        while True:
            k += 1
            yield {"x": np.full((2, 2), k, dtype=np.float32)}

    model = _relu_model()
    feeder = DeviceFeeder(endless(), model)
    batches = iter(feeder)
    next(batches)
    del feeder, batches
    gc.collect()
    deadline = time.monotonic() + 5
    while _feeder_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _feeder_threads() == []


def test_dropping_the_epochs_iterator_stops_its_thread_while_the_feeder_lives():
    """Issue 23 item 17: the feeder kept its epoch alive, so the thread loaded on until close()."""
    import gc

    pulled = []

    class Endless:
        def __iter__(self):
            while True:
                pulled.append(len(pulled))
                yield {"x": np.full((2, 2), len(pulled), dtype=np.float32)}

    model = _relu_model()
    feeder = DeviceFeeder(Endless(), model, depth=2)
    batches = iter(feeder)
    next(batches)
    del batches
    gc.collect()
    deadline = time.monotonic() + 5
    while _feeder_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _feeder_threads() == []
    count = len(pulled)
    time.sleep(0.2)
    assert len(pulled) == count <= 5
    assert isinstance(next(iter(feeder)), Prepared)  # the feeder starts another epoch
    feeder.close()
    assert _feeder_threads() == []


def test_an_epoch_whose_init_was_interrupted_is_dropped_quietly():
    """Ctrl-C inside _Epoch.__init__ leaves an object without its stop event: dropping it must not print
    'Exception ignored in ... __del__' (a traceback on the user's console)."""
    from graphpar.feeder import _Epoch

    half_made = _Epoch.__new__(_Epoch)
    half_made.__del__()  # raised AttributeError before
