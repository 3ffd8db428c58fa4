"""A recording stand-in for torch.cuda's streams, events, graphs and graph memory pools, for the CUDA
paths that launch work (tests/fake_gpus.py fakes the device queries). Streams and events are named
objects; the current stream is per thread and device, as torch's is; every call is logged in order.

Nothing runs on a GPU: what a path launches while a stand-in stream is current runs on the CPU (under
`graphpar.devices.cuda_on_cpu()`), so a test checks the calls, the streams and the order, not the
asynchrony. A graph's replay does not rerun its capture (a real one reruns the captured kernels): use
`tests/executor/test_graphs.RecordingGraphs` to check what replays compute.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch


def _key(device: Any, gpus: int | None = None) -> str:
    """The name of `device`; with `gpus`, a CUDA device id outside the machine raises as torch does."""
    if device is None:
        return "cuda"
    index = device if isinstance(device, int) else torch.device(device).index
    if gpus is not None and index is not None and not 0 <= index < gpus:
        raise AssertionError(f"Invalid device id {index} (fake machine with {gpus} GPUs)")
    return f"cuda:{device}" if isinstance(device, int) else str(device)


class FakeEvent:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.cuda.log.append(("record", stream.name, self.name))

    def synchronize(self) -> None:
        self.cuda.log.append(("host waits", self.name))

    def __repr__(self) -> str:
        return self.name


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str, device: str) -> None:
        self.cuda, self.name, self.device = cuda, name, device

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.name))

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or self.cuda.Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return self.name


class FakeGraph:
    """torch.cuda.CUDAGraph: capture_begin/capture_end on the current stream, replay, reset."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.ended = cuda, False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **options: Any) -> None:
        stream = self.cuda.current_stream()
        self.cuda.log.append(("capture begins", stream.name, pool, capture_error_mode))
        self.cuda.pools_in_use.add(pool)
        self.pool, self.device = pool, stream.device

    def capture_end(self) -> None:
        if self.cuda.capture_invalidated:  # what a failed op does to a real capture
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.cuda.log.append(("capture ends", self.cuda.current_stream().name))
        self.ended = True

    def replay(self) -> None:  # on the current stream of the capture's device
        self.cuda.log.append(("replay", self.cuda.current_stream(self.device).name))

    def reset(self) -> None:
        self.cuda.log.append(("graph reset",))
        if self.ended:  # as CUDAGraph::reset: only an ended capture releases its pool
            self.cuda.pools_in_use.discard(self.pool)


class FakeCuda:
    """The stand-in (see the module docstring); `install(monkeypatch)` puts it in torch.cuda."""

    def __init__(self, gpus: int | None = None) -> None:
        """`gpus`: the machine's GPU count, against which device ids are checked (None: not checked)."""
        self.gpus = gpus
        self.log: list[tuple] = []
        self.names = itertools.count(1)
        self.pools = itertools.count(1)
        self.pools_in_use: set[Any] = set()
        self.capture_invalidated = False  # set by a test: capture_end raises as after a failed op
        self._current = threading.local()
        self._default: dict[str, FakeStream] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        cuda = torch.cuda
        for name in ("Stream", "Event", "stream", "current_stream", "default_stream", "device", "synchronize",
                     "empty_cache", "graph_pool_handle", "current_device"):
            monkeypatch.setattr(cuda, name, getattr(self, name))
        monkeypatch.setattr(cuda, "CUDAGraph", lambda: FakeGraph(self))
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", self._end_allocate, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", self._release_pool, raising=False)
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)  # torch.cuda.graph's
        return self

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch's name
        return FakeStream(self, f"s{next(self.names)}", _key(device, self.gpus))

    def Event(self, *args: Any, **kwargs: Any) -> FakeEvent:  # noqa: N802 - torch's name
        return FakeEvent(self, f"e{next(self.names)}")

    def default_stream(self, device: Any = None) -> FakeStream:
        key = _key(device, self.gpus)
        if key not in self._default:
            self._default[key] = FakeStream(self, f"default@{key}", key)
        return self._default[key]

    def current_stream(self, device: Any = None) -> FakeStream:
        current = getattr(self._current, "streams", {})
        return current.get(_key(device, self.gpus)) or current.get("cuda") or self.default_stream(device)

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        if not hasattr(self._current, "streams"):
            self._current.streams = {}
        streams = self._current.streams
        old = dict(streams)
        streams[stream.device] = streams["cuda"] = stream
        try:
            yield
        finally:
            streams.clear()
            streams.update(old)

    @contextmanager
    def device(self, device: Any) -> Iterator[None]:
        self.log.append(("device", _key(device)))
        yield

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize", _key(device)))

    def empty_cache(self) -> None:
        self.log.append(("empty cache",))

    def graph_pool_handle(self) -> tuple[int, int]:
        return (0, next(self.pools))

    def _end_allocate(self, device: int, pool: Any) -> None:
        self.log.append(("end allocating to pool", device, pool))

    def _release_pool(self, device: int, pool: Any) -> None:
        self.log.append(("release pool", device, pool))
        self.pools_in_use.discard(pool)

