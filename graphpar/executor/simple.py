"""The "simple" executor: every step once, in program order. The hot path of every RunNet.

Each plan runs as one straight-line function generated on its first run (`executor.program`), so a
run does per op only the kernel call and its frame reads and writes. When a step fails, the error
names its op. Kernels run with the plan's intra-op thread count (`executor.threads`), set for the run
in the calling thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from graphpar.executor.failure import op_failure
from graphpar.executor.frame import commit, open_frame
from graphpar.executor.program import StepFailed, straight_line
from graphpar.executor.threads import intra_op_threads_of

if TYPE_CHECKING:
    from graphpar.executor.plan import Plan


class SimpleExecutor:
    """Runs a plan's steps one after another in program order."""

    def __init__(self) -> None:
        self._programs: weakref.WeakKeyDictionary[Plan, Callable[[list], None]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def run(self, plan: Plan, blobs: dict[str, torch.Tensor]) -> None:
        program = self._programs.get(plan)
        if program is None:
            with self._lock:
                program = self._programs.setdefault(plan, straight_line(plan, plan.frame.frees_memory))
        frame = open_frame(plan, blobs)
        with intra_op_threads_of(plan.intra_op_threads):
            try:
                program(frame)
            except StepFailed as failed:
                raise op_failure(plan, frame, failed.index, failed.__cause__) from failed.__cause__
        commit(plan, frame, blobs)
