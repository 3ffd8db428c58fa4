"""Multi-process training throughput and the cost of graphpar's cross-shard collective path.

Two measurements, each in fresh processes on this machine (gloo over loopback, a FileStore):

1. samples/s of one MLP step on the same global batch: graphpar with 1 process x 2 CPU devices,
   graphpar with 2 processes x 1 device (rendezvous; dag executor, and the simple one, whose
   collectives cannot overlap the backward pass), and PyTorch DDP with 2 processes (same layer
   sizes, SGD with momentum). Rank 0's wall time over `--steps` steps after warm-up; every process
   gets cores / processes intra-op threads, as `graphpar.launch` gives them.
2. all-reduce of the same tensors across 2 processes: graphpar's path (a net of `Allreduce` ops on a
   communicator from `CreateCommonWorld`, run by the simple executor) vs raw
   `torch.distributed.all_reduce` in a loop on the default group, alternated (each first every other
   repeat); the goal is at most 10% overhead. Reported: the ratio of the medians and, as the spread,
   the quartiles of the per-repeat ratios (a loaded machine slows both sides of a pair alike).

Numbers from a small, shared CPU machine are noisy and say nothing about GPUs or real networks; the
load average at the start is recorded. With --save, results go to benchmarks/results/multihost.json.

    python -m benchmarks.multihost [--steps 30] [--batch 256] [--hidden 1024] [--repeats 20]
                                   [--only-allreduce] [--save]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks._common import markdown_table, median, write_json

DIM_IN, CLASSES = 256, 10
TENSOR_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)  # float32 elements: 4 KiB .. 8 MiB


def _data(batch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(step)
    return rng.randn(batch, DIM_IN).astype(np.float32), rng.randint(0, CLASSES, batch).astype(np.int32)


def _graphpar_steps(rank: int, shards: int, devices: int, net_type: str, store: str, batch: int, hidden: int,
                    steps: int) -> float:
    """Seconds for `steps` graphpar steps of this shard (after 3 warm-up steps)."""
    from graphpar.core.net import CreateOperator
    from graphpar.model import brew, optimizer
    from graphpar.model.model_helper import ModelHelper
    from graphpar.models.common import softmax_loss
    from graphpar.parallel import data_parallel_model as dpm
    from graphpar.runtime import workspace
    from graphpar.training.data import feed_batch

    def forward(model: Any, loss_scale: float) -> list:
        h = brew.relu(model, brew.fc(model, "data", "fc1", dim_in=DIM_IN, dim_out=hidden), "fc1")
        h = brew.relu(model, brew.fc(model, h, "fc2", dim_in=hidden, dim_out=hidden), "fc2")
        return softmax_loss(model, brew.fc(model, h, "pred", dim_in=hidden, dim_out=CLASSES), "label", loss_scale)

    workspace.RunOperatorOnce(CreateOperator("FileStoreHandlerCreate", [], ["store_handler"], path=store))
    rendezvous = {"kv_handler": "store_handler", "shard_id": rank, "num_shards": shards} if shards > 1 else None
    model = ModelHelper(name="bench")
    dpm.Parallelize(model, lambda m: None, forward, optimizer_builder_fun=lambda m: optimizer.build_sgd(
        m, 0.01, momentum=0.9), devices=list(range(devices)), cpu_device=True, rendezvous=rendezvous,
        net_type=net_type)
    share = batch // shards

    def step(k: int) -> None:
        x, y = _data(batch, k)
        feed_batch(model, {"data": x[rank * share:(rank + 1) * share], "label": y[rank * share:(rank + 1) * share]})
        dpm.RunNet(model, 1)

    x, y = _data(batch, 0)
    feed_batch(model, {"data": x[:share], "label": y[:share]})
    dpm.RunInitNet(model)
    for k in range(3):
        step(k)
    dpm.Synchronize(model)
    start = time.perf_counter()
    for k in range(steps):
        step(k)
    return time.perf_counter() - start


def _ddp_steps(rank: int, store: str, batch: int, hidden: int, steps: int) -> float:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store, "ddp"), 2), rank=rank, world_size=2)
    net = nn.Sequential(nn.Linear(DIM_IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                        nn.Linear(hidden, CLASSES))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    share = batch // 2

    def step(k: int) -> None:
        x, y = _data(batch, k)
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x[rank * share:(rank + 1) * share])),
                                           torch.from_numpy(y[rank * share:(rank + 1) * share]).long())
        opt.zero_grad()
        loss.backward()
        opt.step()

    for k in range(3):
        step(k)
    dist.barrier()
    start = time.perf_counter()
    for k in range(steps):
        step(k)
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def _allreduce_times(rank: int, store: str, repeats: int) -> dict[int, tuple[list[float], list[float]]]:
    """{elements: (graphpar seconds, raw seconds) per repeat} per tensor size, alternated."""
    import torch
    import torch.distributed as dist

    from graphpar.core.ir import NetDef, OperatorDef
    from graphpar.core.net import CreateOperator
    from graphpar.runtime import workspace

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store, "raw"), 2), rank=rank, world_size=2)
    workspace.RunOperatorOnce(CreateOperator("FileStoreHandlerCreate", [], ["store_handler"], path=store))
    workspace.RunOperatorOnce(CreateOperator("CreateCommonWorld", ["store_handler"], ["cw"], size=2, rank=rank,
                                             name="bench_cw"))
    results = {}
    for n in TENSOR_SIZES:
        count = 8  # tensors per round, as a net of 8 gradients
        names = [f"g{n}_{k}" for k in range(count)]
        tensors = [torch.randn(n) for _ in names]
        for name, t in zip(names, tensors):
            workspace.FeedBlob(name, t)
        net = NetDef(f"allreduce_{n}", [OperatorDef("Allreduce", ["cw", b], [b]) for b in names], ["cw", *names])
        workspace.CreateNet(net)
        times: dict[str, list[float]] = {"ours": [], "raw": []}
        for k in range(repeats + 2):
            for side in ("ours", "raw") if k % 2 else ("raw", "ours"):  # neither always goes first
                dist.barrier()
                start = time.perf_counter()
                if side == "ours":
                    workspace.RunNet(net.name)
                else:
                    for t in tensors:
                        dist.all_reduce(t)
                times[side].append(time.perf_counter() - start)
        results[n] = (times["ours"][2:], times["raw"][2:])
    dist.destroy_process_group()
    return results


def _run(job: str, rank: int, count: int, args: tuple, queue: Any) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // count))  # as graphpar.launch: a share of the cores
    fn = {"graphpar": _graphpar_steps, "ddp": _ddp_steps, "allreduce": _allreduce_times}[job]
    queue.put((rank, fn(rank, *args)))


def _processes(job: str, count: int, args: tuple) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(job, r, count, args, queue)) for r in range(count)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only-allreduce", action="store_true", help="skip the training throughput")
    parser.add_argument("--save", action="store_true",
                        help="also write benchmarks/results/multihost.json (a tracked file)")
    args = parser.parse_args()
    rows, results = [], {"batch": args.batch, "hidden": args.hidden, "steps": args.steps, "cpus": os.cpu_count(),
                         "load_average_at_start": os.getloadavg()[0],
                         "note": "a 2-core CPU machine, possibly shared (see load_average_at_start): noisy; nothing about GPUs or networks"}
    for label, job, count, shards, devices, net_type in () if args.only_allreduce else (
            ("graphpar 1 process x 2 devices", "graphpar", 1, 1, 2, "dag"),
            ("graphpar 2 processes x 1 device", "graphpar", 2, 2, 1, "dag"),
            ("graphpar 2 processes x 1 device, simple executor (no overlap)", "graphpar", 2, 2, 1, "simple"),
            ("DDP 2 processes", "ddp", 2, 2, 1, "")):
        with tempfile.TemporaryDirectory() as store:
            extra = (shards, devices, net_type, store) if job == "graphpar" else (store,)
            seconds = _processes(job, count, (*extra, args.batch, args.hidden, args.steps))[0]
        rate = args.batch * args.steps / seconds
        results[label] = {"samples_per_s": rate}
        rows.append([label, f"{rate:.0f}"])
    if rows:
        print(markdown_table(["configuration", "samples/s"], rows))
    with tempfile.TemporaryDirectory() as store:
        times = _processes("allreduce", 2, (store, args.repeats))[0]
    rows = []
    for n, (ours, raw) in times.items():
        overhead = median(ours) / median(raw) - 1
        low, _, high = (q - 1 for q in statistics.quantiles([a / b for a, b in zip(ours, raw)], n=4))
        results[f"allreduce_{n}"] = {"graphpar_s": median(ours), "raw_s": median(raw), "overhead": overhead,
                                     "paired_overhead_quartiles": [low, high]}
        rows.append([f"8 x {n * 4 // 1024} KiB", f"{median(ours) * 1e3:.2f}", f"{median(raw) * 1e3:.2f}",
                     f"{overhead:+.0%}", f"{low:+.0%} .. {high:+.0%}"])
    print(markdown_table(["tensors", "graphpar ms", "torch.distributed ms", "overhead (medians)",
                          "per-repeat quartiles"], rows))
    if args.save:
        write_json("multihost", results)


if __name__ == "__main__":
    main()
