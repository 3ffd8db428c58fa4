"""Executors, keyed by net type: `NetDef.type` names the executor that runs a net's plan.

An executor runs a compiled `CompiledNet` once against a workspace's blobs, through
`executor.run.run_plan`: the one routine that opens the frame, runs the plan's phases (the updates
and what depends on them last, after `frame.StateGuard`), turns a step's exception into
`failure.op_failure(...)` and commits the frame only after every step succeeded. An executor says
only how the steps of a phase are launched (in an order that respects `plan.dependencies`, freeing
each freeable value after its last use when the plan frees memory). Adding one is a new module plus
one `register_executor` line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from graphpar.executor.compiled import CompiledExecutor
from graphpar.executor.dag import DagExecutor
from graphpar.executor.graphs import CudaGraphExecutor
from graphpar.executor.simple import SimpleExecutor

if TYPE_CHECKING:
    from graphpar.core.ir import NetDef
    from graphpar.executor.plan import CompiledNet


class Executor(Protocol):
    """Runs a compiled plan once against a workspace's blobs, and says what callers may assume of it.

    `op_by_op` is the net type that runs the same plan one kernel call at a time (the profiler times
    each op there: itself, or "simple" where the executor replays a graph or runs compiled programs).
    `keeps_outputs(netdef)` says whether the tensors a run leaves in the workspace stay as they are
    until a later run rewrites their blobs; False where the next run overwrites them in place (a
    replayed CUDA graph's static outputs): a caller that holds one across runs copies it first.
    """

    op_by_op: str

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None: ...

    def keeps_outputs(self, netdef: NetDef) -> bool: ...


_EXECUTORS: dict[str, Executor] = {}


def register_executor(net_type: str, executor: Executor) -> None:
    """Make nets of type `net_type` run on `executor`; re-registering a type is an error."""
    if net_type in _EXECUTORS:
        raise ValueError(f"an executor for net type {net_type!r} is already registered")
    _EXECUTORS[net_type] = executor


def get_executor(net_type: str, where: str = "") -> Executor:
    """The executor of `net_type`; ValueError (prefixed by `where`) naming the known types otherwise."""
    executor = _EXECUTORS.get(net_type)
    if executor is None:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}net type must be one of {', '.join(map(repr, net_types()))}, "
                         f"got {net_type!r}")
    return executor


def net_types() -> tuple[str, ...]:
    """The registered net types, sorted."""
    return tuple(sorted(_EXECUTORS))


register_executor("simple", SimpleExecutor())
register_executor("dag", DagExecutor())
register_executor("async_scheduling", get_executor("dag"))  # Caffe2's name for its concurrent executor
register_executor("cuda_graph", CudaGraphExecutor())  # a step captured once in a CUDA graph, then replayed
register_executor("compiled", CompiledExecutor())  # each phase compiled by torch.compile into a few programs
