"""Per-op profiles of a net: which ops take the time of a run.

`profile_net(net)` wraps each kernel of a compiled plan with a timer and runs the wrapped plan on the
net's own executor, so the RunNet hot path carries no timing code and the kernels, their order and
their blob bindings are those of a normal run: the workspace ends up exactly as after `RunNet`.
CUDA kernels launch asynchronously: on plans that touch CUDA devices every device is synchronised
before the first op and after each op, so an op's time is its real execution time (and the run is
slower than an unprofiled one). The first iteration includes one-off costs (allocator warm-up, CUDA
context, cuDNN autotuning); profile with `num_iter > 1`, or after a RunNet, for steady-state numbers.

    prof = profile_net("mlp", num_iter=10)
    print(prof.table(top=5, by="type"))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphpar.core.graph import blob_devices
from graphpar.executor import CompiledNet, Step, compile_net, get_executor
from graphpar.platform.devices import torch_device
from graphpar.runtime.visualize import device_label
from graphpar.runtime.workspace import Workspace, _as_netdef, get_workspace

TABLE_ORDERS = ("op", "type")
_clock = time.perf_counter_ns  # module-level so tests can substitute a fake clock


@dataclass(frozen=True)
class OpRecord:
    """One op's time over a profile: total and per-iteration milliseconds, and its share of the total."""

    index: int
    type: str
    device: str
    total_ms: float
    mean_ms: float
    share: float


@dataclass(frozen=True)
class TypeRecord:
    """The ops of one type together: how many, their total and per-iteration milliseconds, their share."""

    type: str
    count: int
    total_ms: float
    mean_ms: float
    share: float


@dataclass
class Profile:
    """The per-op times of `num_iter` runs of net `net`; `records` are in program order.

    `total_ms` is the sum of the op times; `wall_ms` the wall-clock time of the whole profiled loop,
    which also counts the executor's own overhead (and device synchronisation). On a concurrent
    executor ("dag") ops overlap, so `total_ms` may exceed `wall_ms`.
    """

    net: str
    num_iter: int
    records: list[OpRecord] = field(default_factory=list)
    wall_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        """The summed time of every op over all iterations, in milliseconds."""
        return sum(record.total_ms for record in self.records)

    def by_type(self) -> list[TypeRecord]:
        """The records aggregated per op type, slowest first (ties in order of first appearance)."""
        totals: dict[str, list[Any]] = {}
        for record in self.records:
            entry = totals.setdefault(record.type, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += record.total_ms
            entry[2] += record.share
        rows = [TypeRecord(type_, count, total, total / self.num_iter, share)
                for type_, (count, total, share) in totals.items()]
        return sorted(rows, key=lambda row: -row.total_ms)

    def table(self, top: int | None = None, by: str = "op") -> str:
        """A Markdown table of the slowest ops (`by="op"`) or op types (`by="type"`), slowest first.

        Args:
            top: keep only this many rows (default: all).
            by: "op" for one row per op, "type" for one row per op type.

        Raises:
            ValueError: `by` is not "op" or "type", or `top` is not a positive int.
        """
        if by not in TABLE_ORDERS:
            raise ValueError(f"Profile.table: by must be one of {TABLE_ORDERS}, got {by!r}")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ValueError(f"Profile.table: top must be a positive int or None, got {top!r}")
        if by == "op":
            header = ["#", "type", "device", "total ms", "ms/iter", "share"]
            ordered = sorted(self.records, key=lambda r: -r.total_ms)
            rows = [[str(r.index), r.type, r.device, *_times(r)] for r in ordered]
        else:
            header = ["type", "ops", "total ms", "ms/iter", "share"]
            rows = [[r.type, str(r.count), *_times(r)] for r in self.by_type()]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows[:top]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def profile_net(net_or_name: Any, num_iter: int = 1, workspace: Workspace | str | None = None) -> Profile:
    """Run a net `num_iter` times op by op, timing each op; the blobs end up as after `RunNet`.

    A net whose executor cannot time ops (a replayed `"cuda_graph"`, `"compiled"` programs) runs on the
    executor its type names for that (`Executor.op_by_op`, `"simple"`): timing synchronizes the device
    after each op, which neither a capture nor a compiled program can do.

    Args:
        net_or_name: the name of a net created with `CreateNet` (its plan is run), or a `Net` /
            `NetDef`, compiled once for this profile and not kept.
        num_iter: how many times to run the net (a positive int).
        workspace: a `Workspace`, a workspace name, or None for the current workspace.

    Raises:
        ValueError: `num_iter` is not a positive int (checked before anything runs).
        RuntimeError: no net of that name was created in the workspace.
        KeyError: no workspace of that name exists.
        MissingBlobError, OperatorError, TypeError: as `CreateNet` and `RunNet`.
    """
    if isinstance(num_iter, bool) or not isinstance(num_iter, int) or num_iter < 1:
        raise ValueError(f"profile_net: num_iter must be a positive int, got {num_iter!r}")
    ws = workspace if isinstance(workspace, Workspace) else get_workspace(workspace)
    plan = _plan_of(net_or_name, ws)
    sync, clock = _synchronizer(plan), _clock
    elapsed_ns = [0] * len(plan.steps)

    def timer(kernel: Callable[..., Any], index: int) -> Callable[..., Any]:
        def timed_kernel(*inputs: Any) -> Any:
            began = clock()
            out = kernel(*inputs)
            sync()
            elapsed_ns[index] += clock() - began
            return out

        return timed_kernel

    def timed(step: Step) -> Step:
        return step.with_kernel(timer(step.kernel, step.index), step.reuse and timer(step.reuse.kernel, step.index))

    timed_plan = plan.with_steps(tuple(map(timed, plan.steps)))
    executor = get_executor(get_executor(plan.type).op_by_op)
    sync()
    start = clock()
    for _ in range(num_iter):
        executor.run(timed_plan, ws.blobs)
    wall_ms = (clock() - start) / 1e6
    total_ns = sum(elapsed_ns)
    netdef = plan.netdef
    records = [OpRecord(index, op.type, device_label(netdef.op_device(op)), ns / 1e6, ns / 1e6 / num_iter,
                        ns / total_ns if total_ns else 0.0)
               for index, (op, ns) in enumerate(zip(netdef.ops, elapsed_ns))]
    return Profile(netdef.name, num_iter, records, wall_ms)


def _plan_of(net_or_name: Any, ws: Workspace) -> CompiledNet:
    if isinstance(net_or_name, str):
        plan = ws.nets.get(net_or_name)
        if plan is None:
            raise RuntimeError(f"profile_net: net {net_or_name!r} has not been created in workspace "
                               f"{ws.name!r}; call CreateNet first, or pass the Net itself "
                               f"(known nets: {sorted(ws.nets)})")
        return plan
    return compile_net(_as_netdef(net_or_name), ws)


def _synchronizer(plan: CompiledNet) -> Callable[[], None]:
    """A function that waits for every CUDA device the plan's ops or blobs live on (a no-op on CPU)."""
    netdef = plan.netdef
    options = {netdef.op_device(op) for op in netdef.ops} | set(blob_devices(netdef).values())
    cuda = sorted({d for d in map(torch_device, options) if d.type == "cuda"}, key=lambda d: d.index)
    if not cuda:
        return lambda: None

    def sync() -> None:
        for device in cuda:
            torch.cuda.synchronize(device)

    return sync


def _times(record: OpRecord | TypeRecord) -> list[str]:
    return [f"{record.total_ms:.3f}", f"{record.mean_ms:.3f}", f"{100 * record.share:.1f}%"]
