"""CUDA-graph nets (`executor.graphs`), checked on the CPU through a recording stand-in for capture.

The stand-in records each capture (the body and the devices) without running it, as a real capture
runs no kernel, and runs the captured body on every replay, as a real replay reruns its kernels on
the static buffers. So capture bookkeeping, static buffers, feeds between steps, error paths and
equivalence with the uncaptured run are proven here; `test_real_cuda_graph_equals_simple` does the
same on a GPU (it skips without one).
"""

from __future__ import annotations

import gc
import logging
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core import CPU, CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.devices import cuda_on_cpu
from graphpar.engine import Trainer
from graphpar.errors import OperatorError
from graphpar.executor import graphs
from graphpar.executor.graphs import graph_backend
from graphpar.executor.runtime import runtime_of
from graphpar.model_helper import ModelHelper
from tests.fake_cuda import FakeCuda


class RecordingGraphs:
    """Capture records the body and runs nothing; replay runs the body; warm-up runs are counted.
    `on_capture` (if set) is called when a capture begins."""

    def __init__(self) -> None:
        self.captures: list[tuple[torch.device, ...]] = []
        self.replays = 0
        self.warmups = 0
        self.on_capture: Callable[[], None] | None = None

    def check(self, net_name: str, devices: Sequence[torch.device]) -> None:
        return None  # any number of devices: the bookkeeping is the same

    @contextmanager
    def warming(self, devices: Sequence[torch.device]) -> Iterator[None]:
        self.warmups += 1
        yield

    def capture(self, body: Callable[[], None], devices: Sequence[torch.device]) -> Callable[[], None]:
        self.captures.append(tuple(devices))
        if self.on_capture is not None:
            self.on_capture()

        def replay() -> None:
            self.replays += 1
            body()

        return replay


def _mlp(model: ModelHelper, loss_scale: float) -> list[str]:
    h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=8)
    h = brew.relu(model, h, h)
    pred = brew.fc(model, h, "pred", dim_in=8, dim_out=3)
    softmax, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _cnn(model: ModelHelper, loss_scale: float) -> list[str]:
    h = brew.conv(model, "data", "conv", dim_in=3, dim_out=4, kernel=3, pad=1)
    h = brew.spatial_bn(model, h, "bn", dim_in=4, momentum=0.9)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool", kernel=2, stride=2)
    pred = brew.fc(model, h, "pred", dim_in=4 * 2 * 2, dim_out=3)
    softmax, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _sgd(model: ModelHelper) -> None:
    optimizer.build_sgd(model, 0.1, policy="step", stepsize=2, gamma=0.5, momentum=0.9)


def _batches(shape: tuple[int, ...], devices: list[int], steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{**{f"gpu_{d}/data": rng.standard_normal((2, *shape)).astype(np.float32) for d in devices},
             **{f"gpu_{d}/label": rng.integers(0, 3, 2).astype(np.int32) for d in devices}}
            for _ in range(steps)]


def _train(forward, shape, devices, steps, **options) -> tuple[dict[str, np.ndarray], ModelHelper]:  # noqa: ANN001
    """Train `steps` steps, a new batch fed each step; every blob of the workspace afterwards."""
    workspace.ResetWorkspace()
    model = ModelHelper(name="graphs")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=_sgd, devices=devices, **options)
    batches = _batches(shape, devices, steps)
    for name, value in batches[0].items():
        workspace.FeedBlob(name, value)
    dpm.RunInitNet(model)
    for batch in batches:
        for name, value in batch.items():
            workspace.FeedBlob(name, value)
        dpm.RunNet(model, 1)
    # optimizers number their blobs per process (SgdOptimizer_3_lr_gpu0): compare without the number
    return {re.sub(r"Optimizer_\d+", "Optimizer", name): workspace.FetchBlob(name) for name in workspace.Blobs()}, model


@contextmanager
def _recording() -> RecordingGraphs:  # noqa: ANN201
    stand_in = RecordingGraphs()
    with cuda_on_cpu(), graph_backend(stand_in):
        yield stand_in


@pytest.mark.parametrize("forward,shape", [(_mlp, (6,)), (_cnn, (3, 4, 4))], ids=["mlp", "bn_cnn"])
@pytest.mark.parametrize("devices", [[0], [0, 1]])
def test_a_captured_step_equals_the_uncaptured_run_bit_for_bit(forward, shape, devices) -> None:  # noqa: ANN001
    with cuda_on_cpu():
        expected, _ = _train(forward, shape, devices, 6, net_type="simple")
    with _recording() as stand_in:
        got, model = _train(forward, shape, devices, 6, cuda_graph=True)
    assert model.net.Proto().type == "cuda_graph"
    assert len(stand_in.captures) == 1 and stand_in.replays == 6 - graphs.DEFAULT_WARMUP
    assert stand_in.warmups == graphs.DEFAULT_WARMUP and stand_in.captures == [(torch.device("cpu"),)]
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_gradient_buckets_are_captured_too() -> None:
    """Buckets' Reshape and Split (HOST_SYNC ops reading no value without a sizes input) are captured."""
    with cuda_on_cpu():
        expected, model = _train(_mlp, (6,), [0, 1], 5, net_type="simple", gradient_bucket_bytes=1 << 20)
    assert {"Concat", "Split", "Reshape"} <= {op.type for op in model.net.Proto().ops}
    with _recording() as stand_in:
        got, _ = _train(_mlp, (6,), [0, 1], 5, cuda_graph=True, gradient_bucket_bytes=1 << 20)
    assert stand_in.replays == 5 - graphs.DEFAULT_WARMUP
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_feeding_a_captured_input_copies_into_its_static_buffer() -> None:
    with _recording():
        _train(_mlp, (6,), [0], 3, cuda_graph=True)
        plan = workspace.get_workspace().nets[next(iter(workspace.get_workspace().nets))]
        static = workspace.FetchTensor("gpu_0/data")
        batch = np.full((2, 6), 3.0, np.float32)
        workspace.FeedBlob("gpu_0/data", batch)
        assert workspace.FetchTensor("gpu_0/data") is not static
        workspace.RunNet(plan.name)
        assert workspace.FetchTensor("gpu_0/data") is static
        np.testing.assert_array_equal(static.numpy(), batch)


def test_a_new_input_shape_raises_naming_the_blob_and_changes_nothing() -> None:
    with _recording():
        _, model = _train(_mlp, (6,), [0], 3, cuda_graph=True)
        before = {name: workspace.FetchBlob(name) for name in ("gpu_0/fc1_w", "optimizer_iteration")}
        workspace.FeedBlob("gpu_0/data", np.zeros((4, 6), np.float32))
        workspace.FeedBlob("gpu_0/label", np.zeros(4, np.int32))
        with pytest.raises(ValueError, match=r"blob 'gpu_0/data' is \[4, 6\] float32 but was captured .* \[2, 6\]"):
            dpm.RunNet(model, 1)
        for name, value in before.items():
            np.testing.assert_array_equal(workspace.FetchBlob(name), value)


def _plain_net(ops: list[OperatorDef]) -> NetDef:
    net = NetDef("plain_graph", ops)
    net.type = "cuda_graph"
    return net


GPU0 = DeviceOption(CUDA, 0)


def test_a_plain_net_of_type_cuda_graph_captures_once_and_replays() -> None:
    """Reshape by its `shape` argument (a HOST_SYNC op that reads no value here) is captured too."""
    with _recording() as stand_in:
        workspace.FeedBlob("gpu_0/x", np.array([1.0, -2.0, 3.0], np.float32), GPU0)
        workspace.FeedBlob("gpu_0/y", np.ones((3, 1), np.float32), GPU0)
        net = _plain_net([OperatorDef("Relu", ["gpu_0/x"], ["gpu_0/r"], device_option=GPU0),
                          OperatorDef("Reshape", ["gpu_0/r"], ["gpu_0/r2", "gpu_0/old_shape"], {"shape": [3, 1]}, GPU0),
                          OperatorDef("Add", ["gpu_0/r2", "gpu_0/y"], ["gpu_0/y"], device_option=GPU0)])
        workspace.CreateNet(net)
        workspace.RunNet(net.name, 5)
    np.testing.assert_array_equal(workspace.FetchBlob("gpu_0/y"), [[6.0], [1.0], [16.0]])
    assert len(stand_in.captures) == 1 and stand_in.replays == 3


@pytest.mark.parametrize("ops,op_named,why", [
    ([OperatorDef("Dropout", ["gpu_0/x"], ["gpu_0/d", "gpu_0/m"], {"ratio": 0.5, "is_test": 0}, GPU0)],
     r"op #0 \(Dropout\)", "random numbers"),
    ([OperatorDef("Relu", ["gpu_0/x"], ["gpu_0/r"], device_option=GPU0),
      OperatorDef("CopyGPUToCPU", ["gpu_0/r"], ["r_host"], device_option=GPU0),
      OperatorDef("Relu", ["r_host"], ["r_host2"], device_option=DeviceOption(CPU, 0))],
     r"op #2 \(Relu\)", "runs on the host and must follow op #1"),
    ([OperatorDef("ConstantFill", [], ["host_v"], {"shape": [3], "value": 1.0}, DeviceOption(CPU, 0)),
      OperatorDef("Add", ["gpu_0/x", "host_v"], ["gpu_0/s"], device_option=GPU0)],
     r"op #1 \(Add\)", "reads host blob 'host_v'"),
])
def test_an_op_that_cannot_be_captured_raises_naming_it_before_anything_runs(ops, op_named, why) -> None:  # noqa: ANN001
    with _recording() as stand_in:
        workspace.FeedBlob("gpu_0/x", np.ones(3, np.float32), GPU0)
        net = _plain_net(ops)
        workspace.CreateNet(net)
        before = set(workspace.Blobs())
        with pytest.raises(ValueError, match=f"{op_named} cannot be captured in a CUDA graph: .*{why}"):
            workspace.RunNet(net.name)
        assert set(workspace.Blobs()) == before and stand_in.captures == []


def test_adam_cannot_be_captured_it_reads_the_iteration_count_on_the_host() -> None:
    with _recording():
        model = ModelHelper(name="graphs_adam")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                        optimizer_builder_fun=lambda m: optimizer.build_adam(m, 0.01), devices=[0], cuda_graph=True)
        for name, value in _batches((6,), [0], 1)[0].items():
            workspace.FeedBlob(name, value)
        dpm.RunInitNet(model)
        with pytest.raises(ValueError, match=r"Adam\) cannot be captured in a CUDA graph: it reads host blob 'optimizer_iteration'"):
            dpm.RunNet(model, 1)


def test_a_host_read_in_the_step_cannot_be_captured() -> None:
    """Parallelize(check_finite_loss=True) adds CheckFinite, which reads the loss on the host."""
    with _recording():
        model = ModelHelper(name="graphs_check_finite")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                        optimizer_builder_fun=_sgd, devices=[0], cuda_graph=True, check_finite_loss=True)
        for name, value in _batches((6,), [0], 1)[0].items():
            workspace.FeedBlob(name, value)
        dpm.RunInitNet(model)
        with pytest.raises(ValueError, match=r"\(CheckFinite\) cannot be captured .*HOST_SYNC"):
            dpm.RunNet(model, 1)


def test_without_a_graph_backend_the_net_runs_as_simple_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with cuda_on_cpu():
        expected, _ = _train(_mlp, (6,), [0], 4, net_type="simple")
        with caplog.at_level(logging.WARNING, logger="graphpar.executor.graphs"):
            got, _ = _train(_mlp, (6,), [0], 4, cuda_graph=True)
    assert "no CUDA graphs here" in caplog.text
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_parallelize_refuses_cuda_graph_on_cpu_devices() -> None:
    with pytest.raises(dpm.ParallelizeError, match="cuda_graph=True .* needs CUDA devices"):
        dpm.Parallelize(ModelHelper(name="graphs_cpu"), input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=_mlp, optimizer_builder_fun=_sgd, devices=[0],
                        cpu_device=True, cuda_graph=True)


def _two_replica_model(name: str) -> ModelHelper:
    model = ModelHelper(name=name)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=_sgd, devices=[0, 1], cuda_graph=True)
    for blob, value in _batches((6,), [0, 1], 1)[0].items():
        workspace.FeedBlob(blob, value)
    dpm.RunInitNet(model)
    return model


def test_torch_graphs_warms_up_and_captures_on_one_side_stream_and_replays_on_the_callers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchGraphs against a recording stand-in for torch.cuda's streams and graphs. Two replicas
    placed on one device (logical CUDA devices on the CPU, as a device map onto one GPU) are one
    device: captured together."""
    fake = FakeCuda().install(monkeypatch)
    with cuda_on_cpu(), graph_backend(graphs.TorchGraphs()):
        model = _two_replica_model("graphs_torch")
        fake.log.clear()
        dpm.RunNet(model, 1)
        dpm.RunNet(model, 1)
        warm_up = list(fake.log)
        fake.log.clear()
        dpm.RunNet(model, 1)
        dpm.RunNet(model, 1)
    side = warm_up[0][1]  # the side stream: each warm-up waits for the caller's stream and back
    assert warm_up == [("wait stream", side, "default@cpu"), ("wait stream", "default@cpu", side)] * 2
    assert fake.log == [("device", "cpu"), ("synchronize", "cpu"), ("empty cache",),
                        ("capture begins", side, (0, 1), "thread_local"), ("capture ends", side),
                        ("replay", "default@cpu"), ("replay", "default@cpu")]


def test_a_failed_capture_is_closed_its_pool_released_and_the_op_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that raises while captured invalidates a real capture, whose capture_end() then raises
    a CUDA error: the user gets the op's error, and the graph's pool is not left behind."""
    fake = FakeCuda().install(monkeypatch)
    fake.capture_invalidated = True
    with cuda_on_cpu(), graph_backend(graphs.TorchGraphs()):
        workspace.FeedBlob("gpu_0/x", np.ones(3, np.float32), GPU0)
        net = _plain_net([OperatorDef("Relu", ["gpu_0/x"], ["gpu_0/r"], device_option=GPU0),
                          OperatorDef("_TestFail", ["gpu_0/r"], ["gpu_0/f"], {"message": "boom"}, GPU0)])
        net.args[graphs.WARMUP_ARG] = 0
        workspace.CreateNet(net)
        before = set(workspace.Blobs())
        with pytest.raises(OperatorError, match=r"op #1 \(_TestFail\) failed: ValueError: boom"):
            workspace.RunNet(net.name)
        assert set(workspace.Blobs()) == before
    pool = (0, 1)
    assert fake.log[-2:] == [("end allocating to pool", 0, pool), ("release pool", 0, pool)]
    assert fake.pools_in_use == set() and fake.current_stream("cpu").name == "default@cpu"


def test_a_capture_whose_kernel_raises_but_ends_cleanly_resets_its_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda().install(monkeypatch)

    def body() -> None:
        raise ValueError("a Python-level failure")

    with pytest.raises(ValueError, match="Python-level"):
        graphs.TorchGraphs().capture(body, [torch.device("cpu")])
    assert fake.log[-2:] == [("capture ends", fake.log[-2][1]), ("graph reset",)] and fake.pools_in_use == set()


def test_torch_graphs_refuses_a_step_on_several_devices_at_the_first_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's graphs hold one device's work: replicas on two GPUs are refused before anything runs."""
    calls = []
    monkeypatch.setattr(graphs.TorchGraphs, "capture", lambda self, body, devices: calls.append(devices))
    two_gpus = (torch.device("cuda:0"), torch.device("cuda:1"))
    real_split = graphs.split
    monkeypatch.setattr(graphs, "split", lambda plan: replace(real_split(plan), devices=two_gpus))
    with cuda_on_cpu(), graph_backend(graphs.TorchGraphs()):
        model = _two_replica_model("graphs_two_devices")
        before = {name: workspace.FetchBlob(name) for name in workspace.Blobs()}
        with pytest.raises(ValueError, match=r"'cuda_graph'\) launches on 2 devices .*pytorch/pytorch#153025"):
            dpm.RunNet(model, 1)
        assert sorted(workspace.Blobs()) == sorted(before) and calls == []


def test_the_split_names_each_physical_device_once() -> None:
    """Replicas that share a device (a device map onto one GPU; here the CPU) are captured as one."""
    with cuda_on_cpu():
        model = _two_replica_model("graphs_split_devices")
        plan = workspace.get_workspace().nets[model.net.Proto().name]
        assert {step.option.device_id for step in plan.steps} >= {0, 1}
        assert graphs.split(plan).devices == (torch.device("cpu"),)


def test_the_split_loads_what_the_captured_steps_read_before_writing_it_each_blob_once() -> None:
    """Static inputs: the blobs the captured steps read before writing them (a blob read twice, or read
    and rewritten, once), in first-read order; a prologue output they read comes from the prologue."""
    with _recording():
        workspace.FeedBlob("x_host", np.ones(3, np.float32))
        for name in ("gpu_0/y", "gpu_0/z"):
            workspace.FeedBlob(name, np.ones(3, np.float32), GPU0)
        net = _plain_net([OperatorDef("CopyCPUToGPU", ["x_host"], ["gpu_0/xc"], device_option=GPU0),
                          OperatorDef("Add", ["gpu_0/xc", "gpu_0/y"], ["gpu_0/s"], device_option=GPU0),
                          OperatorDef("Mul", ["gpu_0/s", "gpu_0/s"], ["gpu_0/y"], device_option=GPU0),
                          OperatorDef("Add", ["gpu_0/y", "gpu_0/z"], ["gpu_0/z"], device_option=GPU0)])
        workspace.CreateNet(net)
        plan = workspace.get_workspace().nets[net.name]
        cut = graphs.split(plan)
    slot = plan.frame.slot
    assert cut.prologue == (0,) and cut.captured == (1, 2, 3)
    assert cut.loads == (slot["gpu_0/y"], slot["gpu_0/z"]) and cut.from_prologue == (slot["gpu_0/xc"],)


def test_a_net_that_keeps_every_blob_lets_go_of_the_last_runs_values_before_capturing() -> None:
    """Only the graph's own intermediates exist while capturing, not also the last eager run's."""
    alive_at_capture: list[list[str]] = []
    with _recording() as stand_in:
        model = ModelHelper(name="graphs_keep_all")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                        optimizer_builder_fun=_sgd, devices=[0], cuda_graph=True)
        for name, value in _batches((6,), [0], 1)[0].items():
            workspace.FeedBlob(name, value)
        dpm.RunInitNet(model)
        dpm.RunNet(model, graphs.DEFAULT_WARMUP)
        names = ["gpu_0/fc1", "gpu_0/pred", "gpu_0/softmax", "gpu_0/fc1_w_grad"]
        refs = {name: weakref.ref(workspace.FetchTensor(name)) for name in names}

        def check() -> None:
            gc.collect()
            alive_at_capture.append([name for name, ref in refs.items() if ref() is not None])

        stand_in.on_capture = check
        dpm.RunNet(model, 1)
    assert alive_at_capture == [[]]


@pytest.mark.cuda
def test_real_cuda_graph_equals_simple() -> None:
    """On a GPU: the captured MLP and BN CNN steps give the uncaptured run's bits."""
    for forward, shape in ((_mlp, (6,)), (_cnn, (3, 4, 4))):
        expected, _ = _train(forward, shape, [0], 6, net_type="simple")
        got, _ = _train(forward, shape, [0], 6, cuda_graph=True)
        for name, value in expected.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.cuda
def test_on_a_gpu_the_trainer_records_a_captured_bn_model_like_reading_every_step() -> None:
    """On a GPU: the Trainer's losses and LR, held on the device (copies, as a replay overwrites the
    graph's tensors) and read after 6 steps, equal an uncaptured run's read every step."""
    from graphpar.engine import LRScheduler

    rng = np.random.default_rng(0)
    data = [{"data": rng.standard_normal((4, 3, 4, 4)).astype(np.float32),
             "label": rng.integers(0, 3, 4).astype(np.int32)} for _ in range(3)]
    recorded = {}
    for graphed, period in ((False, 1), (True, None)):
        workspace.ResetWorkspace()
        model = ModelHelper(name="graphs_trainer_gpu")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_cnn,
                        optimizer_builder_fun=_sgd, devices=[0], cuda_graph=graphed)
        trainer = Trainer(model, data, [LRScheduler()], max_iter=6, record_period=period)
        trainer.train()
        recorded[graphed] = {name: trainer.storage.history[name] for name in ("scaled_loss", "lr")}
    assert recorded[True] == recorded[False]


def test_the_trainer_with_lean_memory_trains_a_captured_model_like_an_uncaptured_one() -> None:
    """The recommended GPU path: Trainer (lean_memory on CUDA) over Parallelize(cuda_graph=True)."""
    rng = np.random.default_rng(0)
    data = [{"data": rng.standard_normal((4, 6)).astype(np.float32), "label": rng.integers(0, 3, 4).astype(np.int32)}
            for _ in range(3)]
    params, recorded = {}, {}
    for graphed in (False, True):
        with _recording() as stand_in:
            workspace.ResetWorkspace()
            model = ModelHelper(name="graphs_trainer")
            dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                            optimizer_builder_fun=_sgd, devices=[0, 1], cuda_graph=graphed)
            trainer = Trainer(model, data, max_iter=6)
            trainer.train()
            params[graphed] = {re.sub(r"Optimizer_\d+", "Optimizer", str(name)): workspace.FetchBlob(name)
                               for name in dpm.GetCheckpointParams(model)}
            losses = recorded[graphed] = trainer.storage.history["scaled_loss"]
        assert stand_in.replays == (6 - graphs.DEFAULT_WARMUP if graphed else 0) and len(losses) == 6
    assert recorded[True] == recorded[False]  # read after 6 steps: a replay overwrites the graph's tensors
    for name, value in params[False].items():
        np.testing.assert_array_equal(params[True][name], value, err_msg=name)


def test_a_replaced_captured_net_is_freed_with_its_graph() -> None:
    """The runtime holding a captured step must not keep its plan (and the graph's memory) alive."""
    with _recording():
        workspace.FeedBlob("gpu_0/x", np.ones(3, np.float32), GPU0)
        net = _plain_net([OperatorDef("Relu", ["gpu_0/x"], ["gpu_0/r"], device_option=GPU0)])
        workspace.CreateNet(net)
        workspace.RunNet(net.name, 3)
        plan = weakref.ref(workspace.get_workspace().nets[net.name])
        assert runtime_of(plan()).graph is not None
        workspace.CreateNet(net, overwrite=True)
        gc.collect()
    assert plan() is None


def test_the_replay_waits_for_the_state_check_so_a_changed_state_blob_changes_nothing():
    """The captured steps replay at the last phase, after the state check of every run: a momentum
    blob fed with another dtype after the capture makes RunNet raise before the replay, and the batch
    norm running statistics (which a replay updates in place) and the params are unchanged."""
    with _recording() as stand_in:
        _, model = _train(_cnn, (3, 4, 4), [0], 4, cuda_graph=True)
        assert len(stand_in.captures) == 1 and stand_in.replays == 2
        names = ["gpu_0/bn_rm", "gpu_0/bn_riv", "gpu_0/conv_w", "gpu_0/pred_w"]
        before = {name: workspace.FetchBlob(name).copy() for name in names}
        momentum = workspace.FetchBlob("gpu_0/pred_w_momentum")
        workspace.FeedBlob("gpu_0/pred_w_momentum", momentum.astype(np.float64))
        with pytest.raises(OperatorError, match="pred_w_momentum.*float64"):
            dpm.RunNet(model, 1)
        assert stand_in.replays == 2
    for name, value in before.items():
        np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)
