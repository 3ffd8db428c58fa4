"""Training that survives a killed process: kill -9 one rank at a random step of a 2 x 2-device job.

The job is the main job's CNN on scikit-learn's digits (`graphpar.examples.train.build`, Nesterov SGD,
global batch 64) in a `Trainer` with a checkpoint every `--every` iterations, run as
`python -m graphpar.launch --nproc-per-node 2 --max-restarts 1` (2 processes x 2 CPU devices). Each
trial draws a rank and a step; that rank SIGKILLs itself before that step on the first attempt. The
agent stops the other rank and starts both again; the same script continues from the job's last
checkpoint on its own. Reported per trial: whether the final params equal the uninterrupted run's bit
for bit (target: every trial), the wall time lost (the trial's minus the median uninterrupted run's),
and its parts: from the kill to the restarted job's first step (the agent's restart, the processes'
start, the build and the checkpoint load) and the steps run again (those after the last checkpoint).
The uninterrupted run is timed `--references` times, alternating with the trials.

Wall times on a small shared CPU machine are noisy: the load average at the start is recorded. With
--save, results go to benchmarks/results/faults.json.

    python -m benchmarks.faults [--trials 10] [--steps 66] [--every 11] [--references 3] [--seed 0] [--save]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64


def worker(out: str, steps: int, every: int, kill_rank: int, kill_at: int) -> None:
    """One process of the job (see the module docstring); rank 0 writes the final params and times to `out`."""
    from graphpar import data_parallel_model as dpm
    from graphpar import launch, workspace
    from graphpar.engine import HookBase, PeriodicCheckpointer, Trainer
    from graphpar.examples import train
    from graphpar.training.data import ArrayLoader

    directory = Path(out)
    rank, world = launch.get_rank(), launch.get_world_size()

    class Checkpoints(PeriodicCheckpointer):
        def after_step(self) -> None:
            if launch.is_main_process():
                super().after_step()

    class Fault(HookBase):
        def before_step(self) -> None:
            if rank == kill_rank and launch.restart_count() == 0 and self.trainer.iter == kill_at:
                (directory / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    class Resumed(HookBase):
        def before_train(self) -> None:
            if launch.restart_count() and rank == 0:
                (directory / "resumed").write_text(f"{time.time()!r} {self.trainer.start_iter}")

    x, y, _, _ = train.load_digits(0)
    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    model, _ = train.build([0, 1], True, 0.05, 8 * (len(y) // BATCH), rendezvous=launch.rendezvous())
    loader = train.ShardOf(ArrayLoader({"data": x, "label": y}, BATCH, seed=0), rank, world)
    trainer = Trainer(model, loader, [Checkpoints(directory / "ckpt", every), Fault(), Resumed()], max_iter=steps)
    trainer.resume_or_load(resume=False)
    trainer.train()
    if launch.is_main_process():
        np.savez(directory / "final.npz", **{n: workspace.FetchBlob(n) for n in sorted(dpm.GetCheckpointParams(model))})


def _job(out: Path, steps: int, every: int, kill_rank: int = -1, kill_at: int = -1) -> float:
    """Run the job under the launcher; its wall time (seconds)."""
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", "--max-restarts", "1", "-m",
               "benchmarks.faults", "--worker", str(out), "--steps", str(steps), "--every", str(every),
               "--kill-rank", str(kill_rank), "--kill-at", str(kill_at)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def _params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as found:
        return {name: found[name] for name in found.files}


def run(trials: int, steps: int, every: int, references: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    draws = [(int(rng.integers(0, 2)), int(rng.integers(1, steps))) for _ in range(trials)]
    reference_times: list[float] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="graphpar_faults_") as tmp:
        expected: dict[str, np.ndarray] | None = None
        for k in range(max(trials, references)):
            if k < references:
                reference_times.append(_job(Path(tmp) / f"ref{k}", steps, every))
                expected = expected or _params(Path(tmp) / f"ref{k}" / "final.npz")
            if k >= trials:
                continue
            rank, step = draws[k]
            out = Path(tmp) / f"trial{k}"
            wall = _job(out, steps, every, rank, step)
            found = _params(out / "final.npz")
            killed = float((out / "killed").read_text())
            resumed_at, start = (out / "resumed").read_text().split()
            identical = expected is not None and found.keys() == expected.keys() and all(
                np.array_equal(found[n], expected[n]) for n in expected)
            rows.append({"rank": rank, "step": step, "resumed_at": int(start), "steps_again": step - int(start),
                         "identical": bool(identical), "wall_s": wall,
                         "restart_s": float(resumed_at) - killed})
    base = float(np.median(reference_times))
    for row in rows:
        row["lost_s"] = row["wall_s"] - base
    return {"trials": rows, "reference_wall_s": reference_times, "steps": steps, "every": every,
            "identical": sum(r["identical"] for r in rows), "lost_s_median": float(np.median([r["lost_s"] for r in rows])),
            "restart_s_median": float(np.median([r["restart_s"] for r in rows]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=66, help="iterations of the job (3 epochs of the digits)")
    parser.add_argument("--every", type=int, default=11, help="iterations between checkpoints (k)")
    parser.add_argument("--references", type=int, default=3, help="uninterrupted runs timed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the ranks and steps drawn")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/faults.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kill-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.every, args.kill_rank, args.kill_at)
        return
    from benchmarks._common import markdown_table, write_json

    load = os.getloadavg()[0]
    result = run(args.trials, args.steps, args.every, args.references, args.seed)
    print(f"{result['identical']} of {len(result['trials'])} trials end with the uninterrupted run's params; "
          f"uninterrupted run {np.median(result['reference_wall_s']):.1f} s (median of "
          f"{len(result['reference_wall_s'])}); load average at start {load:.1f}\n")
    print(markdown_table(["rank killed", "before step", "resumed at", "steps again", "identical", "wall s",
                          "lost s", "kill -> first step s"],
                         [[r["rank"], r["step"], r["resumed_at"], r["steps_again"], r["identical"], r["wall_s"],
                           r["lost_s"], r["restart_s"]] for r in result["trials"]]))
    print(f"\nper fault: {result['lost_s_median']:.1f} s lost (median), {result['restart_s_median']:.1f} s from the "
          f"kill to the restarted job's first step (median)")
    if args.save:
        print(write_json("faults", {**result, "load_average_at_start": load}))


if __name__ == "__main__":
    main()
