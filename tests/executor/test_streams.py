"""CUDA streams in the dag executor, checked through a recording stand-in for torch.cuda streams."""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core import CPU, CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.devices import cuda_on_cpu
from graphpar.executor import get_executor
from graphpar.executor.streams import NO_STREAMS, TORCH_STREAMS, RunStreams, current_streams, stream_backend
from tests.fake_cuda import FakeCuda


class FakeStreams:
    """Records what is asked of streams, in order; streams and events are named strings."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.names = itertools.count(1)
        self.device_of: dict[str, str] = {}

    def active(self, device: torch.device) -> bool:
        return True  # logical CUDA devices placed on the CPU count as stream devices here

    def new_stream(self, device: torch.device) -> str:
        return f"s{next(self.names)}"

    @contextmanager
    def use(self, stream: str):  # noqa: ANN201
        self.log.append(("run on", stream))
        yield

    def record(self, stream: str) -> str:
        event = f"e{next(self.names)}"
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream: str, event: str) -> None:
        self.log.append(("wait", stream, event))

    def current_stream(self, device: torch.device) -> str:
        return f"current@{threading.current_thread().name}"  # current streams are per thread

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("keep alive on", stream))

    def synchronize(self, event: str) -> None:
        self.log.append(("host waits", event))


def _net(net_type: str = "dag", cpu_replica: bool = True) -> NetDef:
    """Steps on two CUDA devices; with `cpu_replica`, a last step on a second CPU device, so that two
    CPU devices compute and the dag runs on worker threads (without it, one launching thread)."""
    gpu0, gpu1 = DeviceOption(CUDA, 0), DeviceOption(CUDA, 1)
    extra = [OperatorDef("Relu", ["c_host"], ["e_host"], device_option=DeviceOption(CPU, 1))] if cpu_replica else []
    return NetDef(f"streams_{net_type}", [
        OperatorDef("Relu", ["gpu_0/x"], ["gpu_0/a"], device_option=gpu0),               # 0
        OperatorDef("Relu", ["gpu_1/x"], ["gpu_1/b"], device_option=gpu1),               # 1
        OperatorDef("Copy", ["gpu_0/a"], ["gpu_1/a"], {"input_device_ids": [0]}, gpu1),  # 2: after 0
        OperatorDef("Add", ["gpu_1/a", "gpu_1/b"], ["gpu_1/c"], device_option=gpu1),     # 3: after 1, 2
        OperatorDef("CopyGPUToCPU", ["gpu_1/c"], ["c_host"], device_option=gpu1),        # 4: after 3
        OperatorDef("Relu", ["c_host"], ["d_host"], device_option=DeviceOption(CPU, 0)),  # 5: host step
        *extra,
    ], type=net_type, num_workers=4)


def _feed() -> None:
    for name in ("gpu_0/x", "gpu_1/x"):
        workspace.FeedBlob(name, np.ones(3, np.float32))


def _plan_and_frame():  # noqa: ANN202
    _feed()
    plan = workspace.get_workspace().create_net(_net())
    frame: list = [None] * len(plan.frame.names)
    for load in plan.frame.loads:
        frame[load.slot] = workspace.FetchTensor(load.name)
    return plan, frame


def test_the_wiring_of_one_run_step_by_step():
    """Two workers: A runs steps 0, 2, 3, 4 and the host step 5; B runs step 1."""
    fake = FakeStreams()
    with cuda_on_cpu():
        plan, frame = _plan_and_frame()
        streams = RunStreams(fake, plan, frame)
        worker_a: dict = {}
        worker_b: dict = {}
        for index, worker in ((0, worker_a), (1, worker_b), (2, worker_a), (3, worker_a), (4, worker_a),
                              (5, worker_a)):
            streams.run(index, worker)
        streams.finish()
    gpu0, gpu1 = DeviceOption(CUDA, 0), DeviceOption(CUDA, 1)
    assert worker_a == {gpu0: "s3", gpu1: "s7"} and worker_b == {gpu1: "s5"}
    caller = "current@MainThread"  # the run starts from the caller's current stream on each device
    assert fake.log == [
        ("record", caller, "e1"), ("record", caller, "e2"),  # devices 0 and 1, when the run starts
        ("wait", "s3", "e1"), ("keep alive on", "s3"), ("run on", "s3"), ("record", "s3", "e4"),
        ("wait", "s5", "e2"), ("keep alive on", "s5"), ("run on", "s5"), ("record", "s5", "e6"),
        # step 2 (a copy from device 0) on A's stream for device 1: waits for device 1's start and step 0
        ("wait", "s7", "e2"), ("wait", "s7", "e4"), ("keep alive on", "s7"), ("run on", "s7"),
        ("record", "s7", "e8"),
        # step 3 reads step 1 (B's stream) and step 2 (its own stream): one wait
        ("wait", "s7", "e6"), ("keep alive on", "s7"), ("keep alive on", "s7"), ("run on", "s7"),
        ("record", "s7", "e9"),
        ("keep alive on", "s7"), ("run on", "s7"), ("record", "s7", "e10"),
        ("host waits", "e10"),  # the host step reads what step 4 copied to the CPU
        # the caller's streams wait for every stream used
        ("record", "s3", "e11"), ("wait", caller, "e11"), ("record", "s5", "e12"), ("wait", caller, "e12"),
        ("record", "s7", "e13"), ("wait", caller, "e13"),
    ]
    np.testing.assert_array_equal(frame[plan.frame.slot["d_host"]], [2.0] * 3)


def test_the_dag_executor_runs_through_the_injected_backend(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")
    fake, before = FakeStreams(), current_streams()  # torch's streams on a machine with a GPU
    with cuda_on_cpu(), stream_backend(fake):
        assert current_streams() is fake
        _feed()
        workspace.RunNetOnce(_net("dag"))
    assert current_streams() is before
    with cuda_on_cpu():
        assert current_streams() is NO_STREAMS  # logical CUDA placed on the CPU: no streams, GPU or not
    np.testing.assert_array_equal(workspace.FetchBlob("d_host"), [2.0] * 3)
    actions = [entry[0] for entry in fake.log]
    assert actions.count("run on") == 5 and 1 <= actions.count("host waits") <= 2  # one per host step's worker
    # the workers' streams start after, and end before, the caller's current streams (not the workers')
    caller = "current@MainThread"
    starts = {entry[2] for entry in fake.log if entry[0] == "record" and entry[1] == caller}
    streams_used = sum(1 for entry in fake.log if entry[0] == "wait" and entry[2] in starts)
    joins = [entry for entry in fake.log if entry[0] == "wait" and entry[1].startswith("current@")]
    assert len(starts) == 2 and len(joins) == streams_used >= 2 and {entry[1] for entry in joins} == {caller}


def test_one_launching_thread_when_workers_cannot_win(monkeypatch: pytest.MonkeyPatch):
    """CUDA steps and one CPU device: the dag launches everything from the calling thread, in program
    order, on the default streams (no stream or event work, no worker hand-offs)."""
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")
    fake = FakeStreams()
    with cuda_on_cpu(), stream_backend(fake):
        _feed()
        threads = set()
        workspace.RunNetOnce(_net("dag", cpu_replica=False))
        plan = workspace.get_workspace().create_net(_net("dag", cpu_replica=False))
        original = plan.steps[0].kernel

        def spy(*args):  # noqa: ANN202
            threads.add(threading.current_thread().name)
            return original(*args)

        timed = plan.with_steps((plan.steps[0].with_kernel(spy), *plan.steps[1:]))
        get_executor("dag").run(timed, workspace.get_workspace().blobs)
    assert fake.log == [] and threads == {"MainThread"}
    np.testing.assert_array_equal(workspace.FetchBlob("d_host"), [2.0] * 3)


def test_torch_streams_start_from_the_callers_current_stream(monkeypatch: pytest.MonkeyPatch):
    """A caller that runs the net inside `torch.cuda.stream(s)` fed its inputs on `s`: the run's
    streams wait for `s`, and `s` waits for them (recording stand-ins for torch.cuda)."""
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(TORCH_STREAMS, "active", lambda device: True)
    mine = fake.Stream("cpu")
    with cuda_on_cpu():
        plan, frame = _plan_and_frame()
        with fake.stream(mine):
            streams = RunStreams(TORCH_STREAMS, plan, frame)
        worker: dict = {}
        thread = threading.Thread(target=lambda: [streams.run(index, worker) for index in range(5)])
        thread.start()  # a worker thread, whose current stream is not the caller's
        thread.join()
        with fake.stream(mine):
            streams.finish()
    starts = [entry for entry in fake.log if entry[0] == "record" and entry[1] == mine.name]
    joins = [entry for entry in fake.log if entry[0] == "wait" and entry[1] == mine.name]
    assert len(starts) == 2 and len(joins) == 2  # two logical devices, one worker stream each
    assert all(entry[1] != "default@cpu" for entry in fake.log)
