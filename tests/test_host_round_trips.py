"""No host round trips in a steady-state step (issue 21, item 3), checked on logical CUDA devices.

On a GPU, a step must not read a device value on the host (`.item()`, `.tolist()`, `bool(t)`: a
`_local_scalar_dense`, which waits for the stream) nor copy host memory to the device (a pageable
copy makes the stream synchronize first). Without a GPU, logical CUDA devices run on the CPU, so the
devices are tracked instead: `HostRoundTrips` (a TorchDispatchMode) knows which tensors are host
values (blobs that live on the CPU, what CPU ops compute, tensors made from Python data and what is
computed from host values only) and, inside every op placed on a CUDA device, flags
- a `_local_scalar_dense` of a device tensor (a host read);
- an op mixing a host tensor of one or more dimensions with device tensors (a host-to-device copy;
  0-dim host tensors are kernel arguments, as in PyTorch);
- an output blob that lives on the device but holds a host value (`torch.tensor(v, device=...)`,
  `host.to(device)`: a copy from pageable memory).
Factories without data (`torch.full`, `torch.empty`) fill on the device: a host scalar travels as a
kernel argument, with no copy and no sync.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.graph import blob_devices
from graphpar.core.ir import CUDA
from graphpar.devices import cuda_on_cpu
from graphpar.model_helper import ModelHelper

aten = torch.ops.aten


class HostRoundTrips(TorchDispatchMode):
    """Records host reads and host-to-device transfers of the ops placed on CUDA devices (see above)."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive, so ids stay unique)
        self.on_cuda = False  # the op running now is placed on a CUDA device
        self.op = ""
        self.found: list[str] = []

    def mark_host(self, value: object) -> None:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.host[id(t)] = t

    def is_host(self, t: torch.Tensor) -> bool:
        return id(t) in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.on_cuda and func is aten._local_scalar_dense.default and not self.is_host(tensors[0]):
            self.found.append(f"{self.op}: reads a device value on the host ({func})")
        out = func(*args, **kwargs)
        if not self.on_cuda or func is aten.lift_fresh.default:
            self.mark_host(out)
            return out
        host = [t for t in tensors if self.is_host(t)]
        if host and len(host) < len(tensors) and any(t.dim() > 0 for t in host):
            self.found.append(f"{self.op}: copies a host tensor to the device ({func})")
        if tensors and len(host) == len(tensors):
            self.mark_host(out)
        return out


def watch(mode: HostRoundTrips, net_name: str) -> None:
    """Make the created net `net_name` tell `mode` which op runs, where, and check its outputs."""
    ws = workspace.get_workspace()
    plan = ws.nets[net_name]
    devices = blob_devices(plan.netdef)

    def watched(step, op) -> Callable:  # noqa: ANN001
        def kernel(*args: object) -> object:
            mode.on_cuda, mode.op = step.option.device_type == CUDA, f"op #{step.index} {op.type}"
            try:
                out = step.kernel(*args)
            finally:
                mode.on_cuda = False
            values = out if len(op.outputs) != 1 else (out,)
            for blob, value in zip(op.outputs, values):
                if devices[blob].device_type == CUDA and isinstance(value, torch.Tensor) and mode.is_host(value):
                    mode.found.append(f"{mode.op}: writes device blob {blob!r} from host memory")
                if devices[blob].device_type != CUDA:
                    mode.mark_host(value)
            return out
        return kernel

    steps = tuple(step.with_kernel(watched(step, plan.netdef.ops[step.index])) for step in plan.steps)
    ws.nets[net_name] = plan.with_steps(steps)
    for blob, tensor in ws.blobs.items():
        if blob in devices and devices[blob].device_type != CUDA:
            mode.host[id(tensor)] = tensor


def _mlp(model: ModelHelper, loss_scale: float) -> list[str]:
    h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=8)
    h = brew.relu(model, h, h)
    pred = brew.fc(model, h, "pred", dim_in=8, dim_out=3)
    return [model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])[1]]


def _cnn(model: ModelHelper, loss_scale: float) -> list[str]:
    h = brew.conv(model, "data", "conv", dim_in=3, dim_out=4, kernel=3, pad=1)
    h = brew.spatial_bn(model, h, "bn", dim_in=4, momentum=0.9)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool", kernel=2, stride=2)
    pred = brew.fc(model, h, "pred", dim_in=4 * 2 * 2, dim_out=3)
    return [model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])[1]]


def _sgd(model: ModelHelper) -> None:
    optimizer.build_sgd(model, 0.1, policy="step", stepsize=2, gamma=0.5, momentum=0.9)


def _adam(model: ModelHelper) -> None:
    optimizer.build_adam(model, 0.01, policy="step", stepsize=2, gamma=0.5)


def _round_trips(forward, build_optimizer, shape: tuple[int, ...], devices: list[int]) -> list[str]:  # noqa: ANN001
    rng = np.random.default_rng(0)
    with cuda_on_cpu():
        model = ModelHelper(name="round_trips")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                        optimizer_builder_fun=build_optimizer, devices=devices)
        for d in devices:
            workspace.FeedBlob(f"gpu_{d}/data", rng.standard_normal((2, *shape)).astype(np.float32))
            workspace.FeedBlob(f"gpu_{d}/label", rng.integers(0, 3, 2).astype(np.int32))
        dpm.RunInitNet(model)
        dpm.RunNet(model, 2)  # warm-up
        mode = HostRoundTrips()
        watch(mode, model.net.Proto().name)
        with mode:
            dpm.RunNet(model, 2)
    return mode.found


@pytest.mark.parametrize("devices", [[0], [0, 1]])
@pytest.mark.parametrize("build_optimizer", [_sgd, _adam], ids=["sgd_momentum", "adam"])
def test_a_steady_mlp_step_has_no_host_round_trips(build_optimizer, devices: list[int]) -> None:  # noqa: ANN001
    assert _round_trips(_mlp, build_optimizer, (6,), devices) == []


def test_a_steady_bn_cnn_step_has_no_host_round_trips() -> None:
    assert _round_trips(_cnn, _sgd, (3, 4, 4), [0, 1]) == []


def test_the_stand_in_sees_host_reads_and_pageable_copies() -> None:
    """The checker itself: a kernel that reads a device value, one that makes a device value from
    host data, and one that mixes a host tensor into device math are all reported."""
    mode = HostRoundTrips()
    device_value = torch.ones(3)
    host_value = torch.ones(3)
    mode.host[id(host_value)] = host_value
    with mode:
        mode.on_cuda, mode.op = True, "op"
        device_value.sum().item()
        device_value + host_value
        torch.full((1,), 0.5)  # a fill on the device: no copy
        host_value.sum().item()  # a host value read on the host: fine
    assert mode.found == ["op: reads a device value on the host (aten._local_scalar_dense.default)",
                          "op: copies a host tensor to the device (aten.add.Tensor)"]


@pytest.mark.cuda
@pytest.mark.parametrize("net_type", ["simple", "dag", "cuda_graph"])
def test_on_a_gpu_a_steady_step_has_no_sync_and_no_host_to_device_copy(net_type: str) -> None:
    """The real thing (skipped without a GPU): three steady-state steps of an MLP with SGD-momentum and
    a step policy run under `torch.cuda.set_sync_debug_mode("error")` (any synchronizing CUDA call
    raises, naming its op), and torch.profiler sees no host-to-device copy in three more. (The
    profiler itself synchronizes when it stops, so its table cannot tell a clean step's syncs.)"""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(0)
    model = ModelHelper(name=f"round_trips_gpu_{net_type}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=_sgd, devices=[0], net_type=net_type)
    workspace.FeedBlob("gpu_0/data", rng.standard_normal((2, 6)).astype(np.float32))
    workspace.FeedBlob("gpu_0/label", rng.integers(0, 3, 2).astype(np.int32))
    dpm.RunInitNet(model)
    dpm.RunNet(model, 4)  # warm-up (and the capture, for cuda_graph)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dpm.RunNet(model, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dpm.RunNet(model, 3)
    assert [event.name for event in prof.events() if "HtoD" in event.name] == []


class DeviceReads(HostRoundTrips):
    """HostRoundTrips, plus: what the CUDA-placed ops make is a device value (so is a copy or view of
    one made outside the ops), and outside the ops, copying one to the host (`.to("cpu")`, FetchBlob)
    or reading its value (`.item()`) is a host read, recorded with `when()` (the trainer's iteration)."""

    def __init__(self, when: Callable[[], int]) -> None:
        super().__init__()
        self.device: dict[int, torch.Tensor] = {}
        self.when = when
        self.reads: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.on_cuda:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not self.is_host(t):
                    self.device[id(t)] = t
            return out
        from_device = any(isinstance(t, torch.Tensor) and id(t) in self.device for t in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        to_host = func is aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
        if from_device and (to_host or func is aten._local_scalar_dense.default):
            self.reads.append((self.when(), str(func)))
        elif from_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device[id(t)] = t
        return out


def _trainer_reads(record_period: int | None, max_iter: int = 8, period: int = 4):  # noqa: ANN202
    """A Trainer on two logical CUDA devices (SGD momentum, a step LR) with an LRScheduler, an
    IterationTimer and a PeriodicWriter every `period` iterations: (its host reads, its storage)."""
    from graphpar.engine import IterationTimer, LRScheduler, PeriodicWriter, Trainer

    rng = np.random.default_rng(0)
    batches = [{"data": rng.standard_normal((4, 6)).astype(np.float32),
                "label": rng.integers(0, 3, 4).astype(np.int32)} for _ in range(3)]
    with cuda_on_cpu():
        workspace.ResetWorkspace()
        workspace.SetSeed(0)
        model = ModelHelper(name="trainer_round_trips")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                        optimizer_builder_fun=_sgd, devices=[0, 1])
        hooks = [IterationTimer(warmup=0), LRScheduler(), PeriodicWriter(period=period, console=False)]
        trainer = Trainer(model, batches, hooks, max_iter=max_iter, record_period=record_period)
        trainer.initialize()
        mode = DeviceReads(lambda: trainer.iter)
        watch(mode, model.net.Proto().name)
        with mode:
            trainer.train()
    return mode, trainer.storage


def test_a_trainer_on_cuda_reads_the_devices_only_when_it_writes():
    """Issue 21: the Trainer used to read every loss on the host every iteration (a sync per step);
    now the losses and the LR stay on the devices and are read at the writer's iterations (done = 4,
    8) only, and the recorded values are bit-identical to reading them every iteration."""
    lazy, lazy_storage = _trainer_reads(None)
    assert lazy.found == []
    assert sorted({at for at, _ in lazy.reads}) == [3, 7]
    eager, eager_storage = _trainer_reads(1)
    assert sorted({at for at, _ in eager.reads}) == list(range(8))  # the stand-in sees every read
    for name in ("loss", "lr"):
        assert lazy_storage.history[name] == eager_storage.history[name]
        assert [at for at, _ in lazy_storage.history[name]] == list(range(8))
