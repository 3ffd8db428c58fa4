"""Sharded optimizer state (ZeRO stages 1 and 2) against the all-reduce: state bytes per device, step time.

ResNet-18 (the zoo's, width 64: 11.2M params; 10 classes, 3x32x32 inputs, global batch 16) trained
with Adam and with momentum SGD on 2, 4 and 8 CPU devices, in four ways built side by side in one
process and timed alternately after warm-up (medians of `--repeats` steps):

- "all-reduce": every replica keeps the whole optimizer state and runs every update, as replicas on
  GPUs do (`cpu_update_once=False`);
- "update once": graphpar's CPU default, where replicas of one process share the first device's
  state and update (`cpu_update_once`; there is no such sharing between GPUs);
- "stage 1": `shard_optimizer_state=True`; "stage 2": `shard_gradients=True`.

Every model frees its intermediates after their last use (`dynamic_memory_management`), so four of
them fit in memory at 8 devices. Optimizer-state bytes per device are measured: every tensor of the model's optimizer state in the
workspace, each storage counted once, for the device whose replica names it first; the table shows
the largest device's. `ratio` is stage 1's step time over the all-reduce's. The projection applies the
measured bytes per param per device, times N, to ResNet-50 (25,557,032 params) and a 1-billion-param
MLP on 8 and 64 GPUs: state bytes per device = k * 4 * P / N for k fp32 state tensors per param
(docs/sharding.md derives it).

    python -m benchmarks.sharded [--repeats 5] [--devices 2,4,8] [--quick] [--save]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._common import compare, markdown_table, median, write_json
from graphpar import models
from graphpar.core.naming import shard_name, stripBlobName
from graphpar.executor.threads import thread_budget
from graphpar.model import model_helper, optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

BATCH, CLASSES, SHAPE = 16, 10, (3, 32, 32)
OPTIMIZERS: dict[str, Callable[[ModelHelper], Any]] = {
    "Adam": lambda m: optimizer.build_adam(m, 1e-3),
    "momentum SGD": lambda m: optimizer.build_sgd(m, 0.01, momentum=0.9),
}
MODES = {"all-reduce": {"cpu_update_once": False}, "update once": {},
         "stage 1": {"shard_optimizer_state": True}, "stage 2": {"shard_gradients": True}}
PROJECTED = {"ResNet-50": 25_557_032, "MLP, 1B params": 1_000_000_000}


def resnet18(width: int) -> Callable[[ModelHelper, float], list]:
    return lambda model, loss_scale: models.resnet18(model, loss_scale, num_classes=CLASSES, width=width)


def build(name: str, forward: Callable, opt: Callable, devices: int, options: dict) -> tuple[Callable[[], None], dict]:
    """A parallelized model fed and initialised in workspace `name`: (one step, its state bytes)."""
    workspace.SwitchWorkspace(name, True)
    model = model_helper.ModelHelper(name=name)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=opt, devices=list(range(devices)), cpu_device=True,
                    dynamic_memory_management=True, **options)
    params = {stripBlobName(str(p)) for p in (*model.GetParams(), *model.GetComputedParams())}
    state = sorted(stripBlobName(b) for b in dpm.GetCheckpointParams(model)  # names only: not initialised yet
                   if b.startswith("cpu_0/") and stripBlobName(b) not in params)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *SHAPE), dtype=np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    chunk = BATCH // devices
    for d in range(devices):
        workspace.FeedBlob(f"cpu_{d}/data", x[d * chunk:(d + 1) * chunk])
        workspace.FeedBlob(f"cpu_{d}/label", y[d * chunk:(d + 1) * chunk])
    dpm.RunInitNet(model)
    ws, net = workspace.get_workspace(), model.net.Proto().name
    return lambda: ws.run_net(net), {"per_device": state_bytes(ws, devices, state),
                                     "params": sum(ws.blobs[f"cpu_0/{p}"].numel() for p in params
                                                   if p in {stripBlobName(str(q)) for q in model.GetParams()})}


def state_bytes(ws: workspace.Workspace, devices: int, names: list[str]) -> list[int]:
    """Per device, the bytes of the optimizer state its replica names (whole blobs or their parts),
    each storage counted once, for the first device naming it."""
    seen: set[int] = set()
    per_device = []
    for d in range(devices):
        total = 0
        for name in names:
            blob = f"cpu_{d}/{name}"
            tensor = ws.blobs.get(blob, ws.blobs.get(shard_name(blob)))
            if tensor is None or tensor.untyped_storage().data_ptr() in seen:
                continue
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.numel() * tensor.element_size()
        per_device.append(total)
    return per_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--quick", action="store_true", help="ResNet-18 of width 8, 2 repeats: a smoke run")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/sharded.json")
    args = parser.parse_args()
    width, repeats = (8, 2) if args.quick else (64, args.repeats)
    forward = resnet18(width)
    rows, results, projection = [], {}, {}
    for opt_name, opt in OPTIMIZERS.items():
        for devices in (int(d) for d in args.devices.split(",")):
            steps, memory = {}, {}
            for mode, options in MODES.items():
                steps[mode], memory[mode] = build(f"sharded_{opt_name}_{devices}_{mode}", forward, opt, devices, options)
            times = {mode: median(t) * 1e3 for mode, t in compare(steps, repeats=repeats, warmup=args.warmup).items()}
            for mode in MODES:  # free this configuration's four models before the next one
                workspace.SwitchWorkspace(f"sharded_{opt_name}_{devices}_{mode}")
                workspace.ResetWorkspace()
            workspace.SwitchWorkspace("default")
            held = {mode: max(m["per_device"]) for mode, m in memory.items()}
            params = memory["all-reduce"]["params"]
            key = f"{opt_name}, {devices} devices"
            results[key] = {"step_ms": times, "state_bytes_max_device": held,
                            "state_bytes_per_device": {mode: m["per_device"] for mode, m in memory.items()},
                            "params": params, "stage1_over_allreduce": times["stage 1"] / times["all-reduce"],
                            "stage2_over_allreduce": times["stage 2"] / times["all-reduce"],
                            "stage1_state_fraction": held["stage 1"] / held["all-reduce"]}
            rows.append((opt_name, devices, held["all-reduce"] / 2**20, held["stage 1"] / 2**20,
                         held["stage 1"] / held["all-reduce"], *(times[m] for m in MODES),
                         times["stage 1"] / times["all-reduce"]))
            print(f"{key}: {times}", flush=True)
            per_param = held["stage 1"] * devices / params  # measured bytes per param per device, times N
            projection[key] = {f"{model}, {gpus} GPUs": per_param * count / gpus
                               for model, count in PROJECTED.items() for gpus in (8, 64)}
    print(markdown_table(["optimizer", "devices", "state MiB all-reduce", "state MiB sharded", "fraction",
                          *(f"{m} ms" for m in MODES), "stage 1 / all-reduce"], rows))
    print("\nprojected sharded optimizer-state MiB per GPU (measured bytes per param x N / GPUs):")
    heads = list(next(iter(projection.values())))
    print(markdown_table(["measured on", *heads], [(k, *(v[h] / 2**20 for h in heads)) for k, v in projection.items()]))
    print(f"\nthread budget {thread_budget()}")
    if args.save:
        payload = {"benchmark": "sharded", "model": f"ResNet-18 width {width}, batch {BATCH}, 3x32x32",
                   "repeats": repeats, "thread_budget": thread_budget(), "results": results,
                   "projection_bytes_per_device": projection}
        print(f"wrote {write_json('sharded', payload)}")


if __name__ == "__main__":
    main()
