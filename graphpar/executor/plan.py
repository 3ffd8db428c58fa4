"""Compile a NetDef once, at CreateNet, into a Plan: a flat tuple of prebuilt steps for `run`.

Everything that needs a look-up or a decision happens here, once: the net is validated, each op's
schema is resolved, its arguments parsed, its device placed, its kernel built, and its blob names
frozen into tuples. Every input must exist by then (in the workspace, or as an earlier op's output).
The executor never looks at an op's type: all it needs comes from the schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from graphpar.core.ir import CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.devices import cuda_is_simulated, num_cuda_devices, torch_device
from graphpar.errors import MissingBlobError, OperatorError
from graphpar.ops.registry import KernelContext, get_schema, parse_args

# How a step calls its kernel and stores the result (see `simple.run`).
UNARY = 1  # one input, one output: `ins` and `out` are names
BINARY = 2  # two inputs, one output: `ins` is a pair of names
NARY = 3  # any other input count, one output
MULTI = 4  # zero or several outputs: `out` is a tuple of names; the kernel returns a tuple


class Step(NamedTuple):
    """One op, ready to run: its kernel, call kind, input name(s), output name(s) and op index."""

    fn: Any
    kind: int
    ins: Any
    out: Any
    index: int


class BlobStore(Protocol):
    """What compile_net needs of a workspace."""

    name: str
    blobs: dict[str, torch.Tensor]

    def generator(self, device: torch.device) -> torch.Generator: ...


@dataclass
class Plan:
    """A compiled net: a snapshot of its NetDef, its steps, and the blob dict they read and write.

    `program` holds the same steps as plain tuples, which CPython unpacks faster than NamedTuples.

    Both "simple" and "dag" nets run their steps in program order. This deliberately differs from
    SPEC §5 and Caffe2's DAGNet, which run independent ops concurrently on `num_workers` threads
    (one CUDA stream each). Program order is a topological order of `core.graph.dependency_graph`,
    so a "dag" net's results equal a "simple" net's exactly; concurrent dispatch would not keep
    that promise cheaply here: random ops (fills, Dropout) share the workspace's per-device
    generators, so their draws would depend on the schedule, and tensors crossing CUDA streams need
    events plus `record_stream` to be freed safely. It would also gain little: ops are dispatched
    from Python under the GIL, CPU kernels already use intra-op threads, and CUDA kernels launch
    asynchronously, so ops on different GPUs already overlap. `NetDef.num_workers` is validated
    and kept (Parallelize sets it as Caffe2 does) for a concurrent executor.
    """

    netdef: NetDef
    steps: tuple[Step, ...]
    blobs: dict[str, torch.Tensor]
    workspace_name: str
    program: tuple[tuple[Any, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.program = tuple(tuple(step) for step in self.steps)

    @property
    def name(self) -> str:
        return self.netdef.name


def compile_net(netdef: NetDef, workspace: BlobStore) -> Plan:
    """Validate `netdef` and build its plan against `workspace` (the net is copied: later edits do not count).

    Raises:
        ValueError / TypeError: the net breaks a schema (NetDef.validate()).
        MissingBlobError: an input or control input is neither in the workspace nor produced earlier.
        RuntimeError: an op is placed on a CUDA device that does not exist.
        OperatorError: a kernel factory rejected its op.
    """
    netdef = netdef.copy()
    netdef.validate()
    _check_inputs_exist(netdef, workspace)
    steps = tuple(_compile_op(netdef, index, op, workspace) for index, op in enumerate(netdef.ops))
    return Plan(netdef, steps, workspace.blobs, workspace.name)


def op_location(netdef: NetDef, index: int) -> str:
    """`net 'name' op #index (Type)`, the prefix of every executor message about an op."""
    return f"net {netdef.name!r} op #{index} ({netdef.ops[index].type})"


def _check_inputs_exist(netdef: NetDef, workspace: BlobStore) -> None:
    defined = set(workspace.blobs)
    for index, op in enumerate(netdef.ops):
        for what, names in (("input", op.inputs), ("control input", op.control_inputs)):
            for k, blob in enumerate(names):
                if blob not in defined:
                    raise MissingBlobError(
                        f"{op_location(netdef, index)}: {what} {k} {blob!r} does not exist in workspace "
                        f"{workspace.name!r} and no earlier op of the net produces it. Feed it (FeedBlob) "
                        f"or run the net that creates it (e.g. the param_init_net) before CreateNet"
                        f"{recorded_at(op)}.")
        defined.update(op.outputs)


def checked_torch_device(option: DeviceOption, where: str) -> torch.device:
    """The torch device of `option`; RuntimeError (prefixed by `where`) for a CUDA device that does not exist."""
    if option.device_type == CUDA and not cuda_is_simulated() and option.device_id >= num_cuda_devices():
        raise RuntimeError(
            f"{where}: placed on CUDA device {option.device_id}, but {num_cuda_devices()} CUDA device(s) "
            f"exist. Use fewer devices, or set GRAPHPAR_CUDA_ON_CPU=1 (graphpar.devices.cuda_on_cpu()) "
            f"to run logical CUDA devices on the CPU.")
    return torch_device(option)


def _compile_op(netdef: NetDef, index: int, op: OperatorDef, workspace: BlobStore) -> Step:
    where = op_location(netdef, index)
    schema = get_schema(op.type)
    args = parse_args(schema, op.args, where)
    device = checked_torch_device(netdef.op_device(op), where)
    ctx = KernelContext(op=op, device=device, device_of=torch_device, generator=workspace.generator)
    try:
        fn = schema.kernel(args, ctx)
    except Exception as exc:
        raise OperatorError(f"{where}: the kernel could not be built: {exc}"
                            f"{recorded_at(op)}") from exc
    return _make_step(fn, index, op.inputs, op.outputs)


def recorded_at(op: OperatorDef) -> str:
    """A message suffix saying where the op was recorded (empty if unknown)."""
    return f" (recorded at {op.source})" if op.source else ""


def _make_step(fn: Any, index: int, inputs: list[str], outputs: list[str]) -> Step:
    ins = tuple(str(b) for b in inputs)
    outs = tuple(str(b) for b in outputs)
    if len(outs) != 1:
        return Step(fn, MULTI, ins, outs, index)
    if len(ins) == 1:
        return Step(fn, UNARY, ins[0], outs[0], index)
    if len(ins) == 2:
        return Step(fn, BINARY, ins, outs[0], index)
    return Step(fn, NARY, ins, outs[0], index)
