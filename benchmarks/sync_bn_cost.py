"""Cost of inter-device batch norm (`combine_spatial_bn=True`) against per-device batch norm.

ResNet-18 (3x32x32 inputs, 10 classes, SGD with momentum) is parallelized over `--devices` CPU
devices twice, with and without `combine_spatial_bn`, each in its own workspace; one training step of
each is timed alternately in one process after warm-up (medians). The table also gives, per
batch-norm layer and device count, the ops the rewrite adds: the local statistics ops
(ChannelStats, ChannelBackpropStats) and the cross-device ops (Sum / Copy, or NCCLAllreduce), from
the built nets. With --save, results go to benchmarks/results/sync_bn_cost.json.

    python -m benchmarks.sync_bn_cost [--devices 4] [--batch 4] [--repeats 10] [--warmup 2] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._common import compare, markdown_table, median, write_json
from graphpar.model import optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.models import resnet18
from graphpar.parallel import data_parallel_model as dpm
from graphpar.passes.analyze import is_cross_device_op
from graphpar.platform.devices import cuda_on_cpu
from graphpar.runtime import workspace

IMAGE, CLASSES = (3, 32, 32), 10
STATS_OPS = ("ChannelStats", "ChannelBackpropStats")


def build(devices: list[int], combine: bool, gpu: bool = False, use_nccl: bool = False) -> ModelHelper:
    """A parallelized ResNet-18 training model."""
    model = ModelHelper(name=f"resnet18_{'sync' if combine else 'local'}_bn")
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, scale: resnet18(m, scale, num_classes=CLASSES),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=devices, cpu_device=not gpu, use_nccl=use_nccl, combine_spatial_bn=combine,
                    net_type="simple")
    return model


def op_counts(devices: int, gpu: bool = False, use_nccl: bool = False) -> dict[str, Any]:
    """Ops the rewrite adds per batch-norm layer (forward and backward together) over `devices` devices."""
    with cuda_on_cpu(gpu):
        local, sync = (build(list(range(devices)), combine, gpu, use_nccl).net.Proto() for combine in (False, True))
    layers = sum(op.type == "SpatialBN" for op in local.ops) // devices
    cross = Counter(op.type for op in sync.ops if is_cross_device_op(op)) - Counter(
        op.type for op in local.ops if is_cross_device_op(op))
    stats = sum(op.type in STATS_OPS for op in sync.ops)
    return {"devices": devices, "engine": "NCCL (logical CUDA)" if use_nccl else "Sum tree + Copy",
            "bn_layers": layers, "cross_device_ops_per_layer": sum(cross.values()) / layers,
            "cross_device_ops_by_type_per_layer": {k: v / layers for k, v in sorted(cross.items())},
            "stats_ops_per_layer": stats / layers, "ops_added_per_layer": (len(sync.ops) - len(local.ops)) / layers}


def stepper(devices: list[int], combine: bool, batch: int) -> Callable[[], None]:
    """Build, feed and initialise a model in its own workspace; return one training step."""
    name = f"sync_bn_cost_{combine}"
    workspace.SwitchWorkspace(name, True)
    workspace.ResetWorkspace()
    model = build(devices, combine)
    rng = np.random.default_rng(0)
    for d in devices:
        workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((batch, *IMAGE)).astype(np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, CLASSES, batch).astype(np.int32))
    dpm.RunInitNet(model)

    def step() -> None:
        workspace.SwitchWorkspace(name)
        dpm.RunNet(model, 1)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="images per device")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/ (tracked files: only when asked)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    devices = list(range(opts.devices))
    steps = {"per-device BN": stepper(devices, False, opts.batch),
             "combine_spatial_bn": stepper(devices, True, opts.batch)}
    times = compare(steps, repeats=opts.repeats, warmup=opts.warmup)
    local, sync = median(times["per-device BN"]), median(times["combine_spatial_bn"])
    print(f"ResNet-18, {opts.devices} CPU devices x {opts.batch} images of {IMAGE}, {opts.threads} thread(s)\n")
    print(markdown_table(["variant", "median step ms", "relative"],
                         [["per-device BN", 1e3 * local, 1.0], ["combine_spatial_bn", 1e3 * sync, sync / local]]))
    counts = [op_counts(n) for n in (2, 4, 8)] + [op_counts(n, gpu=True, use_nccl=True) for n in (2, 4, 8)]
    print()
    print(markdown_table(["devices", "all-reduce", "BN layers", "cross-device ops / layer", "stats ops / layer",
                          "ops added / layer"],
                         [[c["devices"], c["engine"], c["bn_layers"], c["cross_device_ops_per_layer"],
                           c["stats_ops_per_layer"], c["ops_added_per_layer"]] for c in counts]))
    if opts.save:
        path = write_json("sync_bn_cost", {
            "model": "resnet18", "image": list(IMAGE), "devices": opts.devices, "batch_per_device": opts.batch,
            "repeats": opts.repeats, "warmup": opts.warmup, "threads": opts.threads,
            "step_ms": {"per_device_bn": 1e3 * local, "combine_spatial_bn": 1e3 * sync},
            "relative_step_time": sync / local, "times_s": times, "op_counts": counts})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
