"""DeviceFeeder: load and prepare the next batches on a background thread while the net runs.

    feeder = DeviceFeeder(torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=4), model)
    for batch in feeder:            # one epoch; iterate again for the next
        feed(model, batch)          # cheap: the batch is already scattered (and on its devices)
        RunNet(model, 1)
    feeder.close()                  # or `with DeviceFeeder(...) as feeder:`

A thread pulls batches from the iterable, scatters and checks them for the model's devices
(`graphpar.data.prepare`) and, on real CUDA devices, copies each device's arrays into pinned host
memory and then to the device on a side stream of that device, recording an event (MMCV's async
scatter); `feed` makes the device's current stream wait for the event before it uses the values. At
most `depth` prepared batches wait in a bounded queue, so loading runs ahead of compute by that
much. An exception in the loader (or in a DataLoader worker, which the DataLoader re-raises) is
re-raised by the consumer's `next()` with its original traceback. `close()` (also on leaving a
`with` block, on starting another epoch, and when a consumer drops the epoch's iterator) stops the
thread and joins it.

On CPU (and logical CUDA devices placed on the CPU) there is no copy to make: the thread overlaps the
loading with the step the same way. The CUDA copy path has been run here only with a recording
stand-in for the copier (no GPU on the development machine).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from graphpar.core.ir import CUDA
from graphpar.data import Prepared, prepare
from graphpar.devices import cuda_is_simulated

__all__ = ["CudaCopier", "DeviceFeeder"]


class CudaCopier:
    """Host-to-device copies on one side stream per CUDA device, through pinned host memory."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def _stream(self, device: int) -> Any:
        import torch

        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def copy(self, device: int, value: Any) -> Any:
        """`value` on CUDA `device`, copied asynchronously on the device's side stream."""
        import torch

        tensor = torch.as_tensor(value)
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        with torch.cuda.stream(self._stream(device)):
            return tensor.to(torch.device("cuda", device), non_blocking=True)

    def record(self, device: int) -> Any:
        """An event recorded on the device's side stream after the copies queued so far."""
        import torch

        event = torch.cuda.Event()
        event.record(self._stream(device))
        return event

    def wait(self, device: int, event: Any, values: Iterable[Any]) -> None:
        """Make the device's current stream wait for `event`; mark the copies as used there
        (`record_stream`), so the allocator does not reuse their memory early."""
        import torch

        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        for value in values:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(current)


class DeviceFeeder:
    """Prefetch the batches of `iterable` for `model` on a background thread (see the module docstring).

    Args:
        iterable: any iterable of batches `graphpar.data.feed` accepts (a DataLoader, a generator
            function's result for one epoch only, a list).
        model: the parallelized model the batches are for.
        depth: at most this many prepared batches wait (>= 1).
        dim: the batch axis.
        copier: the host-to-device copier; default `CudaCopier()` for real CUDA devices, none on CPU.
    """

    def __init__(self, iterable: Iterable[Any], model: Any, depth: int = 2, dim: int = 0,
                 copier: Any = None) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"DeviceFeeder: depth must be an int >= 1, got {depth!r}")
        model.GetDevices()  # a parallelized model, checked now
        self.iterable, self.model, self.depth, self.dim = iterable, model, depth, dim
        cuda = model._parallel.layout.device_type == CUDA and not cuda_is_simulated()
        self.copier = copier if copier is not None else (CudaCopier() if cuda else None)
        self._epoch: _Epoch | None = None

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Prepared]:
        """One epoch: a new thread over `iter(iterable)` (an epoch still running is closed first)."""
        self.close()
        self._epoch = _Epoch(self)
        return self._epoch

    def close(self) -> None:
        """Stop and join the loading thread (idempotent)."""
        if self._epoch is not None:
            self._epoch.close()
            self._epoch = None

    def __enter__(self) -> DeviceFeeder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _prepare(model: Any, dim: int, copier: Any, batch: Any) -> Prepared:
    """`data.prepare`, then (with a copier) each array copied to its device and an event per device."""
    prepared = prepare(model, batch, dim)
    if copier is not None:
        prepared.blobs = [{name: copier.copy(d, value) if _is_array(value) else value
                           for name, value in per_device.items()}
                          for d, per_device in zip(prepared.devices, prepared.blobs)]
        prepared.ready = [copier.record(d) for d in prepared.devices]
        prepared.copier = copier
    return prepared


def _is_array(value: Any) -> bool:
    return getattr(value, "ndim", 0) > 0


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _load(iterable: Iterable[Any], work: Callable[[Any], Prepared], out: queue.Queue, stop: threading.Event) -> None:
    """The loading thread: prepare each batch of one pass into `out` until the end, an error or `stop`."""
    iterator = None
    try:
        iterator = iter(iterable)
        while not stop.is_set():  # checked before pulling: nothing is loaded after close()
            try:
                batch = next(iterator)
            except StopIteration:
                _put(out, stop, _END)
                return
            _put(out, stop, work(batch))
    except BaseException as error:  # handed to the consumer, who re-raises it
        _put(out, stop, _Failure(error))
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()


def _put(out: queue.Queue, stop: threading.Event, item: Any) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


class _Epoch(Iterator[Prepared]):
    """One pass over the iterable: the loading thread and the consumer's end of the queue."""

    def __init__(self, feeder: DeviceFeeder) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=feeder.depth)
        self._stop = threading.Event()
        self._done = False
        # The thread holds no reference to this object or the feeder, so dropping both stops it (__del__).
        work = functools.partial(_prepare, feeder.model, feeder.dim, feeder.copier)
        self.thread = threading.Thread(target=_load, args=(feeder.iterable, work, self._queue, self._stop),
                                       name="graphpar-DeviceFeeder", daemon=True)
        self.thread.start()

    def __next__(self) -> Prepared:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("DeviceFeeder: the loading thread stopped without a batch or an "
                                       "error (was the feeder closed?)") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            item.error.add_note("(raised in the DeviceFeeder's loading thread)")
            raise item.error
        return item

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread, drop what it prepared, and join it (a loader stuck in `next()` for more
        than `timeout` seconds is left behind: the thread is a daemon)."""
        self._done = True
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=0.05)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # None: __init__ was interrupted (Ctrl-C) before it was made
        if stop is not None:
            stop.set()
