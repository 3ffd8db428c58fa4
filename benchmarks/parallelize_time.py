"""Wall time of `Parallelize` (build only, nothing runs) for ResNet-50 over 1 to 16 CPU devices.

Each device count builds a fresh ResNet-50 training model (SGD with momentum) `--repeats` times after a
warm-up; the median wall time, the op counts of the train and init nets, and the growth from the
previous device count (wall time; CPU time is recorded too) go into a Markdown table and benchmarks/results/parallelize_time.json.
Targets: 16 devices in under 5 s, and 16 devices at most 2.2x the time of 8 (build time linear in
the op count, which grows 2.06x from 8 to 16 devices).

    python -m benchmarks.parallelize_time [--devices 1 2 4 8 16] [--repeats 5] [--profile 16]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from typing import Any

from benchmarks._common import markdown_table, median, write_json
from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer
from graphpar.models import resnet50


def build(num_devices: int) -> model_helper.ModelHelper:
    """A parallelized ResNet-50 training model over CPU devices 0..num_devices-1."""
    model = model_helper.ModelHelper(name="resnet50")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=resnet50,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=list(range(num_devices)), cpu_device=True)
    return model


def measure(num_devices: int, repeats: int) -> dict[str, Any]:
    """Median wall and CPU seconds over `repeats` builds (earlier builds' garbage collected first).

    CPU time (this process only) is reported beside wall time because on a shared machine other
    processes inflate the wall time of longer builds more.
    """
    wall, cpu, model = [], [], None
    for _ in range(repeats):
        model = None
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        model = build(num_devices)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"devices": num_devices, "seconds": median(wall), "min_seconds": min(wall), "times": wall,
            "cpu_seconds": median(cpu), "net_ops": len(model.net.Proto().ops),
            "init_ops": len(model.param_init_net.Proto().ops)}


def profile(num_devices: int, top: int = 25) -> None:
    """Print the functions with the most own time in one build."""
    profiler = cProfile.Profile()
    profiler.runcall(build, num_devices)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=int, default=None, metavar="N",
                        help="print a cProfile of one build over N devices instead")
    opts = parser.parse_args()
    if opts.profile is not None:
        profile(opts.profile)
        return
    build(1)  # warm-up: imports, registries
    results = [measure(n, opts.repeats) for n in opts.devices]
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
    print(f"\ntargets: {targets}")
    path = write_json("parallelize_time", {"model": "resnet50", "repeats": opts.repeats, "results": results,
                                           "targets": targets})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
