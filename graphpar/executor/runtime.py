"""What the runs of one plan carry between them, kept beside the immutable CompiledNet (`executor.plan`).

A CompiledNet says what a net computes. Its Runtime holds what executors derive from it once (the
straight-line programs of its phases, the dag's schedules, a captured CUDA graph) and what its runs
change (the state tensors last verified by `frame.StateGuard`, whether a run has completed, how many
have). Runtimes are kept per plan object, weakly: a plan that nobody holds takes its runtime with it,
and a plan rebuilt by `CompiledNet.with_steps` (the profiler's timed copy) starts with a fresh one.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet


class Runtime:
    """The run-time state of one plan (see the module docstring)."""

    def __init__(self, checks: int) -> None:
        self.lock = threading.Lock()  # held while deriving what is built once
        self.programs: tuple[Any, ...] | None = None  # one straight-line program per phase (`program`)
        self.runs: tuple[Any, ...] | None = None  # one run(frame) per step (`program.step_runs`)
        self.schedules: tuple[Any, ...] | None = None  # the dag's schedules (`dag.make_schedules`)
        self.graph_split: Any = None  # how a "cuda_graph" net splits for capture (`executor.graphs.split`)
        self.graph: Any = None  # its captured step (`executor.graphs.Captured`)
        self.lowered: Any = None  # a "compiled" net's regions and programs (`executor.compiled.Lowered`)
        self.verified: list = [None] * checks  # weak references to the state tensors last checked
        self.committed = False  # a run has completed: the workspace's transient blobs are this net's
        self.completed = 0  # runs completed


_runtimes: weakref.WeakKeyDictionary[CompiledNet, Runtime] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def runtime_of(plan: CompiledNet) -> Runtime:
    """The runtime of `plan`, made on first use."""
    runtime = _runtimes.get(plan)
    if runtime is None:
        with _lock:
            runtime = _runtimes.get(plan)
            if runtime is None:
                runtime = _runtimes[plan] = Runtime(len(plan.state_guard.checks))
    return runtime
