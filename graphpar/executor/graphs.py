"""The "cuda_graph" executor: after warm-up, a whole step is captured once in a CUDA graph and replayed.

Launching a step's kernels one by one costs the host microseconds per op; a CUDA graph replays all of
them with one call. A net of type `"cuda_graph"` (`Parallelize(..., cuda_graph=True)`, or
`net.Proto().type = "cuda_graph"`) runs its first `cuda_graph_warmup` runs (a net argument, default
2) as "simple" does, so that lazy initialisation (cuBLAS handles, cuDNN autotuning, the caching
allocator) happens outside the capture. The next run captures the step and replays it; every later
run replays it.

The warm-up runs launch on the stream the capture will use (`GraphBackend.warming`, as
`torch.cuda.make_graphed_callables` warms up on its side stream): what kernels initialise per stream
(cuBLAS workspaces) then exists before the capture.

A step is split once, when the net first runs (`split`):
- the *host prologue*: the steps that read only host values (blobs that live on the CPU, such as the
  iteration counter, and what such steps compute), e.g. `Iter` and `LearningRate`. They run eagerly
  before each replay, since a graph would replay their values unchanged; their outputs that the
  captured steps read are static device buffers the prologue's fresh values are copied into;
- the *captured* steps: everything else (the forward and backward pass, the all-reduce of several
  replicas, the updates). They read the workspace's blobs through static buffers: the tensors the
  workspace held at capture. A blob fed (`FeedBlob`) or loaded since is copied into its static
  buffer before the replay, and the workspace holds the static buffer again after the run.

A step that cannot be captured raises a ValueError naming the op when the net first runs, before
anything changed: an op placed on the CPU that reads a value the captured steps compute, an op that
draws random numbers (its per-run seeds would be replayed unchanged), a captured op that reads a
host blob (Adam's iteration count, Reshape's sizes input) or reads device tensors' values on the
host (Trait.HOST_SYNC without a host-placed input, e.g. CheckFinite; fills are let through, since
they read only their input's shape unless `input_as_shape`). A kernel that still reads a device value on the host (`.item()`) fails
the real capture (CUDA refuses the read while capturing); the error names the op like any failed
op. A blob fed with another shape or dtype than at capture raises a ValueError naming it (a graph
replays fixed shapes: recreate the net). There is no silent fallback, with one exception: where no
CUDA graph backend exists (no GPU, or logical CUDA devices placed on the CPU), the net runs as
"simple" after logging why once. torch.cuda graphs hold one device's work, so on real GPUs a step
on several physical devices is refused at the first run (`TorchGraphs.check`); replicas that a
device map puts on one GPU are one device there and are captured together. The split, the static
buffers and the replay handle several devices, as the tests show with a stand-in.

A capture that fails (an op's kernel raises while being captured) is closed and its memory pool
released before the op's error is raised, naming the op as for any failed run; the next run tries
the capture again. Before capturing, the run drops its references to the previous run's values of
the blobs the captured steps write (a net that keeps every blob would otherwise hold them and the
graph's own copies at once), and `TorchGraphs` returns the cached blocks to the driver for the
graph's pool, as `torch.cuda.graph` does.

Results are bit-identical to "simple": the same kernels run in the same order on the same values
(`program.straight_line` over the captured steps). After a run, the blobs the captured steps wrote
are the graph's own tensors, which the next replay overwrites: fetch copies (FetchBlob) to keep a
value. The graph backend is injectable (`graph_backend`), as the stream backend is: the tests run the
whole path on the CPU with a stand-in that records the capture and runs the captured body on replay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from graphpar.core.capture import capture
from graphpar.core.dataflow import facts
from graphpar.core.graph import blob_devices
from graphpar.core.ir import CUDA, DeviceOption, OperatorDef
from graphpar.core.schema import Trait, get_schema
from graphpar.executor.failure import op_location, recorded_at
from graphpar.executor.program import StepFailed, step_runs, straight_line
from graphpar.executor.run import run_plan, serial
from graphpar.executor.runtime import Runtime, runtime_of
from graphpar.platform.devices import cuda_is_simulated

if TYPE_CHECKING:
    from graphpar.core.ir import NetDef
    from graphpar.executor.plan import CompiledNet, Phase

log = logging.getLogger(__name__)

WARMUP_ARG = "cuda_graph_warmup"  # net argument: eager runs before the capture
DEFAULT_WARMUP = 2


class GraphBackend(Protocol):
    """Captures a step's launches once and replays them (see the module docstring)."""

    def check(self, net_name: str, devices: Sequence[torch.device]) -> None:
        """Raise ValueError if a step launching on `devices` cannot be captured (at the net's first run)."""
        ...

    def warming(self, devices: Sequence[torch.device]) -> AbstractContextManager[Any]:
        """The context the warm-up runs launch in: on the stream(s) the capture will use."""
        ...

    def capture(self, body: Callable[[], None], devices: Sequence[torch.device]) -> Callable[[], None]:
        """Capture what `body` launches on `devices`; return the replay. If `body` raises, close the
        capture, release what it allocated and re-raise `body`'s exception."""
        ...


class TorchGraphs:
    """torch.cuda graphs: one graph per step, captured on a side stream of the step's one device.

    PyTorch's graphs hold one device's work: memory that a capture allocates on another device does
    not go to the graph's private pool, so the allocator could hand it out again while the graph still
    uses it (pytorch/pytorch#153025). Steps on several devices are refused. The warm-up runs and the
    capture use one side stream per device, which first waits for the caller's current stream; the
    caller's stream waits for the warm-up's work, and replays launch on the caller's stream."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def check(self, net_name: str, devices: Sequence[torch.device]) -> None:
        if len(devices) > 1:
            raise ValueError(
                f"net {net_name!r} (type 'cuda_graph') launches on {len(devices)} devices "
                f"({', '.join(map(str, devices))}); torch.cuda graphs capture one device's work "
                f"(pytorch/pytorch#153025). Use one device per process, or net type 'dag'")

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    @contextmanager
    def warming(self, devices: Sequence[torch.device]) -> Iterator[None]:
        (device,) = devices
        stream, caller = self._stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            caller.wait_stream(stream)

    def capture(self, body: Callable[[], None], devices: Sequence[torch.device]) -> Callable[[], None]:
        (device,) = devices
        graph, pool, stream = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), self._stream(device)
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # what the run let go of becomes free for the graph's pool
            with torch.cuda.stream(stream):
                # thread_local: other threads (a DeviceFeeder's copies) may use CUDA while this one captures
                graph.capture_begin(pool, capture_error_mode="thread_local")
                try:
                    body()
                except BaseException:
                    _abandon(graph, device, pool)
                    raise
                try:
                    graph.capture_end()
                except BaseException:
                    _release_pool(device, pool)
                    raise
        return graph.replay


def _abandon(graph: Any, device: torch.device, pool: Any) -> None:
    """Close a capture whose body raised and release its memory pool (the body's error is what the
    caller raises: the capture's own, e.g. `operation not permitted when stream is capturing`, is
    only a consequence). A capture that still ends cleanly is reset, which releases its pool."""
    try:
        graph.capture_end()
    except Exception as exc:  # an invalidated capture: the graph never owned its pool
        log.debug("closing a failed CUDA graph capture: %s", exc)
        _release_pool(device, pool)
    else:
        graph.reset()


def _release_pool(device: torch.device, pool: Any) -> None:
    """Stop routing allocations to a failed capture's private pool and release it (a capture that
    never ended does not release it: `CUDAGraph::reset` only does after `capture_end`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:  # capture_end got that far before failing
        pass
    torch._C._cuda_releasePool(index, pool)


TORCH_GRAPHS = TorchGraphs()
_backend: GraphBackend | None = None


def current_graphs() -> GraphBackend | None:
    """The graph backend: the injected one, else torch's on real GPUs, else None (no capture)."""
    if _backend is not None:
        return _backend
    return TORCH_GRAPHS if torch.cuda.is_available() and not cuda_is_simulated() else None


@contextmanager
def graph_backend(backend: GraphBackend) -> Iterator[None]:
    """Runs inside the block capture with `backend` (the tests inject a recording stand-in)."""
    global _backend
    old, _backend = _backend, backend
    try:
        yield
    finally:
        _backend = old


@dataclass(frozen=True)
class Split:
    """A plan split for capture: host prologue steps, captured steps, and the static inputs."""

    prologue: tuple[int, ...]  # in plan order
    captured: tuple[int, ...]  # in plan order
    loads: tuple[int, ...]  # workspace blobs the captured steps read: their slots
    from_prologue: tuple[int, ...]  # prologue outputs the captured steps read: their slots
    devices: tuple[torch.device, ...]  # the physical devices of the captured steps, in order of first use


def split(plan: CompiledNet) -> Split:
    """Split `plan` into host prologue and captured steps; ValueError naming an op that cannot be captured."""
    netdef = plan.netdef
    devices = blob_devices(netdef)
    host = {blob for blob, option in devices.items() if option.device_type != CUDA}
    prologue: list[int] = []
    in_prologue: set[int] = set()
    for j in plan.order:
        op = netdef.ops[j]
        if (op.inputs and all(blob in host for blob in op.inputs)) or plan.steps[j].option.device_type != CUDA:
            late = [i for i in plan.dependencies[j] if i not in in_prologue]
            if late:
                _refuse(plan, j, f"it runs on the host and must follow op #{late[0]} "
                                 f"({netdef.ops[late[0]].type}), which the graph would capture")
            prologue.append(j)
            in_prologue.add(j)
            host.update(op.outputs)
    captured = tuple(j for j in plan.order if j not in in_prologue)
    if not captured:
        raise ValueError(f"net {netdef.name!r} (type 'cuda_graph') has no op on a CUDA device to capture in a "
                         f"CUDA graph; run it as 'simple' or 'dag'")
    # what the captured steps read before they write it (in plan order): the graph's static inputs
    read_first: dict[int, list[str]] = {}
    for blob, load in facts([netdef.ops[j] for j in captured]).loads.items():
        read_first.setdefault(captured[load.reader], []).append(blob)
    loads: dict[int, None] = {}
    from_prologue: dict[int, None] = {}
    prologue_out = {slot for j in prologue for slot in plan.steps[j].outputs}
    for j in captured:
        step, op = plan.steps[j], netdef.ops[j]
        schema = get_schema(op.type)
        if schema.has(Trait.RANDOM):
            _refuse(plan, j, "it draws random numbers from per-run seeds, which a graph would replay unchanged")
        if _reads_device_values(op):
            _refuse(plan, j, "it reads tensor values on the host (Trait.HOST_SYNC), which a capture cannot do")
        for blob in read_first.get(j, ()):
            if devices[blob].device_type != CUDA:
                _refuse(plan, j, f"it reads host blob {blob!r}, whose value a graph would replay unchanged")
            slot = plan.frame.slot[blob]
            if slot in prologue_out:
                from_prologue[slot] = None
            else:
                loads[slot] = None
        if any(slot in prologue_out for slot in step.outputs):
            _refuse(plan, j, "it rewrites a blob the host prologue writes")
    used = dict.fromkeys(plan.steps[j].device for j in captured)  # replicas mapped onto one GPU: one device
    return Split(tuple(prologue), captured, tuple(loads), tuple(from_prologue), tuple(used))


def _reads_device_values(op: OperatorDef) -> bool:
    """Whether a captured op reads device tensors' values on the host (Trait.HOST_SYNC, e.g. CheckFinite).

    A HOST_SYNC op whose schema places an input on the host (device_inference, asked about the op with
    every optional input: Reshape's and Split's sizes, Adam's counter) reads only that input, which
    `split` refuses when present; a fill reads only its input's shape (but for `input_as_shape`)."""
    schema = get_schema(op.type)
    if not schema.has(Trait.HOST_SYNC) or schema.has(Trait.FILL):
        return False
    if schema.device_inference is None:
        return True
    most = schema.num_inputs[1]
    probe = op.copy()
    if most != math.inf:
        probe.inputs = [*op.inputs, *(f"_probe_{k}" for k in range(len(op.inputs), int(most)))]
    on_device = DeviceOption(CUDA, 0)
    placed = schema.device_inference(probe, on_device)[0]
    return all(option is None or option.device_type == CUDA for option in placed)


def _refuse(plan: CompiledNet, index: int, why: str) -> None:
    raise ValueError(f"{op_location(plan.netdef, index)} cannot be captured in a CUDA graph: {why}"
                     f"{recorded_at(plan.netdef.ops[index])}. Run the net as 'dag' or 'simple' "
                     f"(Parallelize(cuda_graph=False)), or move the op out of the step.")


class Captured:
    """A captured step: static input buffers, the frame the graph writes, and its replay."""

    def __init__(self, plan: CompiledNet, cut: Split, frame: list, backend: GraphBackend) -> None:
        # no reference to the plan: the runtime holding this must not keep its plan alive (`runtime_of`)
        self.net_name, self.names, self.cut = plan.name, plan.frame.names, cut
        self.statics = {slot: frame[slot] for slot in cut.loads}
        self.statics.update({slot: frame[slot].clone() for slot in cut.from_prologue})
        self.template: list = [None] * len(frame)
        for slot, value in self.statics.items():
            self.template[slot] = value
        self.frame: list = list(self.template)
        # what the run takes from the captured frame: the captured steps' outputs and the static inputs
        self.written = sorted({slot for j in cut.captured for slot in plan.steps[j].outputs} | set(cut.loads))
        frees = plan.frame.frees_in(cut.prologue + cut.captured) if plan.frame.frees_memory else None
        program = straight_line(plan, cut.captured, frees, "captured")
        captured_frame, template = self.frame, self.template

        def body() -> None:
            captured_frame[:] = template
            with capture():  # state may be updated in place on the static buffers (core.capture)
                program(captured_frame)

        self.replay = backend.capture(body, cut.devices)

    def run(self, frame: list, blobs: dict[str, torch.Tensor]) -> None:
        """Refresh the static inputs from `frame` (a blob fed since becomes its static buffer again, in
        `blobs` too), replay, and put the captured frame's values in `frame`."""
        names = self.names
        for slot, static in self.statics.items():
            value = frame[slot]
            if value is not static and (value.shape != static.shape or value.dtype != static.dtype):
                raise ValueError(
                    f"net {self.net_name!r}: blob {names[slot]!r} is {list(value.shape)} "
                    f"{str(value.dtype).removeprefix('torch.')} but was captured in the CUDA graph as "
                    f"{list(static.shape)} {str(static.dtype).removeprefix('torch.')}; a graph replays fixed "
                    f"shapes. Feed it with its captured shape, or recreate the net "
                    f"(CreateNet(..., overwrite=True)) to capture anew; nothing was changed")
        loads = self.cut.loads
        for slot, static in self.statics.items():
            if frame[slot] is not static:
                static.copy_(frame[slot])
                if slot in loads:
                    frame[slot] = blobs[names[slot]] = static
        self.replay()
        captured = self.frame
        for slot in self.written:
            frame[slot] = captured[slot]


class _Replay:
    """The Launch of a captured run (`executor.run.Launch`): each phase's host prologue steps at their
    phase, and the captured steps of every phase in one replay at the last phase, after the state
    check that precedes it (`executor.run.run_plan`), so a run that fails before it changed nothing.
    (Deferring the captured steps is valid: no prologue step depends on one, see `split`.)"""

    def __init__(self, plan: CompiledNet, runtime: Runtime, frame: list, backend: GraphBackend,
                 blobs: dict[str, torch.Tensor]) -> None:
        self.plan, self.runtime, self.frame, self.backend, self.blobs = plan, runtime, frame, backend, blobs

    def __call__(self, phase: Phase) -> None:
        plan, runtime, frame = self.plan, self.runtime, self.frame
        cut: Split = runtime.graph_split
        runs, members = step_runs(plan), set(phase.steps)
        for j in cut.prologue:
            if j in members:
                try:
                    runs[j](frame)
                except Exception as exc:
                    raise StepFailed(j) from exc
        if phase.index < len(plan.phases) - 1:
            return
        if runtime.graph is None:
            loads = set(cut.loads)
            for j in cut.captured:  # the previous run's values: the capture allocates the graph's own
                for slot in plan.steps[j].outputs:
                    if slot not in loads:
                        frame[slot] = None
            runtime.graph = Captured(plan, cut, frame, self.backend)
            log.info("net %r: captured its step in a CUDA graph (%d ops; %d on the host before each replay)",
                     plan.name, len(cut.captured), len(cut.prologue))
        runtime.graph.run(frame, self.blobs)

    def close(self) -> None:
        return None


class CudaGraphExecutor:
    """Runs a plan eagerly for its warm-up runs, then as a replayed CUDA graph (see the module docstring)."""

    op_by_op = "simple"  # a replayed graph has no per-op times

    def __init__(self) -> None:
        self._told: set[str] = set()

    def keeps_outputs(self, netdef: NetDef) -> bool:
        return False  # the next replay overwrites the graph's static outputs in place

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None:
        runtime = runtime_of(plan)
        backend = current_graphs()
        if runtime.graph_split is None:  # the first run: raise before anything changed
            cut = split(plan)
            if backend is not None:
                backend.check(plan.name, cut.devices)
            runtime.graph_split = cut
        warmup = plan.netdef.args.get(WARMUP_ARG, DEFAULT_WARMUP)
        if backend is None or runtime.completed < warmup:
            if backend is None and plan.name not in self._told:
                self._told.add(plan.name)
                log.warning("net %r (type 'cuda_graph'): no CUDA graphs here (no GPU, or CUDA devices placed on "
                            "the CPU); it runs as 'simple'", plan.name)
            with nullcontext() if backend is None else backend.warming(runtime.graph_split.devices):
                run_plan(plan, blobs, serial)
            return
        run_plan(plan, blobs, lambda plan, runtime, frame: _Replay(plan, runtime, frame, backend, blobs))
