"""The "dag" executor: each step runs as soon as the steps it depends on are done, on worker threads.

PyTorch kernels release the GIL while they compute, so the replicas of a data-parallel net, which
share no blobs until their gradients are all-reduced, run side by side. The dependencies come from
the plan (`core.graph.predecessors`: read-after-write, write-after-write and write-after-read,
control inputs included), so a step never runs before a step it must follow, and collectives, chained
by control inputs, keep one fixed order on every device. Random kernels draw from per-op streams, and
every kernel runs with the plan's intra-op thread count, so results are bit-identical to "simple".

Workers are a pool of daemon threads, shared by every run of the executor, that grows to the largest
concurrency a plan has asked for (no threads are created per run); ready steps start in program
order. A plan that may run only one step at a time (one CPU device, or a budget of one thread per
kernel) runs in program order in the calling thread, as "simple" does. A plan runs at most
`budget // intra_op_threads` steps at once (`executor.threads`), never more than its net's
`num_workers`. Collectives across processes (Trait.DISTRIBUTED) mostly wait for the network, so they
take slots of their own, one per communicator they use, beyond that limit: communication overlaps
computation even with a budget of one thread. When a step fails, no new step starts; the run waits for the steps already running,
then raises the error "simple" would raise for that op, and the workspace is unchanged. Under
dynamic memory management a value is freed once every step that uses it has finished, whatever
their order (`executor.frame`). On GPUs each worker launches on CUDA streams of its own, ordered by
events (`executor.streams`).
"""

from __future__ import annotations

import heapq
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphpar.core.schema import Trait, has_trait
from graphpar.executor.failure import op_failure
from graphpar.executor.frame import commit, open_frame
from graphpar.executor.simple import SimpleExecutor
from graphpar.executor.streams import NO_STREAMS, RunStreams, current_streams
from graphpar.executor.threads import thread_budget

if TYPE_CHECKING:
    from graphpar.executor.plan import Plan


@dataclass(frozen=True)
class Schedule:
    """What the dag executor derives once per plan: successors, in-degrees and its concurrency."""

    successors: tuple[tuple[int, ...], ...]
    indegree: tuple[int, ...]
    roots: tuple[int, ...]
    concurrency: int
    waits: frozenset[int] = frozenset()  # collectives across processes: they run in the slots below
    wait_slots: int = 0  # one per communicator those collectives use


def make_schedule(plan: Plan) -> Schedule:
    """The schedule of `plan`: who waits for whom, and how many steps may run at once.

    Besides `plan.dependencies`, every in-place update waits for every other step before the first
    update (`Plan.updates`): they all feed one gate step, the last of them in program order, whose
    completion then counts for each update (the gate's own dependencies are made to cover them all).
    """
    dependencies = [set(before) for before in plan.dependencies]
    if plan.updates:
        first = min(plan.updates)
        gate = [i for i in range(first) if i not in plan.updates]
        for j in plan.updates:
            dependencies[j].update(gate)
    successors: list[list[int]] = [[] for _ in plan.steps]
    for j, before in enumerate(dependencies):
        for i in before:
            successors[i].append(j)
    indegree = tuple(len(before) for before in dependencies)
    concurrency = max(1, min(plan.netdef.num_workers, thread_budget() // plan.intra_op_threads,
                             len(plan.steps)))
    ops = plan.netdef.ops
    waits = frozenset(j for j, step in enumerate(plan.steps) if has_trait(ops[step.index], Trait.DISTRIBUTED))
    channels = len({ops[plan.steps[j].index].inputs[0] for j in waits})
    return Schedule(tuple(map(tuple, successors)), indegree, tuple(j for j, n in enumerate(indegree) if n == 0),
                    concurrency, waits, channels)


class _Run:
    """The state of one run: pending counts, the frame, the first failure, and who is waiting."""

    def __init__(self, plan: Plan, frame: list, schedule: Schedule, streams: RunStreams | None) -> None:
        self.plan, self.frame, self.schedule, self.streams = plan, frame, schedule, streams
        self.pending = list(schedule.indegree)
        self.users_left = list(plan.frame.version_users)  # per freeable version (dynamic memory)
        self.left = len(plan.steps)  # steps not finished (run, or skipped after a failure)
        self.running = 0
        self.waiting = 0  # collectives across processes running (Schedule.waits)
        self.backlog: list[int] = []  # a heap of ready steps waiting for a free slot, earliest first
        self.wait_backlog: list[int] = []  # the same for Schedule.waits
        self.failure: tuple[int, Exception] | None = None
        self.lock = threading.Lock()
        self.finished = threading.Event()


class DagExecutor:
    """Runs a plan's steps concurrently as their dependencies complete (see the module docstring)."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._grow = threading.Lock()
        self._schedules: weakref.WeakKeyDictionary[Plan, Schedule] = weakref.WeakKeyDictionary()
        self._serial = SimpleExecutor()

    def run(self, plan: Plan, blobs: dict[str, torch.Tensor]) -> None:
        schedule = self._schedules.get(plan)
        if schedule is None:
            schedule = self._schedules[plan] = make_schedule(plan)
        backend = current_streams()
        if schedule.concurrency == 1 and not schedule.wait_slots and backend is NO_STREAMS:  # program order
            self._serial.run(plan, blobs)
            return
        frame = open_frame(plan, blobs)
        if plan.steps:
            self._ensure_workers(schedule.concurrency + schedule.wait_slots)
            streams = None if backend is NO_STREAMS else RunStreams(backend, plan, frame)
            state = _Run(plan, frame, schedule, streams)
            with state.lock:
                self._release(state, list(schedule.roots))
            state.finished.wait()
            if streams is not None:
                streams.finish()
            if state.failure is not None:
                index, exc = state.failure
                raise op_failure(plan, frame, index, exc) from exc
        commit(plan, frame, blobs)

    def worker_count(self) -> int:
        """How many worker threads exist (they are shared by every run and never shrink)."""
        return len(self._workers)

    def _ensure_workers(self, count: int) -> None:
        with self._grow:
            while len(self._workers) < count:
                worker = threading.Thread(target=self._work, name=f"graphpar-dag-{len(self._workers)}",
                                          daemon=True)
                worker.start()
                self._workers.append(worker)

    def _release(self, state: _Run, ready: list[int]) -> None:
        """Hand ready steps to the workers, up to the plan's concurrency (call with state.lock held)."""
        schedule = state.schedule
        for index in ready:
            heapq.heappush(state.wait_backlog if index in schedule.waits else state.backlog, index)
        while state.backlog and state.running < schedule.concurrency:
            state.running += 1
            self._tasks.put((state, heapq.heappop(state.backlog)))
        while state.wait_backlog and state.waiting < schedule.wait_slots:
            state.waiting += 1
            self._tasks.put((state, heapq.heappop(state.wait_backlog)))

    @staticmethod
    def _free(state: _Run, index: int) -> None:
        """Free the versions whose last user was step `index` (before any successor may rewrite them)."""
        layout = state.plan.frame
        for v in layout.releases[index]:
            state.users_left[v] -= 1
            if state.users_left[v] == 0:
                state.frame[layout.version_slots[v]] = None

    def _work(self) -> None:
        threads = torch.get_num_threads()
        worker_streams: dict[int, dict[Any, Any]] = {}  # per stream backend (by id): its streams by device
        while True:
            state, index = self._tasks.get()
            plan = state.plan
            if threads != plan.intra_op_threads:
                threads = plan.intra_op_threads
                torch.set_num_threads(threads)
            error = None
            if state.failure is None:
                try:
                    if state.streams is None:
                        plan.runs[index](state.frame)
                    else:
                        state.streams.run(index, worker_streams.setdefault(id(state.streams.backend), {}))
                except Exception as exc:  # reported by the thread that called run()
                    error = exc
            with state.lock:
                if index in state.schedule.waits:
                    state.waiting -= 1
                else:
                    state.running -= 1
                state.left -= 1
                if error is not None and state.failure is None:
                    state.failure = (index, error)
                if state.failure is None:
                    self._free(state, index)
                    ready = []
                    for j in state.schedule.successors[index]:
                        state.pending[j] -= 1
                        if state.pending[j] == 0:
                            ready.append(j)
                    self._release(state, ready)
                elif state.running == 0 and state.waiting == 0:
                    state.backlog.clear()
                    state.wait_backlog.clear()
                    state.finished.set()
                    continue
                if state.left == 0:
                    state.finished.set()
