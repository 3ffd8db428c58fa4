"""CUDA streams for the concurrent executor: one stream per worker and device, events between them.

CUDA kernels launch asynchronously on a stream. When the "dag" executor runs a plan's CUDA steps on
several worker threads, each worker launches on a stream of its own for each device, so steps of
different workers overlap on the GPU too. Order is kept by events: a step waits for the events of
its predecessors that ran on another stream; every stream first waits for the caller's current
stream on its device (where the values the run reads were produced: the default stream, or the
stream the caller made current with `torch.cuda.stream`), taken when the run starts, in the calling
thread (current streams are per thread); a tensor read on another stream than the one that made it
is marked with `record_stream`, so the caching allocator does not reuse its memory early; at the
end of the run the caller's stream on every device waits for all the streams the run used, so the
workspace's blobs are ready for whatever the caller runs next.

The backend is injectable (`stream_backend`): `TorchStreams` on real GPUs, `NO_STREAMS` elsewhere
(logical CUDA devices placed on the CPU run like CPU ones), and a recording fake in the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch

from graphpar.core.ir import CUDA, DeviceOption
from graphpar.executor.program import step_runs
from graphpar.platform.devices import cuda_is_simulated

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet


class StreamBackend(Protocol):
    """What the dag executor needs of CUDA streams (see the module docstring)."""

    def active(self, device: torch.device) -> bool:
        """Whether steps on `device` run on streams (False: launch as usual)."""
        ...

    def new_stream(self, device: torch.device) -> Any: ...

    def use(self, stream: Any) -> Any:
        """A context manager making `stream` current."""
        ...

    def record(self, stream: Any) -> Any:
        """An event recorded on `stream` now."""
        ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on `device`."""
        ...

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor.record_stream(stream)`: its memory is not reused before `stream` is done with it."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the calling (host) thread until `event` has happened."""
        ...


class TorchStreams:
    """torch.cuda streams and events (real GPUs)."""

    def active(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def use(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def keep_alive(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class NoStreams:
    """No streams: every step launches as it would outside the executor."""

    def active(self, device: torch.device) -> bool:
        return False

    def new_stream(self, device: torch.device) -> None:
        return None

    def use(self, stream: Any) -> Any:
        return nullcontext()

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def current_stream(self, device: torch.device) -> None:
        return None

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        return None

    def synchronize(self, event: Any) -> None:
        return None


NO_STREAMS = NoStreams()
TORCH_STREAMS = TorchStreams()
_backend: StreamBackend | None = None


class RunStreams:
    """The streams and events of one run of a plan on a stream backend (see the module docstring)."""

    def __init__(self, backend: StreamBackend, plan: CompiledNet, frame: list) -> None:
        """Made in the calling thread, when the run starts: it takes the caller's current streams."""
        self.backend, self.plan, self.frame = backend, plan, frame
        self.runs = step_runs(plan)
        self.events: list[Any] = [None] * len(plan.steps)  # the event after each step that ran on a stream
        self.streams: list[Any] = [None] * len(plan.steps)
        self.caller: dict[DeviceOption, Any] = {}  # per device: the caller's current stream
        self.start: dict[DeviceOption, Any] = {}  # per device: an event on it before the run
        for step in plan.steps:
            if step.option.device_type == CUDA and step.option not in self.caller and backend.active(step.device):
                self.caller[step.option] = backend.current_stream(step.device)
                self.start[step.option] = backend.record(self.caller[step.option])
        self.ready: set[int] = set()  # streams (by id) that waited for the caller's stream
        self.used: dict[int, tuple[Any, DeviceOption]] = {}

    def run(self, index: int, worker_streams: dict[DeviceOption, Any]) -> None:
        """Run step `index` on this worker's stream for its device (a host step: after its inputs)."""
        backend, step = self.backend, self.plan.steps[index]
        before = [i for i in self.plan.dependencies[index] if self.events[i] is not None]
        if step.option.device_type != CUDA or not backend.active(step.device):
            for i in before:  # a host step reading what a stream computed
                backend.synchronize(self.events[i])
            self.runs[index](self.frame)
            return
        stream = worker_streams.get(step.option)
        if stream is None:
            stream = worker_streams[step.option] = backend.new_stream(step.device)
        if id(stream) not in self.ready:
            backend.wait(stream, self.start[step.option])
            self.ready.add(id(stream))
        for i in before:
            if self.streams[i] is not stream:
                backend.wait(stream, self.events[i])
        frame = self.frame
        for slot in step.inputs:
            value = frame[slot]
            if isinstance(value, torch.Tensor):
                backend.keep_alive(value, stream)
        with backend.use(stream):
            self.runs[index](frame)
        self.events[index] = backend.record(stream)
        self.streams[index] = stream
        self.used[id(stream)] = (stream, step.option)

    def finish(self) -> None:
        """Make the caller's stream on every device wait for all the streams this run used."""
        for stream, option in self.used.values():
            self.backend.wait(self.caller[option], self.backend.record(stream))


def current_streams() -> StreamBackend:
    """The stream backend runs use now: the injected one, else torch's on real GPUs, else none."""
    if _backend is not None:
        return _backend
    return TORCH_STREAMS if torch.cuda.is_available() and not cuda_is_simulated() else NO_STREAMS


@contextmanager
def stream_backend(backend: StreamBackend) -> Iterator[None]:
    """Runs inside the block use `backend` for their CUDA steps (the tests inject a recording fake)."""
    global _backend
    old, _backend = _backend, backend
    try:
        yield
    finally:
        _backend = old
