"""Tensor memory of a training step: graphpar with each memory option vs eager PyTorch, side by side.

For each model (one CPU device, momentum SGD) and each graphpar setting (no option,
`dynamic_memory_management`, `optimize_gradient_memory`, both), after warm-up:
- *live between steps*: the bytes of the distinct tensor storages alive after a step (graphpar: every
  blob of the workspace; eager: params, their gradients, the optimizer's state and the batch);
- *peak*: that baseline plus the highest net allocation while one step runs, from PyTorch's profiler
  (`profile_memory=True`, op granularity: an op's own temporaries freed inside it do not count).
Ratios are against eager. On a GPU (`--device cuda`), `torch.cuda.max_memory_allocated` gives the peak.

    python -m benchmarks.memory [--models mlp,cnn,resnet18] [--save]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks import eager_models
from benchmarks._common import markdown_table, write_json
from graphpar import models
from graphpar.model import model_helper, optimizer
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

LR, MOMENTUM = 0.01, 0.9
MODELS = {  # name: (graphpar builder, eager module factory, input shape, batch)
    "mlp": (functools.partial(models.mlp, dim_in=512, hidden=(1024, 1024), num_classes=10),
            functools.partial(eager_models.mlp, 512, (1024, 1024), 10), (512,), 256),
    "cnn": (functools.partial(models.lenet, in_channels=1, image_size=28, channels=(20, 50), hidden=500),
            functools.partial(eager_models.lenet, 1, 28, (20, 50), 500, 10), (1, 28, 28), 64),
    "resnet18": (functools.partial(models.resnet18, num_classes=10, in_channels=3, width=32),
                 functools.partial(eager_models.resnet18, 3, 32, 10), (3, 64, 64), 16),
    "resnet50": (functools.partial(models.resnet50, num_classes=10, in_channels=3, width=16),
                 None, (3, 64, 64), 8),
}
SETTINGS = {"no option": {}, "dynamic_memory_management": {"dynamic_memory_management": True},
            "optimize_gradient_memory": {"optimize_gradient_memory": True},
            "both": {"dynamic_memory_management": True, "optimize_gradient_memory": True}}


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_allocation(step: Callable[[], None]) -> int:
    """The highest net number of bytes allocated at any point of `step()`, relative to its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


def batch(shape: tuple[int, ...], size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((size, *shape), dtype=np.float32), rng.integers(0, 10, size).astype(np.int32)


def eager_case(factory: Callable[[], torch.nn.Module], x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
    module = factory()
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(module(xt), yt).backward()
        opt.step()

    for _ in range(2):
        step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    buffers = list(module.buffers())
    live = storage_bytes([*module.parameters(), *grads, *state, *buffers, xt, yt])
    return live, live + peak_allocation(step)


def graphpar_case(builder: Callable, x: np.ndarray, y: np.ndarray, options: dict) -> tuple[int, int]:
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="memory")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=builder,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM),
                    devices=[0], cpu_device=True, net_type="simple", **options)
    workspace.FeedBlob("cpu_0/data", x)
    workspace.FeedBlob("cpu_0/label", y)
    dpm.RunInitNet(model)
    ws = workspace.get_workspace()

    def step() -> None:
        ws.run_net(model.net.Proto().name)

    for _ in range(2):
        step()
    live = storage_bytes(ws.blobs.values())
    return live, live + peak_allocation(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,resnet18")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/memory.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, payload = [], {}
    for name in args.models.split(","):
        builder, factory, shape, size = MODELS[name]
        x, y = batch(shape, size)
        results = {"eager": eager_case(factory, x, y)} if factory is not None else {}
        for setting, options in SETTINGS.items():
            results[f"graphpar, {setting}"] = graphpar_case(builder, x, y, options)
        eager_live, eager_peak = results.get("eager", (np.nan, np.nan))
        for run, (live, peak) in results.items():
            rows.append((name, run, live / 2**20, peak / 2**20, live / eager_live, peak / eager_peak))
        payload[name] = {run: {"live_mib": live / 2**20, "peak_mib": peak / 2**20} for run, (live, peak)
                         in results.items()}
    print(markdown_table(["model", "run", "live MiB", "peak MiB", "live vs eager", "peak vs eager"], rows))
    if args.save:
        print(f"wrote {write_json('memory', {'benchmark': 'memory', 'models': payload})}")


if __name__ == "__main__":
    main()
