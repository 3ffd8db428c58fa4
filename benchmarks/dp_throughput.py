"""Data-parallel training throughput on CPU devices: graphpar (dag and simple executors) vs eager vs DDP.

At a fixed global batch, the samples per second of momentum-SGD training of an MLP on:
- eager PyTorch on the whole batch in one process (torch's default threads: the machine's cores);
- graphpar with N = 1, 2, 4 CPU devices, net type "dag" (replicas run side by side) and "simple",
  "dag" with `shared_model` (Caffe2's CPU option: the replicas read one copy of the params, so
  it is updated once instead of N times), and both with `cpu_update_once=False` ("update per
  replica": every replica updates its own copy, as before `cpu_update_once` became the default);
- PyTorch DDP with N gloo processes (N = 2, 4), each on batch / N with cores / N threads.
graphpar and eager alternate in one process after warm-up (medians over repeats); DDP runs in its own
processes and reports the median over its timed steps. Ratios are against eager.

    python -m benchmarks.dp_throughput [--batch 256] [--dims 512,1024,1024,10] [--repeats 15] [--save]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from benchmarks._common import compare, markdown_table, median, write_json
from graphpar.executor.threads import thread_budget
from graphpar.model import brew, model_helper, optimizer
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

LR, MOMENTUM = 0.01, 0.9


def mlp_module(dims: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for d_in, d_out in zip(dims[:-2], dims[1:-1]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(dims[-2], dims[-1]))


def graphpar_step(dims: list[int], devices: int, net_type: str, x: np.ndarray, y: np.ndarray,  # noqa: ANN201
                  shared_model: bool = False, cpu_update_once: bool = True):
    """A function running one graphpar training step on `devices` CPU replicas (built and initialised)."""
    name = f"dp_{net_type}_{devices}_{shared_model}_{cpu_update_once}"
    workspace.SwitchWorkspace(name, True)  # one workspace per candidate
    model = model_helper.ModelHelper(name=name)

    def forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
        h = "data"
        for k, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            h = brew.fc(model, h, f"fc{k}", dim_in=d_in, dim_out=d_out)
            if k < len(dims) - 2:
                h = brew.relu(model, h, h)
        _, loss = model.net.SoftmaxWithLoss([h, "label"], ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM),
                    devices=list(range(devices)), cpu_device=True, net_type=net_type, shared_model=shared_model,
                    cpu_update_once=cpu_update_once)
    chunk = len(x) // devices
    for d in range(devices):
        workspace.FeedBlob(f"cpu_{d}/data", x[d * chunk:(d + 1) * chunk])
        workspace.FeedBlob(f"cpu_{d}/label", y[d * chunk:(d + 1) * chunk])
    dpm.RunInitNet(model)
    ws = workspace.get_workspace()
    return lambda: ws.run_net(model.net.Proto().name)


def eager_step(dims: list[int], x: np.ndarray, y: np.ndarray):  # noqa: ANN201
    module = mlp_module(dims)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(module(xt), yt).backward()
        opt.step()

    return step


def _ddp_worker(rank: int, world: int, dims: list[int], batch: int, steps: int, warmup: int, store_path: str,
                out: mp.Queue) -> None:
    torch.set_num_threads(max(1, thread_budget() // world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    module = nn.parallel.DistributedDataParallel(mlp_module(dims))
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    rng = np.random.default_rng(rank)
    x = torch.from_numpy(rng.standard_normal((batch // world, dims[0]), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, dims[-1], batch // world)).long()
    times = []
    for k in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(median(times))
    dist.destroy_process_group()


def ddp_step_seconds(dims: list[int], world: int, batch: int, steps: int, warmup: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_ddp_worker, args=(r, world, dims, batch, steps, warmup,
                                                         os.path.join(tmp, "store"), out)) for r in range(world)]
        for p in procs:
            p.start()
        seconds = out.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dims", default="512,1024,1024,10")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/dp_throughput.json")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, dims[0]), dtype=np.float32)
    y = rng.integers(0, dims[-1], args.batch).astype(np.int32)
    default_threads = torch.get_num_threads()
    candidates = {"eager, whole batch": eager_step(dims, x, y)}
    for n in (1, 2, 4):
        for net_type in ("dag", "simple"):
            candidates[f"graphpar {net_type}, {n} devices"] = graphpar_step(dims, n, net_type, x, y)
        if n > 1:
            candidates[f"graphpar dag, {n} devices, shared model"] = graphpar_step(dims, n, "dag", x, y, True)
            for net_type in ("dag", "simple"):
                candidates[f"graphpar {net_type}, {n} devices, update per replica"] = graphpar_step(
                    dims, n, net_type, x, y, cpu_update_once=False)
    torch.set_num_threads(default_threads)
    times = compare(candidates, repeats=args.repeats, warmup=args.warmup)
    seconds = {name: median(ts) for name, ts in times.items()}
    for world in (2, 4):
        seconds[f"DDP gloo, {world} processes"] = ddp_step_seconds(dims, world, args.batch, args.repeats, args.warmup)
    eager = seconds["eager, whole batch"]
    rows = [(name, s * 1e3, args.batch / s, eager / s) for name, s in seconds.items()]
    print(markdown_table(["run", "ms/step", "samples/s", "vs eager"], rows))
    dag2, simple2 = seconds["graphpar dag, 2 devices"], seconds["graphpar simple, 2 devices"]
    print(f"\ndag / simple at 2 devices: {simple2 / dag2:.2f}x; thread budget {thread_budget()}")
    payload = {"benchmark": "dp_throughput", "batch": args.batch, "dims": dims, "thread_budget": thread_budget(),
               "ms_per_step": {name: s * 1e3 for name, s in seconds.items()},
               "throughput_vs_eager": {name: eager / s for name, s in seconds.items()},
               "dag_over_simple_2_devices": simple2 / dag2}
    if args.save:
        print(f"wrote {write_json('dp_throughput', payload)}")


if __name__ == "__main__":
    main()
