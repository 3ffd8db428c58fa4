"""Caffe2's `resnet50_trainer.py` on graphpar: data-parallel ResNet training with Caffe2's flags.

    python -m graphpar.examples.resnet50_trainer --use_cpu --num_gpus 2 --batch_size 8 \
        --image_size 64 --num_labels 10 --epoch_size 64 --num_epochs 2

Without `--train_data` it trains on synthetic images (seeded per epoch and step, so a resumed run
sees the same batches as an uninterrupted one). The model, optimizer and schedule are Caffe2's:
ResNet-50 (or 18, `--num_layers`), SGD with Nesterov momentum 0.9, weight decay on the weights, the
learning rate scaled by the global batch / 256 and x0.1 every 30 epochs. A checkpoint
`<save_model_name>_<epoch>.safetensors` (default name `resnet<num_layers>_model`) is written after
every epoch; `--load_model_path` resumes from one. Caffe2's flags for LMDB input and multi-host
rendezvous are accepted and refused with a message when set; `--width` (the stem's channels, 64 in
ResNet-50) is graphpar's, for tiny test runs.

Precision (docs/precision.md): `--dtype float16` is Caffe2's recipe: float16 Conv/FC params made by
`PseudoFP16Initializer` with float32 masters updated by `build_multi_precision_sgd` (`build_fp16_sgd`
with `--float16_compute`, which brew passes to Conv/FC), the loss and batch-norm statistics in fp32
(`Parallelize(compute_dtype="float16")` places the casts) and a dynamic loss scale (`--loss_scale S`
for a static one). `--dtype bfloat16` keeps fp32 params and computes Conv/FC in bf16.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphpar.examples import cli

if __name__ == "__main__":
    cli.exit_on_interrupt()  # a Ctrl-C while torch loads: exit at once, status 130

import numpy as np  # noqa: E402

from graphpar.model import brew, model_helper, optimizer  # noqa: E402
from graphpar.models import resnet  # noqa: E402
from graphpar.parallel import data_parallel_model as dpm  # noqa: E402
from graphpar.platform.devices import num_cuda_devices  # noqa: E402
from graphpar.runtime import checkpoint, workspace  # noqa: E402
from graphpar.training.data import feed_batch  # noqa: E402

log = cli.log


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Caffe2's trainer flags (names and defaults), plus `--width`."""
    parser = cli.parser("graphpar.examples.resnet50_trainer", __doc__)
    add = parser.add_argument
    add("--train_data", default=None, help="training data; only synthetic data (omit the flag) is supported")
    add("--test_data", default=None, help="test data; not supported (no evaluation pass)")
    add("--db_type", default="lmdb", help="Caffe2's database type (unused: synthetic data)")
    add("--gpus", default=None, help="comma-separated device ids, e.g. 0,1,2")
    add("--num_gpus", type=int, default=1, help="number of devices if --gpus is not given")
    add("--num_channels", type=int, default=3)
    add("--image_size", type=int, default=224)
    add("--num_labels", type=int, default=1000)
    add("--batch_size", type=int, default=32, help="global batch, split over the devices")
    add("--epoch_size", type=int, default=1500000, help="images per epoch")
    add("--num_epochs", type=int, default=1000)
    add("--num_shards", type=int, default=1, help="hosts; only 1 (single-host) is supported")
    add("--shard_id", type=int, default=0)
    add("--run_id", default="")
    add("--base_learning_rate", type=float, default=0.1,
        help="SGD learning rate per 256 images (scaled by --batch_size / 256)")
    add("--weight_decay", type=float, default=1e-4)
    add("--num_layers", type=int, default=50, choices=(18, 50))
    add("--width", type=int, default=64, help="graphpar: channels of the stem (64 = ResNet-50)")
    add("--use_cpu", action="store_true", help="CPU devices instead of GPUs")
    add("--use_nccl", action="store_true", help="all-reduce with NCCL (GPUs)")
    add("--save_model_name", default=None, help="checkpoint name prefix (default: resnet<num_layers>_model)")
    add("--load_model_path", default=None, help="a checkpoint to resume from")
    add("--dtype", default="float", choices=("float", "float16", "bfloat16"),
        help="float16: Caffe2's fp16 params with fp32 masters; bfloat16 (graphpar): bf16 compute, fp32 params")
    add("--float16_compute", action="store_true", help="with --dtype float16: Conv/FC compute in float16")
    add("--loss_scale", type=float, default=None,
        help="graphpar, with --dtype float16: a static loss scale (default: dynamic, as torch.amp.GradScaler)")
    add("--enable_tensor_core", action="store_true", help="accepted; PyTorch chooses the math mode")
    add("--cudnn_workspace_limit_mb", type=int, default=64, help="accepted; PyTorch manages cuDNN")
    add("--seed", type=int, default=0, help="graphpar: seed of the synthetic data and the init")
    add("--verbose", action="store_true", help="graphpar: log what Parallelize built; show an error's traceback")
    args = parser.parse_args(argv)
    if args.save_model_name is None:
        args.save_model_name = f"resnet{args.num_layers}_model"
    refused = [flag for flag, used in (("--train_data", args.train_data), ("--test_data", args.test_data),
                                       ("--num_shards > 1", args.num_shards > 1)) if used]
    if refused:
        parser.error(f"not supported by graphpar's trainer: {', '.join(refused)} (synthetic data, one host)")
    if args.float16_compute and args.dtype != "float16":
        parser.error("--float16_compute needs --dtype float16 (float16 params and data)")
    if args.loss_scale is not None and (args.dtype != "float16" or not args.loss_scale > 0):
        parser.error(f"--loss_scale needs --dtype float16 and a value > 0, got {args.loss_scale}")
    return args


def devices_of(args: argparse.Namespace) -> tuple[list[int], bool]:
    """The device ids and whether they are CPU devices (no GPU: CPU devices, as --use_cpu)."""
    cpu = args.use_cpu or num_cuda_devices() == 0
    if args.gpus:
        return [int(g) for g in args.gpus.split(",")], cpu
    return list(range(args.num_gpus)), cpu


def build(args: argparse.Namespace, devices: list[int], cpu: bool, epoch_iters: int) -> model_helper.ModelHelper:
    """Caffe2's training model: ResNet, weight decay, Nesterov SGD with a step schedule."""
    model = model_helper.ModelHelper(name="resnet", arg_scope={"order": "NCHW"})
    net = resnet.resnet50 if args.num_layers == 50 else resnet.resnet18

    fp16 = args.dtype == "float16"
    initializer = model_helper.PseudoFP16Initializer if fp16 else None
    fp16_args = {"float16_compute": True} if args.float16_compute else {}

    def forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
        with brew.arg_scope([brew.conv, brew.fc], WeightInitializer=initializer, BiasInitializer=initializer,
                            **fp16_args):
            return net(model, loss_scale, num_classes=args.num_labels, in_channels=args.num_channels,
                       width=args.width)

    def add_optimizer(model: model_helper.ModelHelper) -> optimizer.Optimizer:
        schedule = {"base_learning_rate": args.base_learning_rate * args.batch_size / 256, "policy": "step",
                    "stepsize": 30 * epoch_iters, "gamma": 0.1, "momentum": 0.9, "nesterov": True}
        if args.float16_compute:  # Caffe2's choice: the fp16 optimizer applies the weight decay itself
            return optimizer.build_fp16_sgd(model, weight_decay=args.weight_decay, **schedule)
        optimizer.add_weight_decay(model, args.weight_decay)
        return (optimizer.build_multi_precision_sgd if fp16 else optimizer.build_sgd)(model, **schedule)

    precision: dict[str, Any] = {"float": {}, "bfloat16": {"compute_dtype": "bfloat16"},
                 "float16": {"compute_dtype": "float16", "loss_scale": args.loss_scale or "dynamic"}}[args.dtype]
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=add_optimizer, devices=devices, cpu_device=cpu,
                    use_nccl=args.use_nccl and not cpu, optimize_gradient_memory=False, **precision)
    return model


def synthetic_batch(args: argparse.Namespace, epoch: int, step: int) -> dict[str, np.ndarray]:
    """Images N(0, 1) and uniform labels, seeded by (seed, epoch, step)."""
    rng = np.random.default_rng([args.seed, epoch, step])
    shape = (args.batch_size, args.num_channels, args.image_size, args.image_size)
    return {"data": rng.standard_normal(shape, dtype=np.float32),
            "label": rng.integers(0, args.num_labels, args.batch_size).astype(np.int32)}


def checkpoint_path(args: argparse.Namespace, epoch: int) -> Path:
    """Where the checkpoint after `epoch` (1-based) goes."""
    return Path(f"{args.save_model_name}_{epoch}.safetensors")


def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status (1 after an error, said in one line; 130 after Ctrl-C)."""
    return cli.guard(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    cli.setup_logger(args.verbose)
    devices, cpu = devices_of(args)
    if args.batch_size % len(devices):
        raise SystemExit(f"--batch_size {args.batch_size} must be divisible by the {len(devices)} devices")
    epoch_iters = max(1, args.epoch_size // args.batch_size)
    workspace.ResetWorkspace()
    workspace.SetSeed(args.seed)
    model = build(args, devices, cpu, epoch_iters)
    feed_batch(model, synthetic_batch(args, 0, 0))
    dpm.RunInitNet(model)
    start_epoch = 0
    if args.load_model_path:
        start_epoch = int(checkpoint.read_metadata(args.load_model_path)["metadata"].get("epoch", 0))
        checkpoint.load(args.load_model_path, model=model)  # onto this run's first device
        dpm.FinalizeAfterCheckpoint(model)
        log.info("resumed from %s after epoch %d", args.load_model_path, start_epoch)
    prefix = model._device_prefix
    log.info("training ResNet-%d on %d %s devices, %d images per step, %d steps per epoch", args.num_layers,
             len(devices), "CPU" if cpu else "CUDA", args.batch_size, epoch_iters)
    for epoch in range(start_epoch, args.num_epochs):
        start, losses = time.perf_counter(), []
        for step in range(epoch_iters):
            feed_batch(model, synthetic_batch(args, epoch, step))
            dpm.RunNet(model, 1)
            if workspace.HasBlob(f"{prefix}_{devices[0]}/loss"):  # not before a first step that was not skipped
                losses.append(np.mean([float(workspace.FetchBlob(f"{prefix}_{d}/loss")) for d in devices]))
        images_per_s = epoch_iters * args.batch_size / (time.perf_counter() - start)
        path = checkpoint_path(args, epoch + 1)
        checkpoint.save(path, dpm.GetCheckpointParams(model), metadata={"epoch": epoch + 1})
        log.info("epoch %d/%d: loss %.4f, %.1f images/s, checkpoint %s", epoch + 1, args.num_epochs,
                 float(np.mean(losses)) if losses else float("nan"), images_per_s, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
