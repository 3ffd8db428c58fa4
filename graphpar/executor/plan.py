"""Compile a NetDef once, at CreateNet, into an immutable CompiledNet that executors run on every RunNet.

Everything that needs a look-up or a decision happens here, once: the net is validated against the
schemas, each op's arguments are parsed, its device placed, its kernel built, and its blob names
turned into slots of a per-run frame (`executor.frame`). Every input must exist by then (in the
workspace, or as an earlier op's output). The executor never looks at an op's type: all it needs
comes from the schema and the plan.

How a step calls its kernel (read the input slots, call the kernel, write the output slots) is encoded
once, in `executor.program`, which generates every executor's code from the steps; outputs are written
only after the kernel returns, so a failed op writes nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import torch

from graphpar.core.dataflow import Dataflow, dataflow
from graphpar.core.ir import CPU, CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import KernelContext, Trait, get_schema, parse_args, validate_net
from graphpar.core.shapes import BlobSpec, infer_specs
from graphpar.errors import MissingBlobError, OperatorError
from graphpar.executor.failure import op_location, recorded_at
from graphpar.executor.frame import FrameLayout, StateCheck, StateGuard, layout_frame
from graphpar.executor.program import Reuse
from graphpar.executor.registry import get_executor
from graphpar.executor.threads import intra_op_threads, thread_budget
from graphpar.platform.devices import cuda_is_simulated, num_cuda_devices, torch_device

RandomStream = Callable[[torch.device], torch.Generator]


class Step(NamedTuple):
    """One op, ready to run (`executor.program` generates the code that runs it on a frame)."""

    kernel: Callable[..., Any]  # kernel(*inputs) -> the output, or a tuple of them
    index: int  # type: ignore[assignment]  # the op's position (a field shadowing tuple.index)
    inputs: tuple[int, ...]  # frame slots read (data inputs)
    outputs: tuple[int, ...]  # frame slots written
    device: torch.device
    option: DeviceOption  # the logical device (a CUDA op placed on the CPU still says CUDA)
    # (input position, known holders) of the inputs the kernel overwrites (Trait.OVERWRITES_INPUTS),
    # each passed through `executor.program.claim`; holders 1: loaded from the workspace, 0: made by the run
    claims: tuple[tuple[int, int], ...] = ()
    reuse: Reuse | None = None  # the kernel to call when the run owns the input it may overwrite

    def with_kernel(self, kernel: Callable[..., Any], reuse_kernel: Callable[..., Any] | None = None) -> Step:
        """The same step calling `kernel` instead (e.g. a timed wrapper of its own), and `reuse_kernel`
        instead of its reuse kernel (None: the step never reuses its input)."""
        reuse = self.reuse and reuse_kernel and self.reuse._replace(kernel=reuse_kernel)
        return self._replace(kernel=kernel, reuse=reuse or None)


class Phase(NamedTuple):
    """One phase of a plan (see `CompiledNet`): its steps in program order, whether it is the second one
    (it starts with the state check) and its CPU kernels' intra-op threads."""

    index: int  # type: ignore[assignment]  # a field shadowing tuple.index
    steps: tuple[int, ...]
    staged: bool
    threads: int


class BlobStore(Protocol):
    """What compile_net needs of a workspace."""

    name: str
    blobs: dict[str, torch.Tensor]

    def random_streams(self, net_name: str) -> Callable[[int], RandomStream]: ...


@dataclass(frozen=True, eq=False)
class CompiledNet:
    """A compiled net: its steps, their dependencies, and how blobs map to frame slots.

    `dependencies[j]` are the indices of the steps step j must run after (`core.dataflow`); `frame` says which blobs
    are persistent (they outlive a run) and which slots an executor may free after each step;
    `intra_op_threads` is how many threads each CPU kernel uses, whatever the executor
    (`executor.threads`); `staged_threads` the same for the second phase below, where only the
    replicas that own updates compute (with CPU replicas that update once, only the first device).

    Staging: `updates` are the steps that update state in place (Trait.INPLACE_UPDATE, and those that
    may overwrite a blob loaded from the workspace: Trait.OVERWRITES_INPUTS, see `_claims`, and reuse
    kernels of a loaded blob, see `_reused_inputs`). Every executor
    runs a plan in two phases: first every step that depends on no update (`order[:staged_from]`),
    then, once they all succeeded and `state_guard` passed (`executor.frame.StateGuard`), the
    updates and the steps that depend on them (`order[staged_from:]`); each phase respects
    `dependencies`. So a run that fails anywhere before its updates leaves the persistent state as it
    was, and an update never starts on state whose shape or dtype changed since CreateNet.
    """

    netdef: NetDef
    steps: tuple[Step, ...]
    dependencies: tuple[tuple[int, ...], ...]
    frame: FrameLayout
    workspace_name: str
    intra_op_threads: int
    updates: frozenset[int]
    order: tuple[int, ...]  # the steps in program order within each phase
    staged_from: int  # order[staged_from:] is the second phase (the updates and what depends on them)
    state_guard: StateGuard
    staged_threads: int
    thread_budget: int  # the budget the thread counts above split (`executor.threads`), at CreateNet
    phases: tuple[Phase, ...] = field(init=False, repr=False)  # the non-empty phases, in order

    def __post_init__(self) -> None:
        split = ((self.order[:self.staged_from], False, self.intra_op_threads),
                 (self.order[self.staged_from:], True, self.staged_threads))
        object.__setattr__(self, "phases", tuple(Phase(k, *phase)
                                                 for k, phase in enumerate(p for p in split if p[0])))

    @property
    def name(self) -> str:
        return self.netdef.name

    @property
    def type(self) -> str:
        """The executor this plan runs on (the net's type)."""
        return self.netdef.type

    @property
    def persistent(self) -> frozenset[str]:
        """The blobs that must outlive a run (see `executor.frame`)."""
        return self.frame.persistent

    def with_steps(self, steps: tuple[Step, ...]) -> CompiledNet:
        """The same plan with other steps (e.g. wrapped by the profiler); one per original step."""
        if len(steps) != len(self.steps):
            raise ValueError(f"with_steps needs {len(self.steps)} steps, got {len(steps)}")
        return replace(self, steps=steps)


def compile_net(netdef: NetDef, workspace: BlobStore, keep_all: bool = False, infer_shapes: bool = True) -> CompiledNet:
    """Validate `netdef` and build its plan against `workspace` (the net is copied: later edits do not count).

    `keep_all` keeps every blob after a run whatever the net's memory options say (for introspection).
    `infer_shapes=False` builds the plan without shape facts (for a net whose blobs do not fit it yet;
    the caller checks them before it runs).

    Raises:
        ValueError / TypeError: the net breaks its structure or a schema (`core.schema.validate_net`),
            its type names no registered executor, or an op's inputs do not fit its shape rule
            (`core.shapes.infer_specs`).
        MissingBlobError: an input or control input is neither in the workspace nor produced earlier.
        RuntimeError: an op is placed on a CUDA device that does not exist.
        OperatorError: a kernel factory rejected its op.
    """
    netdef = netdef.copy()
    validate_net(netdef)
    get_executor(netdef.type, f"net {netdef.name!r}")
    check_inputs_exist(netdef, {*workspace.blobs, *getattr(workspace, "objects", ())}, workspace.name)  # CreateBlob'd blobs count
    specs = infer_specs(netdef, workspace.blobs) if infer_shapes else {}
    flow = dataflow(netdef)
    claims = _claims(netdef, flow)
    reused = _reused_inputs(netdef, flow, specs)
    updates = frozenset(i for i, op in enumerate(netdef.ops) if get_schema(op.type).has(Trait.INPLACE_UPDATE)
                        or any(holders for _, holders in claims[i]) or reused[i] == 1)
    dependencies = flow.predecessors
    staged = _staged(dependencies, updates)
    order = tuple(j for j in range(len(staged)) if not staged[j]) + tuple(j for j in range(len(staged)) if staged[j])
    frame = layout_frame(netdef, keep_all)
    streams = workspace.random_streams(netdef.name)
    steps = tuple(_compile_op(netdef, index, op, frame.slot, streams, claims[index], reused[index])
                  for index, op in enumerate(netdef.ops))
    devices = [netdef.op_device(op) for op in netdef.ops]
    cpu_replicas = len({d for d in devices if d.device_type == CPU})
    updating = len({devices[j] for j in updates if devices[j].device_type == CPU})
    return CompiledNet(netdef, steps, dependencies, frame, workspace.name, intra_op_threads(cpu_replicas), updates,
                       order, len(steps) - sum(staged),
                       StateGuard(_state_checks(netdef, flow, updates, frame, workspace.blobs)),
                       intra_op_threads(updating or cpu_replicas), thread_budget())


def _claims(netdef: NetDef, flow: Dataflow) -> list[tuple[tuple[int, int], ...]]:
    """Per op: (input position, known holders) of each input its kernel overwrites (Trait.OVERWRITES_INPUTS,
    its enforced in-place inputs): holders 1 for a blob loaded from the workspace (no earlier op writes
    it; the step is then an update), 0 for a value made earlier in the run. A blob read twice by the op
    is never overwritten (always a copy)."""
    claims: list[tuple[tuple[int, int], ...]] = []
    for index, op in enumerate(netdef.ops):
        schema = get_schema(op.type)
        found: tuple[tuple[int, int], ...] = ()
        if schema.has(Trait.OVERWRITES_INPUTS):
            found = tuple((i, int(not flow.written_before(op.inputs[i], index)))
                          for i, _ in schema.enforced_pairs(len(op.inputs), len(op.outputs))
                          if op.inputs.count(op.inputs[i]) == 1)
        claims.append(found)
    return claims


REUSE_MIN_BYTES = 1 << 17  # smaller values are cheaper to allocate anew than to check (docs/engine.md)


def _reused_inputs(netdef: NetDef, flow: Dataflow, specs: Mapping[str, BlobSpec | None]) -> list[int | None]:
    """Per op: None, or the known holders of the input its reuse kernel (`core.schema.InputReuse`) may
    overwrite: 0 for a value an earlier op of the run made, 1 for a blob loaded from the workspace (the
    workspace holds it; the op then updates state in place, as `WeightedSum([p, one, g, lr], p)` in
    plain SGD, so it is an update and runs in the plan's second phase). Only where the op rewrites
    the input's blob (no later op reads the old value) and shape inference does not say it is smaller
    than REUSE_MIN_BYTES. Whether the run owns the tensor is decided on each run (`program.owns`)."""
    reused: list[int | None] = []
    for index, op in enumerate(netdef.ops):
        reuse = get_schema(op.type).reuse
        if reuse is None or reuse.input >= len(op.inputs):
            reused.append(None)
            continue
        blob = op.inputs[reuse.input]
        spec = specs.get(blob)
        small = spec is not None and spec.numel * spec.dtype.itemsize < REUSE_MIN_BYTES
        rewritten = blob in op.outputs and op.inputs.count(blob) == 1 and not small
        reused.append(int(not flow.written_before(blob, index)) if rewritten else None)
    return reused


def _staged(dependencies: tuple[tuple[int, ...], ...], updates: frozenset[int]) -> list[bool]:
    """Per step: whether it is an update or depends (transitively) on one (predecessors come first)."""
    staged: list[bool] = []
    for j, before in enumerate(dependencies):
        staged.append(j in updates or any(staged[i] for i in before))
    return staged


def _state_checks(netdef: NetDef, flow: Dataflow, updates: frozenset[int], frame: FrameLayout,
                  blobs: Mapping[str, torch.Tensor]) -> tuple[StateCheck, ...]:
    """The in-place state of each update that the run loads from the workspace, with its CreateNet spec."""
    loaded = {load.name for load in frame.loads}
    checks: dict[str, StateCheck] = {}
    for index in sorted(updates):
        op = netdef.ops[index]
        for blob in set(op.inputs) & set(op.outputs):
            if blob in loaded and not flow.written_before(blob, index) and blob in blobs and blob not in checks:
                tensor = blobs[blob]
                checks[blob] = StateCheck(index, frame.slot[blob], blob, tensor.shape, tensor.dtype)
    return tuple(checks.values())


def check_inputs_exist(netdef: NetDef, defined: set[str], workspace_name: str, before: str = "CreateNet") -> None:
    """Raise MissingBlobError for the first input that is neither in `defined` nor written by an earlier
    op; `defined` gains every blob the net writes (so callers can check a sequence of nets)."""
    flow = dataflow(netdef)
    if not flow.read_first <= defined:
        _missing_input(netdef, flow, defined, workspace_name, before)
    defined.update(flow.first_write)


def _missing_input(netdef: NetDef, flow: Dataflow, defined: set[str], workspace_name: str, before: str) -> None:
    """Raise MissingBlobError for the first input of `netdef` that is neither in `defined` nor written
    by an earlier op (one of `flow.read_first`)."""
    known = set(defined)
    for index, op in enumerate(netdef.ops):
        for what, names in (("input", op.inputs), ("control input", op.control_inputs)):
            for k, blob in enumerate(names):
                if blob not in known:
                    unread = sorted(b for b in known if b not in flow.readers)  # a misspelt feed: read by no op
                    close = difflib.get_close_matches(blob, unread, n=3)
                    hint = f" Did you mean {', '.join(map(repr, close))} (fed under another name)?" if close else ""
                    raise MissingBlobError(
                        f"{op_location(netdef, index)}: {what} {k} {blob!r} does not exist in workspace "
                        f"{workspace_name!r} and no earlier op of the net produces it.{hint} Feed it (FeedBlob) "
                        f"or run the net that creates it (e.g. the param_init_net) before {before}"
                        f"{recorded_at(op)}.")
        known.update(op.outputs)


def checked_torch_device(option: DeviceOption, where: str) -> torch.device:
    """The torch device of `option`; RuntimeError (prefixed by `where`) for a CUDA device that does not exist."""
    if option.device_type == CUDA and not cuda_is_simulated() and option.device_id >= num_cuda_devices():
        raise RuntimeError(
            f"{where}: placed on CUDA device {option.device_id}, but {num_cuda_devices()} CUDA device(s) "
            f"exist. Use fewer devices, or set GRAPHPAR_CUDA_ON_CPU=1 (graphpar.devices.cuda_on_cpu()) "
            f"to run logical CUDA devices on the CPU.")
    return torch_device(option)


def _compile_op(netdef: NetDef, index: int, op: OperatorDef, slot: Mapping[str, int],
                streams: Callable[[int], RandomStream], claims: tuple[tuple[int, int], ...],
                reused: int | None) -> Step:
    where = op_location(netdef, index)
    schema = get_schema(op.type)
    args = parse_args(schema, op.args, where)
    device = checked_torch_device(netdef.op_device(op), where)

    def random_stream() -> RandomStream:
        if not schema.has(Trait.RANDOM):
            raise TypeError(f"{op.type} draws random numbers but its registration does not declare "
                            f"Trait.RANDOM")
        return streams(index)

    ctx = KernelContext(op=op, device=device, device_of=torch_device, random_stream=random_stream)
    try:
        fn = schema.kernel(args, ctx)
        reuse = (Reuse(schema.reuse.kernel(args, ctx), schema.reuse.input, reused)
                 if reused is not None and schema.reuse is not None and not claims else None)
    except Exception as exc:
        raise OperatorError(f"{where}: the kernel could not be built: {exc}"
                            f"{recorded_at(op)}") from exc
    inputs = tuple(slot[b] for b in op.inputs)
    outputs = tuple(slot[b] for b in op.outputs)
    return Step(fn, index, inputs, outputs, device, netdef.op_device(op), claims, reuse)
