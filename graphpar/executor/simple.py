"""The "simple" executor: every step once, in program order. The hot path of every RunNet.

The loop does per op only what cannot be done at CreateNet: call the step (which reads the frame,
calls the kernel and writes the frame). One try/except around the whole loop costs nothing while all
goes well; when a step fails, its index names the op in the error. Kernels run with the plan's
intra-op thread count (`executor.threads`), set for the run in the calling thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphpar.executor.failure import op_failure
from graphpar.executor.frame import commit, open_frame
from graphpar.executor.threads import intra_op_threads_of

if TYPE_CHECKING:
    from graphpar.executor.plan import Plan


class SimpleExecutor:
    """Runs a plan's steps one after another in program order."""

    def run(self, plan: Plan, blobs: dict[str, torch.Tensor]) -> None:
        frame = open_frame(plan, blobs)
        index = 0
        with intra_op_threads_of(plan.intra_op_threads):
            try:
                if plan.frame.frees_memory:
                    frees = plan.frame.frees
                    for index, step in enumerate(plan.steps):
                        step.run(frame)
                        for slot in frees[index]:
                            frame[slot] = None
                else:
                    for index, run in enumerate(plan.runs):  # noqa: B007 - the except clause reads index
                        run(frame)
            except Exception as exc:
                raise op_failure(plan, frame, index, exc) from exc
        commit(plan, frame, blobs)
