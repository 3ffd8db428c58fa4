"""Training processes for the multi-host tests: one shard each, started by `tests.multihost.helpers`.

Kept free of pytest so that spawned children import it cheaply. Every worker trains the same model on
the same global batches; shard `s` of `S` with `D` local devices feeds global slices `s*D .. s*D+D-1`,
so S shards x D devices compute what 1 shard x S*D devices computes.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

GLOBAL_BATCH = 8
LR, MOMENTUM = 0.125, 0.9


def forward(kind: str, hidden: int = 8):  # noqa: ANN201
    from graphpar import brew
    from graphpar.models.common import softmax_loss

    def mlp(model, loss_scale):  # noqa: ANN001, ANN202
        h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=hidden)
        h = brew.relu(model, h, h)
        return softmax_loss(model, brew.fc(model, h, "pred", dim_in=hidden, dim_out=3), "label", loss_scale)

    def cnn(model, loss_scale):  # noqa: ANN001, ANN202
        h = brew.conv(model, "data", "conv1", dim_in=2, dim_out=3, kernel=3, pad=1, no_bias=True)
        h = brew.spatial_bn(model, h, "bn1", dim_in=3, epsilon=1e-5, momentum=0.9)
        h = brew.relu(model, h, h)
        h = brew.max_pool(model, h, "pool1", kernel=2, stride=2)
        return softmax_loss(model, brew.fc(model, h, "pred", dim_in=3 * 2 * 2, dim_out=3), "label", loss_scale)

    def dlrm(model, loss_scale):  # noqa: ANN001, ANN202
        from graphpar.models.dlrm import dlrm

        return dlrm(model, loss_scale, num_dense=3, table_rows=(40, 30), dim=4, bottom=(6,), top=(5,))

    return {"mlp": mlp, "cnn": cnn, "dlrm": dlrm}[kind]


def batch(kind: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + step)
    shape = (6,) if kind == "mlp" else (2, 4, 4)
    return rng.randn(GLOBAL_BATCH, *shape).astype(np.float32), rng.randint(0, 3, GLOBAL_BATCH).astype(np.int32)


def local_sgd(model) -> None:  # noqa: ANN001
    """BMUF's per-device update: momentum SGD on the replica's own gradients."""
    from graphpar import brew

    rate = model.net.LearningRate([brew.iter(model, "ITER")], "LR", base_lr=LR, policy="fixed")
    for param in model.GetParams():
        momentum = model.param_init_net.ConstantFill([param], f"{param}_momentum".split("/")[-1], value=0.0)
        grad = model.param_to_grad[param]
        model.net.MomentumSGDUpdate([grad, momentum, rate, param], [grad, momentum, param], momentum=MOMENTUM)


def build(kind: str, devices: list[int], rendezvous: dict | None, hidden: int = 8, bmuf: bool = False,
          lr: float = LR, **options: Any):  # noqa: ANN201
    from graphpar import data_parallel_model as dpm
    from graphpar import optimizer
    from graphpar.model_helper import ModelHelper

    model = ModelHelper(name=f"multihost_{kind}")
    if bmuf:
        dpm.Parallelize_BMUF(model, lambda m: None, forward(kind, hidden), local_sgd, devices=devices,
                             cpu_device=True, rendezvous=rendezvous, block_learning_rate=0.5, **options)
        return model
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward(kind, hidden),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, lr, momentum=MOMENTUM),
                    devices=devices, cpu_device=True, rendezvous=rendezvous, **options)
    return model


def feed(kind: str, step: int, shard: int, num_shards: int, devices: list[int]) -> None:
    """Shard `shard`'s local devices get global slices shard*D .. shard*D + D - 1 of the batch."""
    from graphpar import workspace

    if kind == "dlrm":  # sparse lookups: every global device gets its examples' indices
        from graphpar.models.dlrm import split_clicks, synthetic_clicks

        chunks = split_clicks(synthetic_clicks(GLOBAL_BATCH, 3, (40, 30), seed=100 + step), len(devices) * num_shards)
        for d, device in enumerate(devices):
            for name, value in chunks[shard * len(devices) + d].items():
                workspace.FeedBlob(f"cpu_{device}/{name}", value)
        return
    x, y = batch(kind, step)
    parts = np.split(np.arange(GLOBAL_BATCH), len(devices) * num_shards)
    for d, device in enumerate(devices):
        rows = parts[shard * len(devices) + d]
        workspace.FeedBlob(f"cpu_{device}/data", x[rows])
        workspace.FeedBlob(f"cpu_{device}/label", y[rows])


def state(model) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Every replica's params and computed params (cpu_<d>/name), and BMUF's global model."""
    from graphpar import workspace

    names = [str(p) for p in model.GetParams()] + [str(p) for p in model.GetComputedParams()]
    names += [f"{p}_{suffix}" for p in model.GetParams() for suffix in ("g", "v")
              if workspace.HasBlob(f"{p}_{suffix}")]
    return {name: workspace.FetchBlob(name) for name in names}


def train(out: str, kind: str, shard: int, num_shards: int, devices: list[int], store: str, steps: int,
          seed: int = 0, die_at: int | None = None, hang_at: int | None = None, timeout_sec: float = 20,
          bmuf: bool = False, reduce_order: str = "ring", save_to: str | None = None, save_after: int | None = None,
          resume_from: str | None = None, nan_at: tuple[int, int] | None = None, **options: Any) -> None:
    """Train `steps` steps; save every replica's state after init and after each step to `out`
    (`<when>/cpu_<d>/<blob>`), or the error raised to `out + ".error"`. Shard processes reach each
    other through a FileStore in directory `store`; `die_at` kills this process before that step,
    `hang_at` makes it sleep there for three timeouts, then exit. `save_to` writes a checkpoint after
    the last step (shard 0 only), or with `save_after`, after that many steps as a PeriodicCheckpointer
    saves (GetCheckpointParams on every shard, checkpoint.save on shard 0) and training goes on;
    `resume_from` loads one after init and continues from its step.
    `nan_at=(step, replica)`: global replica `replica` gets a NaN in its batch at `step`; the error that
    step raises (on any shard) goes to `out + ".step<step>"` and training goes on."""
    import torch

    from graphpar import data_parallel_model as dpm
    from graphpar import workspace

    torch.set_num_threads(1)  # as graphpar.launch: processes share the cores (same results, less contention)
    workspace.ResetWorkspace()
    workspace.SetSeed(seed)
    # every process runs the same nets before the init net (random draws depend on the compile count)
    workspace.RunOperatorOnce(_op("FileStoreHandlerCreate", [], ["store_handler"], path=store))
    rendezvous = None
    if num_shards > 1:
        rendezvous = {"kv_handler": "store_handler", "shard_id": shard, "num_shards": num_shards,
                      "engine": "GLOO", "timeout_sec": timeout_sec, "reduce_order": reduce_order}
    try:
        model = build(kind, devices, rendezvous, bmuf=bmuf, **options)
        feed(kind, 0, shard, num_shards, devices)
        dpm.RunInitNet(model)
        saved = {f"init/{k}": v for k, v in state(model).items()}
        first = 0
        if resume_from is not None:
            from graphpar import checkpoint

            checkpoint.load(resume_from)
            dpm.FinalizeAfterCheckpoint(model)
            first = int(workspace.FetchBlob("optimizer_iteration")[0])
        for step in range(first, steps):
            if die_at is not None and step == die_at:
                os._exit(3)
            if hang_at is not None and step == hang_at:
                time.sleep(3 * timeout_sec)
                os._exit(4)
            feed(kind, step, shard, num_shards, devices)
            if nan_at is not None and step == nan_at[0]:
                _poison(nan_at[1], shard, devices)
            try:
                dpm.RunNet(model, 2 if bmuf else 1)
            except Exception as exc:  # noqa: BLE001 - the NaN step's error is reported, then training goes on
                if nan_at is None or step != nan_at[0]:
                    raise
                with open(f"{out}.step{step}", "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
            saved.update({f"{step}/{k}": v for k, v in state(model).items()})
            if save_to is not None and step + 1 == save_after:
                from graphpar import checkpoint

                names = dpm.GetCheckpointParams(model)  # every shard: a collective with sharded state
                if shard == 0:
                    checkpoint.save(save_to, names)
        if save_to is not None and save_after is None:
            dpm.save_checkpoint(model, save_to)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        with open(out + ".error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        return
    np.savez(out, **saved)


def _poison(replica: int, shard: int, devices: list[int]) -> None:
    """A NaN in the first row of global replica `replica`'s data, if it is one of this shard's."""
    from graphpar import workspace

    if shard * len(devices) <= replica < (shard + 1) * len(devices):
        name = f"cpu_{devices[replica - shard * len(devices)]}/data"
        data = workspace.FetchBlob(name).copy()
        data[0] = np.nan
        workspace.FeedBlob(name, data)


def train_all(out: str, runs: list[dict[str, Any]], **common: Any) -> None:
    """`train` once per entry of `runs` (keyword arguments over `common`), into `out_<k>.npz`: one
    process start amortised over several models."""
    for k, run in enumerate(runs):
        train(f"{out}_{k}.npz", **{**common, **run})


def _op(type_: str, inputs: list[str], outputs: list[str], **args: Any):  # noqa: ANN202
    from graphpar import core

    return core.CreateOperator(type_, inputs, outputs, **args)


_SIGINT_BLOCKED_AT_IMPORT = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # as a process starts


def report_rank(directory: str) -> None:
    """For graphpar.launch: write this process's rank, world size, local rank, the default group's backend
    and its threads, whether SIGINT was blocked when it imported this module and is now, after an
    all-reduce over the default group that every rank must join."""
    import torch
    import torch.distributed as dist

    from graphpar import launch

    total = torch.ones(1)
    dist.all_reduce(total)
    with open(os.path.join(directory, f"rank{launch.get_rank()}"), "w") as f:
        f.write(f"{launch.get_world_size()} {launch.get_local_rank()} {launch.is_main_process()} {int(total)} "
                f"{dist.get_backend()} {torch.get_num_threads()} {_SIGINT_BLOCKED_AT_IMPORT} "
                f"{signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}")


def _gloo_named_otherwise(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """A backend that is gloo under another name: what a process's group reports shows which backend
    `launch` asked for (only gloo runs on a CPU machine)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


TEST_BACKEND = "graphpar_test_gloo"


def register_test_backend() -> None:
    import torch.distributed as dist

    if TEST_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(TEST_BACKEND, _gloo_named_otherwise, devices=["cpu"])


register_test_backend()  # in every process that unpickles a worker of this module


def fail_on_rank_1(directory: str) -> None:
    """For graphpar.launch: rank 1 raises, rank 0 waits for a barrier that never completes."""
    import torch.distributed as dist

    from graphpar import launch

    if launch.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    with open(os.path.join(directory, "pid0"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()


def sync_checks(out: str, shard: int, num_shards: int, store: str) -> None:
    """AddBlobSync, AddDistributedBlobSync, FinalizeAfterCheckpoint and Synchronize across shards; the
    values seen are saved to `out` (or the error to `out + ".error"`)."""
    from graphpar import data_parallel_model as dpm
    from graphpar import workspace

    workspace.ResetWorkspace()
    workspace.RunOperatorOnce(_op("FileStoreHandlerCreate", [], ["store_handler"], path=store))
    rendezvous = {"kv_handler": "store_handler", "shard_id": shard, "num_shards": num_shards, "timeout_sec": 10}
    try:
        model = build("mlp", [0, 1], rendezvous)
        dpm.AddBlobSync(model, ["marker"])
        dpm.AddDistributedBlobSync(model, ["cpu_0/total"])
        feed("mlp", 0, shard, num_shards, [0, 1])
        for d in (0, 1):
            workspace.FeedBlob(f"cpu_{d}/marker", np.array([10.0 * shard + d], dtype=np.float32))
        workspace.FeedBlob("cpu_0/total", np.array([shard + 1.0], dtype=np.float32))
        dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
        saved = {f"marker{d}": workspace.FetchBlob(f"cpu_{d}/marker") for d in (0, 1)}
        saved["total"] = workspace.FetchBlob("cpu_0/total")
        dpm.Synchronize(model, 10)
        dpm.Synchronize(model, 10)
        # a "checkpoint" that differs per shard: FinalizeAfterCheckpoint makes shard 0's first device win
        workspace.FeedBlob("cpu_0/fc1_w", np.full((8, 6), float(shard), dtype=np.float32))
        workspace.FeedBlob("optimizer_iteration", np.array([3 + 2 * shard], dtype=np.int64))  # another run's
        dpm.FinalizeAfterCheckpoint(model)
        saved.update({f"fc1_w{d}": workspace.FetchBlob(f"cpu_{d}/fc1_w") for d in (0, 1)})
        saved["iteration"] = workspace.FetchBlob("optimizer_iteration")
        try:
            dpm.Synchronize(model, 11)
        except Exception as exc:  # noqa: BLE001
            saved["timeout_change"] = np.array(str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        with open(out + ".error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        return
    np.savez(out, **saved)


def late_peer(out: str, shard: int, store: str, timeout_sec: float) -> None:
    """Shard 1 comes to RunInitNet, and then to the first Synchronize, only after shard 0's call timed
    out; shard 0 calls again (issue 23 item 7). Saves the failed calls' errors and the trained params."""
    from graphpar import data_parallel_model as dpm
    from graphpar import workspace

    workspace.ResetWorkspace()
    workspace.RunOperatorOnce(_op("FileStoreHandlerCreate", [], ["store_handler"], path=store))
    rendezvous = {"kv_handler": "store_handler", "shard_id": shard, "num_shards": 2, "timeout_sec": timeout_sec}
    failures: list[str] = []

    def retried(call: Any, phase: int) -> None:
        for _ in range(3):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - the retry is what is tested
                failures.append(f"{type(exc).__name__}: {exc}")
                open(os.path.join(store, f"failed{phase}"), "w").close()
        raise RuntimeError(failures[-1])

    def after_failure(phase: int) -> None:
        deadline = time.monotonic() + 10 * timeout_sec
        while not os.path.exists(os.path.join(store, f"failed{phase}")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # well inside shard 0's second call

    try:
        model = build("mlp", [0], rendezvous)
        feed("mlp", 0, shard, 2, [0])
        if shard == 1:
            after_failure(1)
        retried(lambda: dpm.RunInitNet(model), 1)
        dpm.RunNet(model, 1)
        if shard == 1:
            after_failure(2)
        retried(lambda: dpm.Synchronize(model, timeout_sec), 2)
        saved = {"failures": np.array(failures), **state(model)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        with open(out + ".error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        return
    np.savez(out, **saved)


def env_rendezvous_alone(out: str, port: int, timeout_sec: float) -> None:
    """Rank 0 of 2 through env:// (kv_handler=None) with rank 1 never started: RunInitNet must raise
    within the rendezvous' timeout (issue 23 item 3). Writes the seconds it took and the error."""
    os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from graphpar import data_parallel_model as dpm

    model = build("mlp", [0], {"kv_handler": None, "timeout_sec": timeout_sec})
    feed("mlp", 0, 0, 2, [0])
    start = time.monotonic()
    try:
        dpm.RunInitNet(model)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        message = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{message}")
