"""The one routine that runs a plan once, for every executor.

`run_plan(plan, blobs, start)` opens the run's frame (`frame.open_frame`), runs the plan's phases in
order (`executor.plan.CompiledNet`: the state check, `frame.StateGuard`, before the second; each phase's
intra-op threads in the calling thread), turns a failed step (`program.StepFailed`, or the check's
`StateChanged`) into the error that names its op (`failure.op_failure`), and commits the frame
(`frame.commit`) only when every step succeeded. Executors differ only in how they launch the steps of
a phase: `start(plan, runtime, frame)` returns the run's `Launch`. `serial` launches each phase as one
straight-line program in the calling thread (`program.straight_line`); the dag executor launches on
worker threads (`executor.dag`), a CUDA-graph net replays a captured graph (`executor.graphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from graphpar.executor.failure import op_failure
from graphpar.executor.frame import StateChanged, commit, open_frame
from graphpar.executor.program import StepFailed, straight_line
from graphpar.executor.runtime import Runtime, runtime_of

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet, Phase


class Launch(Protocol):
    """How one run launches its phases: `launch(phase)` runs every step of `phase` (raising StepFailed
    for a failed one); `close()` runs after the last phase, or after a failure."""

    def __call__(self, phase: Phase) -> None: ...

    def close(self) -> None: ...


Start = Callable[["CompiledNet", Runtime, list], Launch]


def run_plan(plan: CompiledNet, blobs: dict[str, torch.Tensor], start: Start) -> None:
    """Run `plan` once against `blobs`, launching its phases with `start`'s Launch (see the module docstring)."""
    runtime = runtime_of(plan)
    frame = open_frame(plan, blobs)
    old_threads = torch.get_num_threads()
    try:
        launch = start(plan, runtime, frame)
        try:
            for phase in plan.phases:
                if phase.staged and plan.state_guard.checks:
                    plan.state_guard.check(frame, runtime.verified)
                if torch.get_num_threads() != phase.threads:
                    torch.set_num_threads(phase.threads)
                launch(phase)
        finally:
            launch.close()
    except StateChanged as exc:
        raise op_failure(plan, frame, exc.step, exc) from exc
    except StepFailed as failed:
        cause = failed.__cause__ or failed  # every launch raises it from the kernel's error
        raise op_failure(plan, frame, failed.index, cause) from cause
    finally:
        if torch.get_num_threads() != old_threads:
            torch.set_num_threads(old_threads)
    commit(plan, frame, blobs)
    runtime.completed += 1


class _Serial:
    """Each phase as one straight-line program, in the calling thread."""

    __slots__ = ("programs", "frame")

    def __init__(self, programs: tuple[Callable[[list], None], ...], frame: list) -> None:
        self.programs, self.frame = programs, frame

    def __call__(self, phase: Phase) -> None:
        self.programs[phase.index](self.frame)

    def close(self) -> None:
        return None


def serial(plan: CompiledNet, runtime: Runtime, frame: list) -> Launch:
    """The Launch that runs each phase's steps in program order in the calling thread."""
    programs = runtime.programs
    if programs is None:
        with runtime.lock:
            if runtime.programs is None:
                frees = plan.frame.frees_in(plan.order) if plan.frame.frees_memory else None
                runtime.programs = tuple(straight_line(plan, phase.steps, frees, f"phase {phase.index}")
                                         for phase in plan.phases)
            programs = runtime.programs
    return _Serial(programs, frame)
