"""The "dag" executor: each step runs as soon as the steps it depends on are done, on worker threads.

PyTorch kernels release the GIL while they compute, so the replicas of a data-parallel net, which
share no blobs until their gradients are all-reduced, run side by side. The dependencies come from
the plan (`core.graph.predecessors`: read-after-write, write-after-write and write-after-read,
control inputs included), so a step never runs before a step it must follow, and collectives, chained
by control inputs, keep one fixed order on every device. Random kernels draw from per-op streams, and
every kernel runs with the plan's intra-op thread count, so results are bit-identical to "simple".

Workers are a pool of daemon threads, shared by every run of the executor, that grows to the largest
concurrency a plan has asked for (no threads are created per run); ready steps start in program
order. A plan that may run only one step at a time (one CPU device, a budget of one thread per
kernel, or CUDA devices only, whose kernels launch asynchronously) runs in program order in the
calling thread, as "simple" does (`one_launching_thread`): threads would add hand-offs and GIL
contention and overlap nothing. So does the first run of a net with Caffe2's
`first_iter_only_one_worker` (Parallelize sets it). A plan runs at most
`budget // intra_op_threads` steps at once (`executor.threads`), never more than its net's
`num_workers`. Collectives across processes (Trait.DISTRIBUTED) mostly wait for the network, so they
take slots of their own, one per communicator they use, beyond that limit: communication overlaps
computation even with a budget of one thread. A run has the plan's two phases (`executor.plan.CompiledNet`): the updates and the steps that
depend on them start only once every other step finished and the state check passed. When a step
fails, no new step starts; the run waits for the steps already running, then raises the error
"simple" would raise for that op, and the workspace is unchanged. Under
dynamic memory management a value is freed once every step that uses it has finished, whatever
their order (`executor.frame`). Where CUDA steps run on worker threads (beside CPU replicas), each
worker launches on CUDA streams of its own, ordered by events (`executor.streams`). Every run goes
through `executor.run.run_plan`, as every executor's does; only the launching differs.
"""

from __future__ import annotations

import heapq
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphpar.core.naming import FIRST_ITER_ARG
from graphpar.core.schema import Trait, has_trait
from graphpar.executor.program import StepFailed, step_runs
from graphpar.executor.run import run_plan, serial
from graphpar.executor.runtime import Runtime, runtime_of
from graphpar.executor.streams import NO_STREAMS, RunStreams, StreamBackend, current_streams
from graphpar.executor.threads import thread_budget

if TYPE_CHECKING:
    from graphpar.core.ir import NetDef
    from graphpar.executor.plan import CompiledNet, Phase


@dataclass(frozen=True)
class Schedule:
    """One phase of a plan, derived once: successors and in-degrees within it, its roots and size."""

    successors: tuple[tuple[int, ...], ...]
    indegree: tuple[int, ...]
    roots: tuple[int, ...]
    size: int
    concurrency: int
    staged: bool  # the second phase: it starts with the state check
    waits: frozenset[int] = frozenset()  # collectives across processes: they run in the slots below
    wait_slots: int = 0  # one per communicator those collectives use
    threads: int = 1  # intra-op threads of its CPU kernels (`CompiledNet.intra_op_threads`, `staged_threads`)


def make_schedules(plan: CompiledNet) -> tuple[Schedule, ...]:
    """The schedules of `plan`'s phases (`CompiledNet.phases`): who waits for whom within each phase
    (`plan.dependencies`; a dependency on the earlier phase is met when it starts), and how many steps
    may run at once."""
    def concurrency(threads: int) -> int:
        return max(1, min(plan.netdef.num_workers, thread_budget() // threads, len(plan.steps)))

    ops = plan.netdef.ops
    waits = frozenset(j for j, step in enumerate(plan.steps) if has_trait(ops[step.index], Trait.DISTRIBUTED))
    channels = len({ops[plan.steps[j].index].inputs[0] for j in waits})
    schedules = []
    for phase in plan.phases:
        members = set(phase.steps)
        successors: list[list[int]] = [[] for _ in plan.steps]
        indegree = [0] * len(plan.steps)
        for j in phase.steps:
            for i in plan.dependencies[j]:
                if i in members:
                    successors[i].append(j)
                    indegree[j] += 1
        schedules.append(Schedule(tuple(map(tuple, successors)), tuple(indegree),
                                  tuple(j for j in phase.steps if indegree[j] == 0), len(phase.steps),
                                  concurrency(phase.threads), phase.staged, waits, channels, phase.threads))
    return tuple(schedules)


def one_launching_thread(plan: CompiledNet, runtime: Runtime, schedules: tuple[Schedule, ...]) -> bool:
    """Whether a run of `plan` launches every step from the calling thread, in program order.

    Worker threads win only where steps compute side by side on CPU cores (`Schedule.concurrency`
    above 1) or wait for other processes (`Schedule.wait_slots`). Otherwise they add thread hand-offs
    and GIL contention and nothing else: one CPU device, or CUDA devices, whose kernels launch
    asynchronously (one thread in program order keeps every GPU busy). The first run also goes
    serially when the net asks for it (Caffe2's `first_iter_only_one_worker`, set by Parallelize).
    """
    if plan.netdef.args.get(FIRST_ITER_ARG) and runtime.completed == 0:
        return True
    return all(schedule.concurrency == 1 for schedule in schedules) and not any(s.wait_slots for s in schedules)


class _Run:
    """The state of one run: pending counts, the frame, the first failure, and who is waiting."""

    def __init__(self, plan: CompiledNet, frame: list, streams: RunStreams | None) -> None:
        self.plan, self.frame, self.streams = plan, frame, streams
        self.runs = step_runs(plan)
        self.users_left = list(plan.frame.version_users)  # per freeable version (dynamic memory)
        self.running = 0
        self.waiting = 0  # collectives across processes running (Schedule.waits)
        self.backlog: list[int] = []  # a heap of ready steps waiting for a free slot, earliest first
        self.wait_backlog: list[int] = []  # the same for Schedule.waits
        self.failure: tuple[int, BaseException] | None = None  # (-1, KeyboardInterrupt()): a Ctrl-C
        self.lock = threading.Lock()

    def start(self, schedule: Schedule) -> None:
        """Begin a phase."""
        self.schedule = schedule
        self.pending = list(schedule.indegree)
        self.left = schedule.size  # steps of the phase not finished (run, or skipped after a failure)
        self.finished = threading.Event()


class _Threaded:
    """The Launch of a run on the worker threads (`executor.run.Launch`)."""

    def __init__(self, executor: DagExecutor, plan: CompiledNet, frame: list, schedules: tuple[Schedule, ...],
                 backend: StreamBackend) -> None:
        self.executor, self.schedules = executor, schedules
        self.streams = None if backend is NO_STREAMS else RunStreams(backend, plan, frame)
        self.state = _Run(plan, frame, self.streams)
        executor._ensure_workers(max(s.concurrency for s in schedules) + schedules[0].wait_slots)

    def __call__(self, phase: Phase) -> None:
        state = self.state
        self.executor._run_phase(state, self.schedules[phase.index])
        if state.failure is not None:
            index, exc = state.failure
            raise StepFailed(index) from exc

    def close(self) -> None:
        if self.streams is not None:
            self.streams.finish()


_START = -1  # the task that starts a phase: release its roots


class DagExecutor:
    """Runs a plan's steps concurrently as their dependencies complete (see the module docstring)."""

    op_by_op = "dag"

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._grow = threading.Lock()

    def keeps_outputs(self, netdef: NetDef) -> bool:
        return True

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None:
        runtime = runtime_of(plan)
        schedules = runtime.schedules
        if schedules is None:
            schedules = runtime.schedules = make_schedules(plan)
        if one_launching_thread(plan, runtime, schedules):
            run_plan(plan, blobs, serial)
            return
        backend = current_streams()
        run_plan(plan, blobs, lambda plan, _runtime, frame: _Threaded(self, plan, frame, schedules, backend))

    def _run_phase(self, state: _Run, schedule: Schedule) -> None:
        """Run one phase of the plan; return when every step of it finished (or after a failure)."""
        state.start(schedule)
        try:  # a worker releases the roots (_START): a Ctrl-C here cannot leave the counts half-updated
            self._tasks.put((state, _START))
            state.finished.wait()
        except KeyboardInterrupt:
            self._drain(state)
            raise

    @staticmethod
    def _drain(state: _Run) -> None:
        """After a Ctrl-C in the caller: start no more steps and wait for the running ones, so that no
        worker is still inside a kernel when the caller goes on, or the interpreter exits (which aborts
        the process: `terminate called without an active exception`). Nothing is committed. A Ctrl-C
        meanwhile is swallowed: the wait lasts at most the running steps (a collective: its timeout)."""
        with state.lock:
            if state.failure is None:
                state.failure = (-1, KeyboardInterrupt())
            if state.running == 0 and state.waiting == 0:
                state.finished.set()
        while True:
            try:
                state.finished.wait()
                return
            except KeyboardInterrupt:  # another Ctrl-C (a terminal's and a launcher's): still wait
                continue

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
            if index == _START:
                with state.lock:
                    if state.failure is None:
                        self._release(state, list(state.schedule.roots))
                    elif state.running == 0 and state.waiting == 0:  # drained before it started
                        state.finished.set()
                continue
            if threads != state.schedule.threads:
                threads = state.schedule.threads
                torch.set_num_threads(threads)
            error = None
            if state.failure is None:
                try:
                    if state.streams is None:
                        state.runs[index](state.frame)
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
