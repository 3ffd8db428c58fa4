"""Wall time of `Parallelize` (build only, nothing runs) for ResNet-50 over 1 to 16 CPU devices.

Each device count builds a fresh ResNet-50 training model (SGD with momentum) `--repeats` times after
a warm-up, the counts taking turns; the median wall time, the op counts of the train and init nets,
and the growth from the previous device count (wall time; CPU time is recorded too) go into a
Markdown table (and, with --save, benchmarks/results/parallelize_time.json).
Targets: 16 devices in under 5 s, and 16 devices at most 2.2x the time of 8 (build time linear in
the op count, which grows 2.06x from 8 to 16 devices).

`--gpu` builds for logical CUDA devices instead (simulated on the CPU: `gpu_<id>` replicas, one
learning-rate blob per device), the path GPU models take.

    python -m benchmarks.parallelize_time [--devices 1 2 4 8 16] [--repeats 5] [--gpu] [--profile 16]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from typing import Any

from benchmarks._common import markdown_table, median, write_json
from graphpar.model import model_helper, optimizer
from graphpar.models import resnet50
from graphpar.parallel import data_parallel_model as dpm
from graphpar.platform.devices import cuda_on_cpu


def build(num_devices: int, gpu: bool = False) -> model_helper.ModelHelper:
    """A parallelized ResNet-50 training model over CPU (or simulated CUDA) devices 0..num_devices-1."""
    model = model_helper.ModelHelper(name="resnet50")
    with cuda_on_cpu(gpu):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=resnet50,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                        devices=list(range(num_devices)), cpu_device=not gpu)
    return model


def measure(device_counts: list[int], repeats: int, gpu: bool = False) -> list[dict[str, Any]]:
    """Median wall and CPU seconds per device count over `repeats` rounds of builds.

    Each round builds every device count once (the previous model dropped and garbage collected
    first), so slow spells of a shared machine hit all counts alike instead of skewing their ratios.
    CPU time (this process only) is reported beside wall time because other processes inflate the
    wall time of longer builds more.
    """
    wall: dict[int, list[float]] = {n: [] for n in device_counts}
    cpu: dict[int, list[float]] = {n: [] for n in device_counts}
    ops: dict[int, tuple[int, int]] = {}
    for _ in range(repeats):
        for n in device_counts:
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            model = build(n, gpu)
            wall[n].append(time.perf_counter() - start)
            cpu[n].append(time.process_time() - start_cpu)
            ops[n] = (len(model.net.Proto().ops), len(model.param_init_net.Proto().ops))
            model = None
    return [{"devices": n, "seconds": median(wall[n]), "min_seconds": min(wall[n]), "times": wall[n],
             "cpu_seconds": median(cpu[n]), "net_ops": ops[n][0], "init_ops": ops[n][1]}
            for n in device_counts]


def profile(num_devices: int, gpu: bool = False, top: int = 25) -> None:
    """Print the functions with the most own time in one build (after a warm-up build)."""
    build(1, gpu)
    profiler = cProfile.Profile()
    profiler.runcall(build, num_devices, gpu)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="replicas on simulated CUDA devices (gpu_<id>)")
    parser.add_argument("--profile", type=int, default=None, metavar="N",
                        help="print a cProfile of one build over N devices instead")
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/ (tracked files: only when asked)")
    opts = parser.parse_args()
    if opts.profile is not None:
        profile(opts.profile, opts.gpu)
        return
    build(1, opts.gpu)  # warm-up: imports, registries
    results = measure(opts.devices, opts.repeats, opts.gpu)
    rows = []
    for previous, result in zip([None, *results], results):
        growth = result["seconds"] / previous["seconds"] if previous else None
        result["growth_vs_previous"] = growth
        rows.append([result["devices"], result["seconds"], result["min_seconds"], result["cpu_seconds"],
                     result["net_ops"], result["init_ops"], "" if growth is None else f"{growth:.2f}x"])
    print(markdown_table(["devices", "median s", "min s", "median CPU s", "train-net ops", "init-net ops",
                          "vs previous"], rows))
    by_count = {r["devices"]: r for r in results}
    targets = {}
    if 16 in by_count:
        targets["16_devices_under_5s"] = by_count[16]["seconds"] < 5.0
    if 8 in by_count and 16 in by_count:
        targets["ratio_16_over_8"] = by_count[16]["seconds"] / by_count[8]["seconds"]
        targets["ratio_16_over_8_at_most_2.2"] = targets["ratio_16_over_8"] <= 2.2
        targets["cpu_ratio_16_over_8"] = by_count[16]["cpu_seconds"] / by_count[8]["cpu_seconds"]
        targets["min_ratio_16_over_8"] = by_count[16]["min_seconds"] / by_count[8]["min_seconds"]
    print(f"\ntargets: {targets}")
    name = "parallelize_time_gpu" if opts.gpu else "parallelize_time"
    if opts.save:
        path = write_json(name, {"model": "resnet50", "devices": "simulated CUDA" if opts.gpu else "CPU",
                                 "repeats": opts.repeats, "results": results, "targets": targets})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
