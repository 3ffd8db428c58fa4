"""Loading overlapped with compute: a training loop fed directly vs through a `DeviceFeeder`.

The main job's CNN (digits, 8x8) is parallelized over `--devices` CPU devices; `--repeats` steps
are timed first. A loader then takes as long as a step per batch (`--load-ms`, default: that step
time; `time.sleep`, as waiting for I/O or DataLoader worker processes does, so the GIL is free).
In `--rounds` alternated rounds, `--steps` steps are run with an instant loader (compute only), fed
directly (load, then step: ideally load + compute per step) and through a `DeviceFeeder` (the next
batches load on a thread while the step runs: ideally max(load, compute)); medians per step. The
overlap ratio is the share of the hideable time that the feeder hides,
(load + compute - fed) / min(load, compute) per step: 1.0 is perfect overlap (fed =
max(load, compute)), 0 none (fed = load + compute). It uses the compute-only time, not the direct
loop's, whose sleeps overshoot on a busy machine. With --save, results go to
benchmarks/results/feeding.json.

    python -m benchmarks.feeding [--devices 4] [--batch 64] [--steps 40] [--load-ms MS] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import numpy as np
import torch

from benchmarks._common import markdown_table, median, write_json
from graphpar.examples.train import build
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace
from graphpar.training.data import DeviceFeeder, feed


class SlowLoader:
    """`count` random digit batches, each taking `delay` seconds to "load"."""

    def __init__(self, count: int, batch: int, delay: float) -> None:
        self.count, self.batch, self.delay = count, batch, delay
        rng = np.random.default_rng(0)
        self.data = rng.random((batch, 1, 8, 8), dtype=np.float32)
        self.label = rng.integers(0, 10, batch).astype(np.int32)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for _ in range(self.count):
            time.sleep(self.delay)
            yield {"data": self.data.copy(), "label": self.label.copy()}


def run(model, loader, feeder: bool) -> float:
    """Seconds for one pass over `loader` (feed + step each batch), fed directly or through a feeder."""
    start = time.perf_counter()
    if feeder:
        with DeviceFeeder(loader, model) as batches:
            for batch in batches:
                feed(model, batch)
                dpm.RunNet(model, 1)
    else:
        for batch in loader:
            feed(model, batch)
            dpm.RunNet(model, 1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=20, help="steps timed to set the load time")
    parser.add_argument("--rounds", type=int, default=3, help="alternated direct / feeder passes (medians)")
    parser.add_argument("--load-ms", type=float, default=None, help="load time per batch (default: a step's)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/ (tracked files: only when asked)")
    opts = parser.parse_args()
    workspace.ResetWorkspace()
    model, _ = build(list(range(opts.devices)), True, 0.01, 10**6)
    feed(model, next(iter(SlowLoader(1, opts.batch, 0.0))))
    dpm.RunInitNet(model)
    calibration = SlowLoader(opts.repeats, opts.batch, 0.0)
    load = run(model, calibration, False) / opts.repeats if opts.load_ms is None else opts.load_ms / 1e3
    loaders = {"compute only": SlowLoader(opts.steps, opts.batch, 0.0), "direct": SlowLoader(opts.steps, opts.batch, load),
               "DeviceFeeder": SlowLoader(opts.steps, opts.batch, load)}
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(opts.rounds):  # alternated, so drifts of a busy machine hit every loop alike
        for name, loader in loaders.items():
            times[name].append(run(model, loader, name == "DeviceFeeder") / opts.steps)
    compute, serial, fed = (median(times[name]) for name in loaders)
    overlap = (load + compute - fed) / min(load, compute)
    print(f"digits CNN, {opts.devices} CPU devices, batch {opts.batch}, {torch.get_num_threads()} torch threads; "
          f"compute {1e3 * compute:.2f} ms/step, load {1e3 * load:.2f} ms/batch\n")
    print(markdown_table(["loop", "ms / step", "steps / s", "ideal steps / s"], [
        ["compute only", 1e3 * compute, 1 / compute, 1 / compute],
        ["fed directly", 1e3 * serial, 1 / serial, 1 / (load + compute)],
        ["DeviceFeeder", 1e3 * fed, 1 / fed, 1 / max(load, compute)]]))
    print(f"\noverlap ratio {overlap:.2f} (1.0: loading fully hidden behind compute)")
    if opts.save:
        path = write_json("feeding", {
            "model": "digits CNN (graphpar.examples.train)", "devices": opts.devices, "batch": opts.batch,
            "steps": opts.steps, "rounds": opts.rounds, "compute_ms": 1e3 * compute, "load_ms": 1e3 * load,
            "ms_per_step": {"compute_only": 1e3 * compute, "direct": 1e3 * serial, "device_feeder": 1e3 * fed},
            "steps_per_s": {"direct": 1 / serial, "device_feeder": 1 / fed,
                            "ideal_direct": 1 / (load + compute), "ideal_device_feeder": 1 / max(load, compute)},
            "overlap_ratio": overlap, "times_s_per_step": times})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
