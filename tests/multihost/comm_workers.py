"""Shard processes for tests/multihost/test_comm.py: the Trainer's recorded scalars and `graphpar.comm`
across real gloo processes (kept free of pytest, as `workers`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.multihost import workers


def _start(store: str, shard: int, num_shards: int) -> dict[str, Any] | None:
    """A fresh seeded workspace with one intra-op thread and the file store; the rendezvous of shard
    `shard` of `num_shards` (None for one process)."""
    import torch

    from graphpar import workspace

    torch.set_num_threads(1)
    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    workspace.RunOperatorOnce(workers._op("FileStoreHandlerCreate", [], ["store_handler"], path=store))
    if num_shards == 1:
        return None
    return {"kv_handler": "store_handler", "shard_id": shard, "num_shards": num_shards, "timeout_sec": 20}


def trainer_scalars(out: str, shard: int, num_shards: int, devices: list[int], store: str, steps: int,
                    **options: Any) -> None:
    """Train the MLP with `graphpar.engine.Trainer` (shard `shard` gets its contiguous share of every
    global batch) and save the losses it recorded, plus `comm`'s gathers over the model's communicator,
    to `out` (or the error to `out + ".error"`)."""

    from graphpar import comm
    from graphpar.engine import Trainer

    rendezvous = _start(store, shard, num_shards)
    share = workers.GLOBAL_BATCH // num_shards
    batches = []
    for step in range(steps * options.get("accumulate_gradients", 1)):
        x, y = workers.batch("mlp", step)
        batches.append({"data": x[shard * share:(shard + 1) * share], "label": y[shard * share:(shard + 1) * share]})
    try:
        record_period = options.pop("record_period", None)
        model = workers.build("mlp", devices, rendezvous, **options)
        trainer = Trainer(model, batches, max_iter=steps, record_period=record_period)
        trainer.train()
        saved = {"loss": np.array([v for _, v in trainer.storage.history["scaled_loss"]])}
        world = comm.model_world(model)
        saved["gathered"] = np.array(comm.all_gather(list(range(shard + 1)), world), dtype=object)
        saved["gather0"] = np.array(comm.gather(f"shard{shard}", 0, world), dtype=object)
        reduced = comm.reduce_dict({"a": shard + 1.0, "b": 10.0 * shard}, group=world)
        summed = comm.reduce_dict({"a": shard + 1.0}, average=False, group=world)
        saved["reduced"] = np.array([reduced["a"], reduced["b"], summed["a"]])
        comm.synchronize(world)
        try:
            comm.reduce_dict({f"name{shard}": 1.0}, group=world)
        except ValueError as exc:
            saved["mismatch"] = np.array(str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        with open(out + ".error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        return
    np.savez(out, **saved)


def trainer_scalars_all(out: str, runs: list[dict[str, Any]], **common: Any) -> None:
    """`trainer_scalars` once per entry of `runs`, into `out_<k>.npz`."""
    for k, run in enumerate(runs):
        trainer_scalars(f"{out}_{k}.npz", **{**common, **run})


def local_groups(directory: str) -> None:
    """For graphpar.launch (2 processes): machines of one process each, then one machine of both;
    writes each group's size and an all_gather over it, and comm's gathers over the default group."""
    import os

    import torch.distributed as dist

    from graphpar import comm

    alone = comm.create_local_process_group(1)
    seen = [dist.get_world_size(group=alone), comm.all_gather(comm.get_rank(), alone), comm.get_local_size()]
    try:
        comm.create_local_process_group(2)
    except RuntimeError as exc:
        seen.append(str(exc))
    comm._local_group = None  # a second layout, for the test only
    both = comm.create_local_process_group(2)
    seen += [dist.get_world_size(group=both), comm.all_gather(comm.get_rank(), both),
             comm.reduce_dict({"x": comm.get_rank() + 1.0}), comm.gather(comm.get_rank())]
    comm.synchronize()
    with open(os.path.join(directory, f"rank{comm.get_rank()}"), "w") as f:
        f.write(repr(seen))


def default_trainer(directory: str, devices: int) -> None:
    """DefaultTrainer on a synthetic dataset with `devices` CPU devices in this process (run alone, or by
    graphpar.launch in each process); saves its params, losses and test results to rank<r>.npz."""
    import os

    import torch

    from graphpar import comm, workspace
    from graphpar.config import get_cfg
    from graphpar.defaults import DefaultTrainer
    from graphpar.loaders import DatasetCatalog

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    DatasetCatalog.register("mh_train", lambda: [{"image": a, "label": int(b)} for a, b in zip(x[:32], y[:32])])
    DatasetCatalog.register("mh_test", lambda: [{"image": a, "label": int(b)} for a, b in zip(x[32:], y[32:])])
    cfg = get_cfg()
    cfg.merge_from_list(["DATASETS.TRAIN", "('mh_train',)", "DATASETS.TEST", "('mh_test',)", "SOLVER.MAX_ITER", "5",
                         "SOLVER.IMS_PER_BATCH", "8", "SOLVER.WARMUP_ITERS", "0", "SOLVER.BASE_LR", "0.1",
                         "MODEL.NUM_CLASSES", "2", "MODEL.NUM_DEVICES", str(devices),
                         "OUTPUT_DIR", os.path.join(directory, f"out{devices}")])
    workspace.ResetWorkspace()
    trainer = DefaultTrainer(cfg)
    trainer.resume_or_load(resume=False)
    trainer.train()
    results = DefaultTrainer.test(trainer.cfg, trainer.test_model)
    params = {n: workspace.FetchBlob(f"cpu_0/{n}") for n in ("fc1_w", "pred_w")}
    np.savez(os.path.join(directory, f"d{devices}_rank{comm.get_rank()}.npz"),
             loss=np.array([v for _, v in trainer.storage.history["scaled_loss"]]),
             top1=np.array(results.get("accuracy", {}).get("top1", -1.0)), **params)


def bn_stats(out: str, shard: int, num_shards: int, slice_of: int, store: str, combine: Any) -> None:
    """The CNN (batch norm) on devices [0, 1] for one step, fed global batch slices of shard `slice_of`
    of 2; saves the batch statistics each replica normalised with (saved mean and inverse std; the
    running ones are broadcast from shard 0 after every step) to `out` (or the error)."""

    from graphpar import data_parallel_model as dpm
    from graphpar import workspace

    rendezvous = _start(store, shard, num_shards)
    try:
        model = workers.build("cnn", [0, 1], rendezvous, combine_spatial_bn=combine)
        workers.feed("cnn", 0, slice_of, 2, [0, 1])
        dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
        saved = {f"{d}/{s}": workspace.FetchBlob(f"cpu_{d}/bn1_{s}") for d in (0, 1) for s in ("sm", "siv")}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        with open(out + ".error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        return
    np.savez(out, **saved)


def bn_stats_all(out: str, runs: list[dict[str, Any]], **common: Any) -> None:
    for k, run in enumerate(runs):
        bn_stats(f"{out}_{k}.npz", **{**common, **run})


def bn_group_stats(out: str, shard: int, num_shards: int, store: str, slices: list[int], combine: Any) -> None:
    """The CNN (batch norm) for one step on one device per slice of `slices` (device i fed global slice
    slices[i] of 4); saves the batch statistics each replica normalised with, the initial conv1_w and
    the params after the step to `out` (or the error)."""

    from graphpar import data_parallel_model as dpm
    from graphpar import workspace

    rendezvous = _start(store, shard, num_shards)
    try:
        devices = list(range(len(slices)))
        model = workers.build("cnn", devices, rendezvous, combine_spatial_bn=combine, max_concurrent_distributed_ops=1)
        x, y = workers.batch("cnn", 0)
        parts = np.split(np.arange(workers.GLOBAL_BATCH), 4)
        for device, part in zip(devices, slices):
            workspace.FeedBlob(f"cpu_{device}/data", x[parts[part]])
            workspace.FeedBlob(f"cpu_{device}/label", y[parts[part]])
        dpm.RunInitNet(model)
        initial = workspace.FetchBlob("cpu_0/conv1_w")
        dpm.RunNet(model, 1)
        saved = {f"{d}/{s}": workspace.FetchBlob(f"cpu_{d}/bn1_{s}") for d in devices for s in ("sm", "siv")}
        saved.update({name: workspace.FetchBlob(f"cpu_0/{name}") for name in ("conv1_w", "pred_w")}, initial=initial)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        with open(out + ".error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        return
    np.savez(out, **saved)



def sampler_indices(out: str, rank: int, world: int, store: str) -> None:
    """Join a gloo default group of `world` on a FileStore in `store`, then save the first 2 epochs'
    indices this rank's `TrainingSampler(12, seed=None)` yields, to `out`."""
    import itertools
    import os

    import torch.distributed as dist

    from graphpar.loaders import TrainingSampler

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store, "sampler"), world), rank=rank,
                            world_size=world)
    try:
        indices = list(itertools.islice(iter(TrainingSampler(12, seed=None)), 2 * 12 // world))
    finally:
        dist.destroy_process_group()
    np.save(out, np.array(indices))
