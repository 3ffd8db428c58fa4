"""Should gradient bucketing be the default? Step time with and without it, N CPU devices, net type "dag".

Per model and device count, momentum-SGD training steps of `Parallelize` with every gradient all-reduced
on its own (the default, `gradient_bucket_bytes=None`) against DDP-style buckets (DDP's sizes: the first
bucket 1 MiB, the others 25 MiB), alternated in one process after warm-up; medians, and the ratio
unbucketed / bucketed (above 1: buckets are faster). A bucket costs one copy of its gradients per
device (`Concat` into the flat buffer; the flatten and the split back are views) and saves one
reduction op per gradient beyond the first: buckets win where per-op overhead dominates (many small
params), lose where copying does (a few large ones). Models: the MLP of `dp_throughput`
(512-1024-1024-10, batch 256), the small CNN of `step_time` (batch 32) and the zoo's ResNet-18 (width
32, batch 16, 3x64x64; 62 params), at the same global batch for every device count.

    python -m benchmarks.buckets [--repeats 15] [--devices 2,4] [--save]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from benchmarks._common import compare, markdown_table, median, write_json
from benchmarks.step_time import cnn_forward
from graphpar import models
from graphpar.executor.threads import thread_budget
from graphpar.model import brew, model_helper, optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

LR, MOMENTUM = 0.01, 0.9
DDP_BUCKETS = {"gradient_bucket_bytes": 25 * 1024 * 1024, "first_bucket_bytes": 1024 * 1024}


def mlp_forward(model: ModelHelper) -> str:
    h = "data"
    dims = (512, 1024, 1024, 10)
    for k, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        h = brew.fc(model, h, f"fc{k}", dim_in=d_in, dim_out=d_out)
        if k < len(dims) - 2:
            h = brew.relu(model, h, h)
    return h


def softmax_loss(forward: Callable[[ModelHelper], str]) -> Callable[[ModelHelper, float], list]:
    def loss(model: ModelHelper, loss_scale: float) -> list:
        return models.common.softmax_loss(model, forward(model), "label", loss_scale)

    return loss


def resnet18_loss(model: ModelHelper, loss_scale: float) -> list:
    return models.resnet18(model, loss_scale, num_classes=10, in_channels=3, width=32)


MODELS = {  # name: (forward pass builder, global batch, input shape)
    "MLP 512-1024-1024-10, batch 256": (softmax_loss(mlp_forward), 256, (512,)),
    "CNN, batch 32, 3x32x32": (softmax_loss(cnn_forward), 32, (3, 32, 32)),
    "ResNet-18 width 32, batch 16, 3x64x64": (resnet18_loss, 16, (3, 64, 64)),
}


def training_step(name: str, forward: Callable[[ModelHelper, float], list], devices: int, x: np.ndarray, y: np.ndarray,
                  buckets: dict) -> Callable[[], None]:
    """One RunNet of a Parallelized model on `devices` CPU devices, built and initialised."""
    workspace.SwitchWorkspace(name, True)
    model = model_helper.ModelHelper(name=name)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM),
                    devices=list(range(devices)), cpu_device=True, net_type="dag", **buckets)
    chunk = len(x) // devices
    for d in range(devices):
        workspace.FeedBlob(f"cpu_{d}/data", x[d * chunk:(d + 1) * chunk])
        workspace.FeedBlob(f"cpu_{d}/label", y[d * chunk:(d + 1) * chunk])
    dpm.RunInitNet(model)
    ws, net = workspace.get_workspace(), model.net.Proto().name
    return lambda: ws.run_net(net)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--devices", default="2,4")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/buckets.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, results = [], {}
    for model_name, (forward, batch, shape) in MODELS.items():
        x = rng.standard_normal((batch, *shape), dtype=np.float32)
        y = rng.integers(0, 10, batch).astype(np.int32)
        for devices in (int(d) for d in args.devices.split(",")):
            candidates = {label: training_step(f"buckets_{label}_{devices}", forward, devices, x, y, options)
                          for label, options in (("per gradient", {}), ("buckets", DDP_BUCKETS))}
            times = compare(candidates, repeats=args.repeats, warmup=args.warmup)
            plain, bucketed = median(times["per gradient"]), median(times["buckets"])
            rows.append((model_name, devices, plain * 1e3, bucketed * 1e3, plain / bucketed))
            results[f"{model_name}, {devices} devices"] = {"per_gradient_ms": plain * 1e3,
                                                          "buckets_ms": bucketed * 1e3,
                                                          "speedup_of_buckets": plain / bucketed}
    print(markdown_table(["model", "devices", "per gradient ms", "buckets ms", "per gradient / buckets"], rows))
    print(f"\nthread budget {thread_budget()}")
    if args.save:
        payload = {"benchmark": "buckets", "buckets": DDP_BUCKETS, "thread_budget": thread_budget(),
                   "results": results}
        print(f"wrote {write_json('buckets', payload)}")


if __name__ == "__main__":
    main()
