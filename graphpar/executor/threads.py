"""The engine's thread budget: how many cores a run may use, and how it splits them.

PyTorch's CPU kernels run on intra-op threads (OpenMP); by default torch uses every core, so several
replicas running side by side, or a busy machine, oversubscribe the CPU badly (on a loaded 2-core
machine the main job took 8x longer with the default). The engine owns the budget instead: a plan's
CPU kernels run with `intra_op_threads = max(1, budget // cpu_replicas)` threads, where `cpu_replicas`
is the number of distinct CPU devices its ops run on, and the concurrent executor runs at most
`budget // intra_op_threads` kernels at a time, so workers × intra-op threads never exceed the budget.
A plan's second phase (its updates, `executor.plan.CompiledNet`) counts only the CPU devices that own
updates. Every op-by-op executor runs a plan with the same intra-op thread counts, so their results
are bit-identical (reductions split across a different number of threads round differently); the
compiled executor's regions, which run the replicas' kernels one after another, take the whole budget.

The budget is PyTorch's intra-op thread count in the thread that creates the net
(`torch.get_num_threads()`: the core count unless you change it with `torch.set_num_threads`), capped
at the number of cores this process may run on (`os.sched_getaffinity`); `GRAPHPAR_NUM_THREADS`
replaces it when set.
"""

from __future__ import annotations

import os

import torch

BUDGET_ENV = "GRAPHPAR_NUM_THREADS"


def thread_budget() -> int:
    """The number of threads graphpar's kernels may use at once (see the module docstring)."""
    configured = os.environ.get(BUDGET_ENV, "")
    if configured:
        try:
            budget = int(configured)
        except ValueError:
            budget = 0
        if budget < 1:
            raise ValueError(f"{BUDGET_ENV} must be a positive int, got {configured!r}")
        return budget
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, torch.get_num_threads()))


def intra_op_threads(cpu_replicas: int) -> int:
    """The intra-op threads of each kernel of a plan whose ops run on `cpu_replicas` CPU devices."""
    return max(1, thread_budget() // max(1, cpu_replicas))

