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
computation even with a budget of one thread. A run has the plan's two phases (`executor.plan.Plan`): the updates and the steps that
depend on them start only once every other step finished and the state check passed. When a step
fails, no new step starts; the run waits for the steps already running, then raises the error
"simple" would raise for that op, and the workspace is unchanged. Under
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
from graphpar.executor.frame import StateChanged, commit, open_frame
from graphpar.executor.simple import SimpleExecutor
from graphpar.executor.streams import NO_STREAMS, RunStreams, current_streams
from graphpar.executor.threads import thread_budget

if TYPE_CHECKING:
    from graphpar.executor.plan import Plan


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
    threads: int = 1  # intra-op threads of its CPU kernels (`Plan.intra_op_threads` / `staged_threads`)


def make_schedules(plan: Plan) -> tuple[Schedule, ...]:
    """The schedules of `plan`'s phases (one, or two when it has updates): who waits for whom within
    each phase (`plan.dependencies`; a dependency on the earlier phase is met when it starts), and how
    many steps may run at once."""
    def concurrency(threads: int) -> int:
        return max(1, min(plan.netdef.num_workers, thread_budget() // threads, len(plan.steps)))

    ops = plan.netdef.ops
    waits = frozenset(j for j, step in enumerate(plan.steps) if has_trait(ops[step.index], Trait.DISTRIBUTED))
    channels = len({ops[plan.steps[j].index].inputs[0] for j in waits})
    phases = [plan.order[:plan.staged_from], plan.order[plan.staged_from:]]
    schedules = []
    for staged, phase in enumerate(phases):
        if not phase:
            continue
        threads = plan.staged_threads if staged else plan.intra_op_threads
        members = set(phase)
        successors: list[list[int]] = [[] for _ in plan.steps]
        indegree = [0] * len(plan.steps)
        for j in phase:
            for i in plan.dependencies[j]:
                if i in members:
                    successors[i].append(j)
                    indegree[j] += 1
        schedules.append(Schedule(tuple(map(tuple, successors)), tuple(indegree),
                                  tuple(j for j in phase if indegree[j] == 0), len(phase),
                                  concurrency(threads), bool(staged), waits, channels, threads))
    return tuple(schedules)


class _Run:
    """The state of one run: pending counts, the frame, the first failure, and who is waiting."""

    def __init__(self, plan: Plan, frame: list, streams: RunStreams | None) -> None:
        self.plan, self.frame, self.streams = plan, frame, streams
        self.users_left = list(plan.frame.version_users)  # per freeable version (dynamic memory)
        self.running = 0
        self.waiting = 0  # collectives across processes running (Schedule.waits)
        self.backlog: list[int] = []  # a heap of ready steps waiting for a free slot, earliest first
        self.wait_backlog: list[int] = []  # the same for Schedule.waits
        self.failure: tuple[int, Exception] | None = None
        self.lock = threading.Lock()

    def start(self, schedule: Schedule) -> None:
        """Begin a phase."""
        self.schedule = schedule
        self.pending = list(schedule.indegree)
        self.left = schedule.size  # steps of the phase not finished (run, or skipped after a failure)
        self.finished = threading.Event()


_START = -1  # the task that starts a phase: release its roots


class _PhaseFailed(Exception):
    """A step of the phase failed (`_Run.failure` says which): the next phase must not start."""


class DagExecutor:
    """Runs a plan's steps concurrently as their dependencies complete (see the module docstring)."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._grow = threading.Lock()
        self._schedules: weakref.WeakKeyDictionary[Plan, tuple[Schedule, ...]] = weakref.WeakKeyDictionary()
        self._serial = SimpleExecutor()

    def run(self, plan: Plan, blobs: dict[str, torch.Tensor]) -> None:
        schedules = self._schedules.get(plan)
        if schedules is None:
            schedules = self._schedules[plan] = make_schedules(plan)
        backend = current_streams()
        concurrency = max((schedule.concurrency for schedule in schedules), default=1)
        wait_slots = schedules[0].wait_slots if schedules else 0
        if concurrency == 1 and not wait_slots and backend is NO_STREAMS:  # nothing to overlap: the plan's order
            self._serial.run(plan, blobs)
            return
        frame = open_frame(plan, blobs)
        if plan.steps:
            self._ensure_workers(concurrency + wait_slots)
            streams = None if backend is NO_STREAMS else RunStreams(backend, plan, frame)
            state = _Run(plan, frame, streams)
            try:
                for schedule in schedules:
                    if schedule.staged:
                        plan.state_guard.check(frame)
                    self._run_phase(state, schedule)
            except StateChanged as exc:
                state.failure = (exc.step, exc)
            except _PhaseFailed:
                pass
            finally:
                if streams is not None:
                    streams.finish()
            if state.failure is not None:
                index, exc = state.failure
                raise op_failure(plan, frame, index, exc) from exc
        commit(plan, frame, blobs)

    def _run_phase(self, state: _Run, schedule: Schedule) -> None:
        """Run one phase of the plan; return when every step of it finished (or after a failure)."""
        state.start(schedule)
        try:  # a worker releases the roots (_START): a Ctrl-C here cannot leave the counts half-updated
            self._tasks.put((state, _START))
            state.finished.wait()
        except KeyboardInterrupt:
            self._drain(state)
            raise
        if state.failure is not None:
            raise _PhaseFailed

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
            plan = state.plan
            if threads != state.schedule.threads:
                threads = state.schedule.threads
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
