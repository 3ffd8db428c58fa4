"""A Trainer job for the launcher's restart test, run once per process:

    python -m graphpar.launch --nproc-per-node 2 --max-restarts 1 -m tests.multihost.elastic_job OUT KILL_AT

Each process trains the MLP of `tests.multihost.workers` on 2 CPU devices with its share of 8-row global
batches (a list, so a resumed Trainer skips to the batch an uninterrupted run would use), rank 0 saves a
checkpoint every PERIOD iterations, and on the first attempt rank 1 kills itself (SIGKILL) before iteration
KILL_AT. The script is the same on every attempt: `resume_or_load(resume=False)`, as a job that starts
from scratch; a restarted process continues from the job's last checkpoint on its own. Rank 0 writes the
final checkpoint params and the attempt it finished in to OUT.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

STEPS, PERIOD, GLOBAL_BATCH, BATCHES = 10, 3, 8, 6


def batches(rank: int, world: int) -> list[dict[str, np.ndarray]]:
    """This process's contiguous share of each global batch."""
    rng = np.random.default_rng(7)
    share = GLOBAL_BATCH // world
    found = []
    for _ in range(BATCHES):
        x = rng.standard_normal((GLOBAL_BATCH, 6)).astype(np.float32)
        y = rng.integers(0, 3, GLOBAL_BATCH).astype(np.int32)
        found.append({"data": x[rank * share:(rank + 1) * share], "label": y[rank * share:(rank + 1) * share]})
    return found


def run(out: str, kill_at: int, devices: list[int]) -> dict[str, np.ndarray]:
    """Train the job in this process; its final checkpoint params."""
    from graphpar import data_parallel_model as dpm
    from graphpar import launch, workspace
    from graphpar.engine import HookBase, PeriodicCheckpointer, Trainer
    from tests.multihost import workers

    class Checkpoints(PeriodicCheckpointer):
        def after_step(self) -> None:
            if launch.is_main_process():
                super().after_step()

    class Fault(HookBase):
        def before_step(self) -> None:
            if launch.get_rank() == 1 and launch.restart_count() == 0 and self.trainer.iter == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    model = workers.build("mlp", devices, launch.rendezvous())
    trainer = Trainer(model, batches(launch.get_rank(), launch.get_world_size()),
                      [Checkpoints(Path(out) / "ckpt", PERIOD), Fault()], max_iter=STEPS)
    trainer.resume_or_load(resume=False)
    trainer.train()
    return {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(model))}


def main(out: str, kill_at: str) -> None:
    from graphpar import launch

    params: dict[str, Any] = run(out, int(kill_at), [0, 1])
    if launch.is_main_process():
        np.savez(Path(out) / "final.npz", **params)
        (Path(out) / "attempt").write_text(str(launch.restart_count()))


if __name__ == "__main__":
    main(*sys.argv[1:])
