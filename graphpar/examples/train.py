"""The main job: train a small CNN data-parallel on scikit-learn's handwritten digits.

    python -m graphpar.examples.train                 # 4 CPU devices (all GPUs when present)
    python -m graphpar.examples.train --resume        # continue from the checkpoint it wrote
    python -m graphpar.examples.train --num-processes 2 --devices 2   # 2 processes x 2 devices, gloo
    python -m graphpar.launch --nproc-per-node 2 -m graphpar.examples.train --devices 2   # the same
    python -m graphpar.examples.train --num-processes 2   # on 2 GPUs: one GPU per process, NCCL

The 1,797 8x8 digit images ship inside scikit-learn, so nothing is downloaded. Each step feeds one
global batch split evenly over the devices; gradients are all-reduced, so N devices train exactly
like one device on the whole batch. After every epoch it prints the mean loss and the test accuracy
(over 95% after the default 12 epochs, on every test sample) and writes a checkpoint that
`--resume` continues from, learning-rate schedule included, and `metrics.json` beside it (with
`--plot`, a loss/accuracy PNG beside them at the end). An existing checkpoint is never replaced
silently: continue it with `--resume`, or start over with `--overwrite`; a process that
`python -m graphpar.launch --max-restarts N` restarted continues the checkpoint its job wrote, with
the same command line. Batches are loaded on a background thread (`DeviceFeeder`) while the devices
compute; the loop is `graphpar.engine.Trainer` with hooks. Ctrl-C stops cleanly (exit status 130), keeping the last checkpoint; an error is one line
(`--verbose`: with its traceback).
"""

from __future__ import annotations

from graphpar.examples import interrupt

if __name__ in ("__main__", "__mp_main__"):  # run as a command, or a process --num-processes started
    interrupt.exit_on_interrupt(quiet=__name__ == "__mp_main__")  # from now on a Ctrl-C exits at once, 130

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from graphpar.core.naming import COMPILE_MODES  # noqa: E402
from graphpar.examples import cli  # noqa: E402


def make_parser() -> cli.ArgumentParser:
    """The options, each value checked as it is parsed (no torch needed: `--help` answers at once)."""
    parser = cli.parser("graphpar.examples.train", __doc__)
    parser.add_argument("--devices", type=cli.integer(1), default=None,
                        help="devices per process (default: this machine's GPUs shared out over its processes, "
                             "else 4 CPU devices)")
    parser.add_argument("--cpu", action="store_true", help="use CPU devices even when GPUs are present")
    parser.add_argument("--epochs", type=cli.integer(1), default=12,
                        help="epochs in all (a resumed run continues to it)")
    parser.add_argument("--batch-size", type=cli.integer(1), default=64, help="global batch, split over the devices")
    parser.add_argument("--lr", type=cli.number(0.0), default=0.05,
                        help="base learning rate of Nesterov SGD (momentum 0.9, weight decay 1e-4), for the global batch")
    parser.add_argument("--lr-step-epochs", type=cli.integer(1), default=8, help="decay the LR x0.1 every N epochs")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype: bfloat16 runs Conv/FC in bf16 with fp32 master params (docs/precision.md)")
    parser.add_argument("--checkpoint", type=cli.file_path, default=Path("graphpar_digits.safetensors"),
                        help="checkpoint file, written every epoch; metrics.json goes beside it")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over, replacing an existing --checkpoint and its metrics.json")
    parser.add_argument("--plot", action="store_true",
                        help="at the end, draw loss and test accuracy per epoch into training.png beside "
                             "--checkpoint (needs matplotlib: pip install 'graphpar[examples]')")
    parser.add_argument("--seed", type=cli.integer(0), default=0,
                        help="seed of the init, the split and the batch order")
    finite = parser.add_mutually_exclusive_group()
    finite.add_argument("--finite-check", dest="finite_check", action="store_const", const=True, default=None,
                        help="check each step's loss before its update (Parallelize's check_finite_loss): the "
                             "default on CPU devices; on CUDA devices it costs a host sync per device and step "
                             "and rules out CUDA graphs")
    finite.add_argument("--no-finite-check", dest="finite_check", action="store_const", const=False,
                        help="do not check each step's loss before its update. A NaN or inf loss still stops "
                             "the run, when the trainer records the loss: after that step's update (the "
                             "checkpoint of the last finished epoch is kept)")
    parser.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                        metavar="MODE", help="compile the train step with torch.compile (inductor; the first "
                        "epoch pays the compile time); MODE: one of " + ", ".join(COMPILE_MODES))
    parser.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)  # tests: aot_eager
    parser.add_argument("--verbose", action="store_true",
                        help="log what Parallelize built and each init/sync; show the traceback of an error")
    parser.add_argument("--num-processes", type=cli.integer(1), default=1,
                        help="processes (shards) on this machine, each with --devices devices (gloo)")
    return parser


if __name__ == "__main__":
    make_parser().parse_args()  # --help and a malformed value answer before torch loads (main parses again)

import numpy as np  # noqa: E402

from graphpar.model import brew, model_helper, optimizer  # noqa: E402
from graphpar.parallel import comm, elastic, launch  # noqa: E402
from graphpar.parallel import data_parallel_model as dpm  # noqa: E402
from graphpar.platform.devices import num_cuda_devices  # noqa: E402
from graphpar.runtime import checkpoint, workspace  # noqa: E402
from graphpar.training.data import ArrayLoader, DeviceFeeder, feed, gather  # noqa: E402
from graphpar.training.engine import HookBase, IterationTimer, LRScheduler, PeriodicWriter, Trainer  # noqa: E402

log = cli.log


def load_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 NCHW images in [0, 1] and int32 labels, split 80/20 with a fixed seed."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:  # pragma: no cover - depends on the install
        sys.exit("the example needs scikit-learn: pip install 'graphpar[examples]'")
    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(0.8 * len(labels))
    return images[order[:cut]], labels[order[:cut]], images[order[cut:]], labels[order[cut:]]


def add_cnn(model: model_helper.ModelHelper, loss_scale: float) -> list:
    """conv(1->16) relu pool, conv(16->32) relu pool, fc(128->10), softmax loss. The loss returned,
    `loss`, is the replica's cross-entropy times `loss_scale`: summed over the replicas (as the
    trainer records it), the mean cross-entropy of the global batch."""
    h = brew.conv(model, "data", "conv1", dim_in=1, dim_out=16, kernel=3, pad=1)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool1", kernel=2, stride=2)
    h = brew.conv(model, h, "conv2", dim_in=16, dim_out=32, kernel=3, pad=1)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool2", kernel=2, stride=2)
    pred = brew.fc(model, h, "pred", dim_in=32 * 2 * 2, dim_out=10)
    softmax, xent = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "xent"])
    return [model.net.Scale(xent, "loss", scale=loss_scale)]


def build(devices: list[int], cpu: bool, lr: float, lr_step: int, check_finite_loss: bool | None = None,
          rendezvous: dict | None = None, compute_dtype: str | None = None, compile_: dict | None = None):
    """The training model (Nesterov SGD, LR x0.1 every `lr_step` steps; across processes with a
    `rendezvous`) and a forward-only test model that shares its params (any test-set size: chunks may
    differ by one row). With `check_finite_loss` a NaN or infinite loss stops the step before it
    updates anything (RunNet raises, naming the loss); None: Parallelize's default (on for CPU
    replicas; off on CUDA, where it costs a host read per device and step and rules out CUDA graphs).
    `compute_dtype="bfloat16"` trains and tests in mixed precision (docs/precision.md). `compile_`
    compiles the train step (Parallelize's `compile`)."""
    train = model_helper.ModelHelper(name="digits_train")
    dpm.Parallelize(
        train, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
        optimizer_builder_fun=lambda m: optimizer.build_sgd(
            m, base_learning_rate=lr, policy="step", stepsize=lr_step,
            gamma=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        devices=devices, cpu_device=cpu, check_finite_loss=check_finite_loss, rendezvous=rendezvous,
        compute_dtype=compute_dtype, compile=compile_)
    test = model_helper.ModelHelper(name="digits_test", init_params=False)
    dpm.Parallelize(test, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
                    devices=devices, cpu_device=cpu, uneven_batches=True, compute_dtype=compute_dtype)
    return train, test


def compile_options(args: argparse.Namespace) -> dict | None:
    """Parallelize's `compile` from --compile [MODE] and the backend (None: not compiled)."""
    if args.compile is None:
        return None
    mode = None if args.compile == "default" or args.compile_backend != "inductor" else args.compile
    return {"backend": args.compile_backend, "mode": mode}


def evaluate(test: model_helper.ModelHelper, images: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy of the test net on every test sample."""
    feed(test, {"data": images, "label": labels})
    dpm.RunNet(test, 1)
    return float((gather(test, "softmax").argmax(axis=1) == labels).mean())


def parse_args(argv: Sequence[str] | None, train_size: int = int(0.8 * 1797)) -> argparse.Namespace:
    """The options, checked: each error names the option and what it accepts (exit status 2)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if elastic.restart_count() and elastic.written_by_this_job(args.checkpoint):
        args.resume, args.overwrite = True, False  # the launcher's agent restarted this job: continue it
    shards = max(args.num_processes, launch.get_world_size())
    args.cpu = args.cpu or num_cuda_devices() == 0
    available = None if args.cpu else num_cuda_devices()
    per_machine = args.num_processes if launch.get_world_size() == 1 else comm.get_local_size()
    if args.devices is None:  # GPUs: this machine's shared out, one per process with --num-processes K on K
        args.devices = 4 if available is None else max(1, available // per_machine)  # None: on the CPU
    if available is not None:
        try:
            comm.local_devices(args.devices, 0, per_machine, available)
        except ValueError as exc:
            parser.error(f"--devices {args.devices} x {per_machine} processes: {exc} (or pass --cpu)")
    if args.batch_size > train_size:
        parser.error(f"argument --batch-size: must be at most the {train_size} training samples, got "
                     f"{args.batch_size}")
    if args.batch_size % (args.devices * shards):
        every = args.devices * shards
        what = f"--devices {args.devices}" + (f" x {shards} processes" if shards > 1 else "")
        parser.error(f"--batch-size {args.batch_size} must be a multiple of {what} (every device gets the same "
                     f"share), e.g. {max(every, args.batch_size // every * every)}")
    if args.resume and not args.checkpoint.exists():
        parser.error(f"--resume: there is no checkpoint at {args.checkpoint} (train once without --resume, or "
                     f"pass --checkpoint)")
    if args.resume and args.overwrite:
        parser.error("--resume continues the checkpoint and --overwrite replaces it: pass one of them")
    if args.checkpoint.exists() and not (args.resume or args.overwrite):
        parser.error(f"{args.checkpoint} exists ({_progress(args.checkpoint)}): continue it with --resume, start "
                     f"over with --overwrite (replaces it and its metrics.json), or pass another --checkpoint")
    if args.resume:
        saved = checkpoint.read_metadata(args.checkpoint).get("metadata", {}).get("batch_size")
        if saved is not None and int(saved) != args.batch_size:
            parser.error(f"--batch-size {args.batch_size}: {args.checkpoint} was trained with --batch-size {saved}, "
                         f"and its iterations, epochs and LR schedule count batches of that size; resume with "
                         f"--batch-size {saved} (or start over with --overwrite)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'graphpar[examples]' (or pip install matplotlib)")
    return args


def _progress(path: Path) -> str:
    """'epoch N' of a checkpoint this job wrote, else its iteration (or 'unreadable')."""
    try:
        found = checkpoint.read_metadata(path)
    except Exception:  # noqa: BLE001 - only a description for the message
        return "unreadable"
    epoch = found.get("metadata", {}).get("epoch")
    return f"epoch {epoch}" if epoch is not None else f"iteration {found['iteration']}"


def _kept(path: Path) -> str:
    """What an interrupted run leaves: the checkpoint's last finished epoch, or nothing."""
    if not path.exists():
        return "no epoch finished, so nothing was saved"
    return f"{path} holds the last finished epoch ({_progress(path)}): continue with --resume"


class EpochEnd(HookBase):
    """After each epoch: test accuracy, the checkpoint (atomic; its metadata has the epoch and the batch
    size), and the epoch's line on the console."""

    def __init__(self, test, x_test, y_test, path: Path, steps_per_epoch: int, epochs: int, progress,
                 say: bool = True, batch_size: int = 0) -> None:
        self.test, self.x_test, self.y_test, self.path, self.say = test, x_test, y_test, path, say
        self.batch_size = batch_size
        self.steps, self.epochs, self.progress = steps_per_epoch, epochs, progress
        self.accuracy = float("nan")
        self._bar: Any = None  # the epoch's progress bar (tqdm's, or a stand-in)

    def before_step(self) -> None:
        if self._bar is None:
            epoch = self.trainer.iter // self.steps + 1
            self._bar = self.progress(self.steps - self.trainer.iter % self.steps, f"epoch {epoch}/{self.epochs}")

    def after_step(self) -> None:
        self._bar.update()
        done = self.trainer.iter + 1
        if done % self.steps:
            return
        self._bar.close()
        self._bar = None
        storage = self.trainer.storage
        losses = [v for it, v in storage.history["loss"] if it >= done - self.steps]
        self.accuracy = evaluate(self.test, self.x_test, self.y_test)
        storage.put_scalar("test_accuracy", self.accuracy)
        storage.put_scalar("epoch_loss", float(np.mean(losses)))
        if self.say:  # one process writes the checkpoint (atomically); every process can load it
            checkpoint.save(self.path, dpm.GetCheckpointParams(self.trainer.model),
                            metadata={"epoch": done // self.steps, "batch_size": self.batch_size,
                                      **elastic.job_metadata()})
            log.info("epoch %2d  loss %.4f  test accuracy %.2f%%", done // self.steps, np.mean(losses),
                     100 * self.accuracy)

    def after_train(self) -> None:
        if self._bar is not None:
            self._bar.close()


class EpochWriter(PeriodicWriter):
    """PeriodicWriter at epoch ends only: an interrupted epoch leaves no partial row in metrics.json."""

    def after_train(self) -> None:
        if self._board is not None:
            self._board.close()


class ShardOf:
    """This process's contiguous share of each global batch of `loader` (its length and epochs too)."""

    def __init__(self, loader: ArrayLoader, shard: int, shards: int) -> None:
        self.loader, self.shard, self.shards = loader, shard, shards

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            share = len(next(iter(batch.values()))) // self.shards
            yield {name: value[self.shard * share:(self.shard + 1) * share] for name, value in batch.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status (0; 1 after an error, said in one line; 2 for a bad option; 130
    after Ctrl-C)."""
    return cli.guard(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.num_processes > 1 and launch.get_world_size() == 1:
        args.report_interrupt = False  # the processes stop quietly; this one says it, once
        try:
            launch.launch(run, args.num_processes, args=(args,), backend="gloo" if args.cpu else None)
        except KeyboardInterrupt:
            print(f"\ninterrupted; {_kept(args.checkpoint)}", file=sys.stderr, flush=True)
            return cli.INTERRUPTED
        return 0
    return run(args)


def process_devices(args: argparse.Namespace) -> list[int]:
    """This process's device ids: CPU devices 0..D-1 in every process; GPUs r*D .. r*D + D - 1 for
    process r of this machine's (`comm.local_devices`), so processes never share a GPU."""
    return list(range(args.devices)) if args.cpu else comm.local_devices(args.devices)


def run(args: argparse.Namespace) -> int:
    """Train in this process: alone, or as one shard of launch.get_world_size(). Ctrl-C ends it (status
    130) after the step in flight, with the loading thread stopped, or where it lands outside the steps
    (loading the data, building, initialising): one line from the process that reports it, nothing from
    the others (the processes of --num-processes: their parent says it)."""
    cli.setup_logger(args.verbose)  # here: a process that launch started has the logging of a fresh one
    with cli.one_interrupt():
        try:
            return _run(args)
        except KeyboardInterrupt:
            if launch.is_main_process() and getattr(args, "report_interrupt", True):
                print(f"\ninterrupted; {_kept(args.checkpoint)}", file=sys.stderr, flush=True)
            return cli.INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    shard, shards, say = launch.get_rank(), launch.get_world_size(), launch.is_main_process()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    devices = process_devices(args)
    steps_per_epoch = len(y_train) // args.batch_size
    max_iter = args.epochs * steps_per_epoch
    if args.resume:
        done = checkpoint.read_metadata(args.checkpoint)["iteration"] or 0
        if done >= max_iter:
            if say:
                at = done // steps_per_epoch
                log.info("nothing to do: %s is at epoch %d, and --epochs %d asks for no more; to train longer, pass "
                         "an --epochs above %d (e.g. --epochs %d)", args.checkpoint, at, args.epochs, at, at + 4)
            return 0
    workspace.ResetWorkspace()
    workspace.SetSeed(args.seed)
    train, test = build(devices, args.cpu, args.lr, args.lr_step_epochs * steps_per_epoch,
                        args.finite_check, launch.rendezvous(), args.dtype, compile_options(args))
    where = f"{shards} processes x {args.devices}" if shards > 1 else f"{args.devices}"
    if say:
        log.info("training a CNN on %d digits over %s %s devices (%d samples each per step)", len(y_train), where,
                 "CPU" if args.cpu else "CUDA", args.batch_size // (args.devices * shards))

    metrics = args.checkpoint.parent / "metrics.json"
    if say and not args.resume:  # a fresh run (parse_args refused to overwrite without --overwrite)
        metrics.unlink(missing_ok=True)
        args.checkpoint.unlink(missing_ok=True)
    loader = ShardOf(ArrayLoader({"data": x_train, "label": y_train}, args.batch_size, seed=args.seed), shard, shards)
    with DeviceFeeder(loader, train) as feeder:
        epoch_end = EpochEnd(test, x_test, y_test, args.checkpoint, steps_per_epoch, args.epochs,
                             cli.progress_bar(say), say, args.batch_size)
        hooks = [IterationTimer(), LRScheduler(), epoch_end]
        if say:
            hooks.append(EpochWriter(args.checkpoint.parent, steps_per_epoch, console=False))
        trainer = Trainer(train, feeder, hooks, max_iter=max_iter)
        trainer.initialize()
        dpm.RunInitNet(test)
        if args.resume:
            trainer.resume_or_load(resume=True, path=args.checkpoint)
            if say:
                again = f" (restart {elastic.restart_count()} of this job)" if elastic.restart_count() else ""
                log.info("resumed from %s at epoch %d%s", args.checkpoint, trainer.iter // steps_per_epoch, again)
        try:
            trainer.train()
        except KeyboardInterrupt:
            if say and getattr(args, "report_interrupt", True):
                print(f"\ninterrupted at iteration {trainer.iter}; {_kept(args.checkpoint)}", file=sys.stderr,
                      flush=True)
            return cli.INTERRUPTED
    dpm.Synchronize(train)  # the last checkpoint is written before any process returns
    if not say:
        return 0
    log.info("final test accuracy %.2f%%; checkpoint: %s; metrics: %s", 100 * epoch_end.accuracy, args.checkpoint,
             metrics)
    if args.plot:
        _plot(metrics, args.checkpoint.parent / "training.png")
    return 0


def _plot(metrics: Path, out: Path) -> None:
    import matplotlib  # checked by parse_args

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    epochs = [r for r in rows if "test_accuracy" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot([r["iteration"] + 1 for r in epochs], [r["epoch_loss"] for r in epochs], marker="o")
    left.set(xlabel="iteration", ylabel="training loss")
    right.plot([r["iteration"] + 1 for r in epochs], [r["test_accuracy"] for r in epochs], marker="o")
    right.set(xlabel="iteration", ylabel="test accuracy")
    fig.tight_layout()
    fig.savefig(out)
    log.info("plot: %s", out)


if __name__ == "__main__":
    sys.exit(main())
