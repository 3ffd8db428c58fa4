"""Caffe2's `resnet50_trainer.py` on graphpar: data-parallel ResNet training with Caffe2's flags.

    python -m graphpar.examples.resnet50_trainer --use_cpu --num_gpus 2 --batch_size 8 \
        --image_size 64 --num_labels 10 --epoch_size 64 --num_epochs 2

Without `--train_data` it trains on synthetic images (seeded per epoch and step, so a resumed run
sees the same batches as an uninterrupted one). The model, optimizer and schedule are Caffe2's:
ResNet-50 (or 18, `--num_layers`), SGD with Nesterov momentum 0.9, weight decay on the weights, the
learning rate scaled by the global batch / 256 and x0.1 every 30 epochs. A checkpoint
`<save_model_name>_<epoch>.safetensors` (default name `resnet<num_layers>_model`) is written after
every epoch, and only the last `--keep_checkpoints` of them are kept; `--load_model_path` resumes from
one, and a process the launcher's agent restarted (`python -m graphpar.launch --max-restarts N`)
resumes from the last one its job wrote. A checkpoint this run would write that exists already is
never replaced silently: resume from it, start over with `--overwrite`, or pass another
`--save_model_name`. Every value is checked at start (an error is one line naming the option); a
progress bar shows the steps of each epoch, with the loss and an ETA. Caffe2's flags for LMDB input and multi-host rendezvous are accepted and refused with a message
when set; `--width` (the stem's channels, 64 in ResNet-50) is graphpar's, for tiny test runs.

Precision (docs/precision.md): `--dtype float16` is Caffe2's recipe: float16 Conv/FC params made by
`PseudoFP16Initializer` with float32 masters updated by `build_multi_precision_sgd` (`build_fp16_sgd`
with `--float16_compute`, which brew passes to Conv/FC), the loss and batch-norm statistics in fp32
(`Parallelize(compute_dtype="float16")` places the casts) and a dynamic loss scale (`--loss_scale S`
for a static one). `--dtype bfloat16` keeps fp32 params and computes Conv/FC in bf16.
"""

from __future__ import annotations

from graphpar.examples import interrupt

if __name__ == "__main__":
    interrupt.exit_on_interrupt()  # from now on a Ctrl-C exits at once, status 130

import argparse  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from graphpar.core.naming import COMPILE_MODES  # noqa: E402
from graphpar.examples import cli  # noqa: E402


def device_ids(text: str) -> list[int]:
    """An argparse `type` for --gpus: distinct device ids >= 0, comma-separated."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = [-1]
    if min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"must be distinct device ids >= 0 separated by commas, e.g. 0,1,2; "
                                         f"got {text!r}")
    return ids


def existing_file(text: str) -> str:
    """An argparse `type` for --load_model_path: a file that exists."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no checkpoint file at {text!r}")
    return text


def make_parser() -> cli.ArgumentParser:
    """Caffe2's trainer flags (names and defaults), plus graphpar's; each value checked as it is parsed."""
    parser = cli.parser("graphpar.examples.resnet50_trainer", __doc__)
    add = parser.add_argument
    add("--train_data", default=None, help="training data; only synthetic data (omit the flag) is supported")
    add("--test_data", default=None, help="test data; not supported (no evaluation pass)")
    add("--db_type", default="lmdb", help="Caffe2's database type (unused: synthetic data)")
    add("--gpus", type=device_ids, default=None, help="comma-separated device ids, e.g. 0,1,2")
    add("--num_gpus", type=cli.integer(1), default=1, help="number of devices if --gpus is not given")
    add("--num_channels", type=cli.integer(1), default=3)
    add("--image_size", type=cli.integer(1), default=224)
    add("--num_labels", type=cli.integer(1), default=1000)
    add("--batch_size", type=cli.integer(1), default=32, help="global batch, split over the devices")
    add("--epoch_size", type=cli.integer(1), default=1500000,
        help="images per epoch (at least --batch_size: an epoch is epoch_size // batch_size steps)")
    add("--num_epochs", type=cli.integer(1), default=1000)
    add("--num_shards", type=cli.integer(1), default=1, help="hosts; only 1 (single-host) is supported")
    add("--shard_id", type=cli.integer(0), default=0)
    add("--run_id", default="")
    add("--base_learning_rate", type=cli.number(0.0), default=0.1,
        help="SGD learning rate per 256 images (scaled by --batch_size / 256)")
    add("--weight_decay", type=cli.number(0.0, inclusive=True), default=1e-4)
    add("--num_layers", type=int, default=50, choices=(18, 50))
    add("--width", type=cli.integer(1), default=64, help="graphpar: channels of the stem (64 = ResNet-50)")
    add("--use_cpu", action="store_true", help="CPU devices instead of GPUs")
    add("--use_nccl", action="store_true", help="all-reduce with NCCL (GPUs)")
    add("--save_model_name", default=None, help="checkpoint name prefix (default: resnet<num_layers>_model)")
    add("--load_model_path", type=existing_file, default=None, help="a checkpoint to resume from")
    add("--keep_checkpoints", type=cli.integer(0), default=3,
        help="graphpar: keep the last K epochs' checkpoints of --save_model_name, deleting older ones (0: keep all)")
    add("--overwrite", action="store_true",
        help="graphpar: start over, replacing the checkpoints of --save_model_name this run would write")
    add("--dtype", default="float", choices=("float", "float16", "bfloat16"),
        help="float16: Caffe2's fp16 params with fp32 masters; bfloat16 (graphpar): bf16 compute, fp32 params")
    add("--float16_compute", action="store_true", help="with --dtype float16: Conv/FC compute in float16")
    add("--loss_scale", type=cli.number(0.0), default=None,
        help="graphpar, with --dtype float16: a static loss scale (default: dynamic, as torch.amp.GradScaler)")
    add("--enable_tensor_core", action="store_true", help="accepted; PyTorch chooses the math mode")
    add("--cudnn_workspace_limit_mb", type=cli.integer(0), default=64, help="accepted; PyTorch manages cuDNN")
    add("--seed", type=cli.integer(0), default=0, help="graphpar: seed of the synthetic data and the init")
    add("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES, metavar="MODE",
        help="graphpar: compile the train step with torch.compile (inductor; the first steps pay the compile "
             "time); MODE: one of " + ", ".join(COMPILE_MODES))
    add("--verbose", action="store_true", help="graphpar: log what Parallelize built; show an error's traceback")
    return parser


if __name__ == "__main__":
    make_parser().parse_args()  # --help and a malformed value answer before torch loads (main parses again)

import numpy as np  # noqa: E402

from graphpar.errors import CheckpointError  # noqa: E402
from graphpar.model import brew, model_helper, optimizer  # noqa: E402
from graphpar.models import resnet  # noqa: E402
from graphpar.parallel import data_parallel_model as dpm  # noqa: E402
from graphpar.parallel import elastic  # noqa: E402
from graphpar.platform.devices import num_cuda_devices  # noqa: E402
from graphpar.runtime import checkpoint, workspace  # noqa: E402
from graphpar.training.data import feed_batch  # noqa: E402

log = cli.log


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, every one checked before anything runs: an error names the option (exit status 2).
    Sets `devices`, `cpu`, `epoch_iters` and `start_epoch` from them."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.save_model_name is None:
        args.save_model_name = f"resnet{args.num_layers}_model"
    refused = [flag for flag, used in (("--train_data", args.train_data), ("--test_data", args.test_data),
                                       ("--num_shards > 1", args.num_shards > 1)) if used]
    if refused:
        parser.error(f"not supported by graphpar's trainer: {', '.join(refused)} (synthetic data, one host)")
    if args.shard_id >= args.num_shards:
        parser.error(f"argument --shard_id: must be below --num_shards {args.num_shards}, got {args.shard_id}")
    if args.float16_compute and args.dtype != "float16":
        parser.error("--float16_compute needs --dtype float16 (float16 params and data)")
    if args.loss_scale is not None and args.dtype != "float16":
        parser.error(f"--loss_scale needs --dtype float16, got --dtype {args.dtype}")
    args.devices, args.cpu = devices_of(args)
    if not args.cpu and max(args.devices) >= num_cuda_devices():
        parser.error(f"--gpus/--num_gpus: device {max(args.devices)} does not exist ({num_cuda_devices()} GPU(s) "
                     f"visible); use fewer, or --use_cpu")
    if args.batch_size % len(args.devices):
        parser.error(f"argument --batch_size: must be a multiple of the {len(args.devices)} devices (every device gets "
                     f"the same share), got {args.batch_size}")
    if args.epoch_size < args.batch_size:
        parser.error(f"argument --epoch_size: must be at least --batch_size {args.batch_size} (an epoch is "
                     f"epoch_size // batch_size steps), got {args.epoch_size}")
    args.epoch_iters = args.epoch_size // args.batch_size
    try:
        cli.file_path(str(checkpoint_path(args, 1)))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --save_model_name: {exc}")
    restarted = restart_checkpoint(args)
    if restarted is not None:  # the launcher's agent restarted this job: it continues from there
        args.load_model_path = str(restarted)
    args.start_epoch = 0
    if args.load_model_path:
        try:
            metadata = checkpoint.read_metadata(args.load_model_path)
        except CheckpointError as exc:
            parser.error(f"argument --load_model_path: {cli.one_line(exc)}")
        args.start_epoch = int(metadata.get("metadata", {}).get("epoch", 0))
        if args.start_epoch >= args.num_epochs:
            parser.error(f"--num_epochs {args.num_epochs}: {args.load_model_path} is at epoch {args.start_epoch} "
                         f"already; pass a larger --num_epochs to train longer")
    taken = [(epoch, path) for epoch, path in saved_checkpoints(args.save_model_name) if epoch > args.start_epoch]
    if taken and not args.overwrite:
        last = saved_checkpoints(args.save_model_name)[-1][1]
        parser.error(f"{taken[0][1]} exists: this run would replace it. Resume with --load_model_path {last}, start "
                     f"over with --overwrite (replaces the checkpoints it would write), or pass another "
                     f"--save_model_name")
    return args


def devices_of(args: argparse.Namespace) -> tuple[list[int], bool]:
    """The device ids and whether they are CPU devices (no GPU: CPU devices, as --use_cpu)."""
    cpu = args.use_cpu or num_cuda_devices() == 0
    return (list(args.gpus) if args.gpus else list(range(args.num_gpus))), cpu


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
                    use_nccl=args.use_nccl and not cpu, optimize_gradient_memory=False, **precision,
                    compile=None if args.compile is None else {"mode": None if args.compile == "default" else args.compile})
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


def saved_checkpoints(save_model_name: str) -> list[tuple[int, Path]]:
    """(epoch, path) of the checkpoints named `<save_model_name>_<epoch>.safetensors` that exist, by epoch."""
    where = Path(save_model_name)
    pattern = re.compile(re.escape(where.name) + r"_(\d+)\.safetensors")
    found = [(int(match.group(1)), path) for path in (where.parent.iterdir() if where.parent.is_dir() else ())
             if (match := pattern.fullmatch(path.name))]
    return sorted(found)


def restart_checkpoint(args: argparse.Namespace) -> Path | None:
    """In a process the launcher's agent restarted: the last checkpoint of --save_model_name this job wrote,
    where the run continues (`--load_model_path` named where the job began); else None."""
    if not elastic.restart_count():
        return None
    return elastic.last_of_this_job(path for _, path in saved_checkpoints(args.save_model_name))


def prune(args: argparse.Namespace, epoch: int) -> None:
    """Delete the checkpoints of --save_model_name older than the last --keep_checkpoints, up to `epoch`."""
    if args.keep_checkpoints:
        for old, path in saved_checkpoints(args.save_model_name):
            if old <= epoch - args.keep_checkpoints:
                path.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status (1 after an error, said in one line; 130 after Ctrl-C)."""
    return cli.guard(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    cli.setup_logger(args.verbose)
    devices, cpu = args.devices, args.cpu
    if cpu and not args.use_cpu:
        log.warning("no GPU found: training on %d CPU devices (slow at ImageNet sizes; the --help example "
                    "runs in seconds)", len(devices))
    if args.overwrite:  # start over: the checkpoints this run writes replace the old ones, none is left behind
        for epoch, path in saved_checkpoints(args.save_model_name):
            if epoch > args.start_epoch:
                path.unlink()
    Path(args.save_model_name).parent.mkdir(parents=True, exist_ok=True)
    workspace.ResetWorkspace()
    workspace.SetSeed(args.seed)
    model = build(args, devices, cpu, args.epoch_iters)
    feed_batch(model, synthetic_batch(args, 0, 0))
    dpm.RunInitNet(model)
    if args.load_model_path:
        checkpoint.load(args.load_model_path, model=model)  # onto this run's first device
        dpm.FinalizeAfterCheckpoint(model)
        again = f" (restart {elastic.restart_count()} of this job)" if elastic.restart_count() else ""
        log.info("resumed from %s after epoch %d%s", args.load_model_path, args.start_epoch, again)
    prefix = model._device_prefix
    log.info("training ResNet-%d on %d %s devices, %d images per step, %d steps per epoch", args.num_layers,
             len(devices), "CPU" if cpu else "CUDA", args.batch_size, args.epoch_iters)
    bar = cli.progress_bar()
    for epoch in range(args.start_epoch, args.num_epochs):
        start, losses = time.perf_counter(), []
        progress = bar(args.epoch_iters, f"epoch {epoch + 1}/{args.num_epochs}")
        try:
            for step in range(args.epoch_iters):
                feed_batch(model, synthetic_batch(args, epoch, step))
                dpm.RunNet(model, 1)
                if workspace.HasBlob(f"{prefix}_{devices[0]}/loss"):  # not before a first step that was not skipped
                    losses.append(np.mean([float(workspace.FetchBlob(f"{prefix}_{d}/loss")) for d in devices]))
                    progress.set_postfix_str(f"loss {losses[-1]:.4f}")
                progress.update()
        finally:
            progress.close()
        images_per_s = args.epoch_iters * args.batch_size / (time.perf_counter() - start)
        path = checkpoint_path(args, epoch + 1)
        checkpoint.save(path, dpm.GetCheckpointParams(model), metadata={"epoch": epoch + 1, **elastic.job_metadata()})
        prune(args, epoch + 1)
        # a step the loss scale skipped computed no loss that is kept (its run wrote nothing back)
        loss = f"loss {np.mean(losses):.4f}" if losses else \
            f"no step trained yet ({dpm.skipped_steps(model)} skipped while the loss scale backs off)"
        log.info("epoch %d/%d: %s, %.1f images/s, checkpoint %s", epoch + 1, args.num_epochs, loss, images_per_s,
                 path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
