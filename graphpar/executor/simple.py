"""The "simple" executor: every step once, in program order. The hot path of every RunNet.

Each phase of a plan runs as one straight-line function generated on its first run
(`executor.program`), so a run does per op only the kernel call and its frame reads and writes. When
a step fails, the error names its op. Kernels run with the plan's intra-op thread count
(`executor.threads`), set for the run in the calling thread (`executor.run.run_plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphpar.executor.run import run_plan, serial

if TYPE_CHECKING:
    from graphpar.core.ir import NetDef
    from graphpar.executor.plan import CompiledNet


class SimpleExecutor:
    """Runs a plan's steps one after another in program order."""

    op_by_op = "simple"

    def keeps_outputs(self, netdef: NetDef) -> bool:
        return True

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None:
        run_plan(plan, blobs, serial)
