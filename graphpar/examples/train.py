"""The main job: train a small CNN data-parallel on scikit-learn's handwritten digits.

    python -m graphpar.examples.train                 # 4 CPU devices (all GPUs when present)
    python -m graphpar.examples.train --resume        # continue from the checkpoint it wrote
    python -m graphpar.examples.train --num-processes 2 --devices 2   # 2 processes x 2 devices, gloo
    python -m graphpar.launch --nproc-per-node 2 -m graphpar.examples.train --devices 2   # the same

The 1,797 8x8 digit images ship inside scikit-learn, so nothing is downloaded. Each step feeds one
global batch split evenly over the devices; gradients are all-reduced, so N devices train exactly
like one device on the whole batch. After every epoch it prints the mean loss and the test accuracy
(over 95% after the default 12 epochs, on every test sample) and writes a checkpoint that
`--resume` continues from, learning-rate schedule included, and `metrics.json` beside it (with
`--plot`, a loss/accuracy PNG at the end when matplotlib is installed). Batches are loaded on a
background thread (`DeviceFeeder`) while the devices compute; the loop is `graphpar.engine.Trainer`
with hooks. Ctrl-C stops cleanly, keeping the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from graphpar import brew, checkpoint, launch, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.data import ArrayLoader, DeviceFeeder, feed, gather
from graphpar.devices import num_cuda_devices
from graphpar.engine import HookBase, IterationTimer, LRScheduler, PeriodicWriter, Trainer


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
    """conv(1->16) relu pool, conv(16->32) relu pool, fc(128->10), softmax loss."""
    h = brew.conv(model, "data", "conv1", dim_in=1, dim_out=16, kernel=3, pad=1)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool1", kernel=2, stride=2)
    h = brew.conv(model, h, "conv2", dim_in=16, dim_out=32, kernel=3, pad=1)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool2", kernel=2, stride=2)
    pred = brew.fc(model, h, "pred", dim_in=32 * 2 * 2, dim_out=10)
    softmax, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def build(devices: list[int], cpu: bool, lr: float, lr_step: int, check_finite_loss: bool = True,
          rendezvous: dict | None = None, compute_dtype: str | None = None):
    """The training model (Nesterov SGD, LR x0.1 every `lr_step` steps; across processes with a
    `rendezvous`) and a forward-only test model that shares its params (any test-set size: chunks may
    differ by one row). With `check_finite_loss` a NaN or infinite loss stops the step before it
    updates anything (RunNet raises, naming the loss). `compute_dtype="bfloat16"` trains and tests in
    mixed precision (docs/precision.md)."""
    train = model_helper.ModelHelper(name="digits_train")
    dpm.Parallelize(
        train, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
        optimizer_builder_fun=lambda m: optimizer.build_sgd(
            m, base_learning_rate=lr, policy="step", stepsize=lr_step,
            gamma=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        devices=devices, cpu_device=cpu, check_finite_loss=check_finite_loss, rendezvous=rendezvous,
        compute_dtype=compute_dtype)
    test = model_helper.ModelHelper(name="digits_test", init_params=False)
    dpm.Parallelize(test, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
                    devices=devices, cpu_device=cpu, uneven_batches=True, compute_dtype=compute_dtype)
    return train, test


def evaluate(test: model_helper.ModelHelper, images: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy of the test net on every test sample."""
    feed(test, {"data": images, "label": labels})
    dpm.RunNet(test, 1)
    return float((gather(test, "softmax").argmax(axis=1) == labels).mean())


def parse_args(argv: list[str] | None, train_size: int = int(0.8 * 1797)) -> argparse.Namespace:
    """The options, checked: each error names the option and what it accepts (exit status 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="number of devices (default: all GPUs, else 4 CPU devices)")
    parser.add_argument("--cpu", action="store_true", help="use CPU devices even when GPUs are present")
    parser.add_argument("--epochs", type=int, default=12, help="epochs in all (a resumed run continues to it)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the devices")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lr-step-epochs", type=int, default=8, help="decay the LR x0.1 every N epochs")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype: bfloat16 runs Conv/FC in bf16 with fp32 master params (docs/precision.md)")
    parser.add_argument("--checkpoint", type=Path, default=Path("graphpar_digits.safetensors"),
                        help="checkpoint file, written every epoch; metrics.json goes beside it")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--plot", action="store_true", help="write a loss/accuracy PNG at the end (matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-finite-check", action="store_true",
                        help="do not stop a step whose loss is NaN or inf (saves one host sync per device and step)")
    parser.add_argument("--verbose", action="store_true", help="log what Parallelize built and each init/sync")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes (shards) on this machine, each with --devices devices (gloo)")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"--num-processes must be at least 1, got {args.num_processes}")
    shards = max(args.num_processes, launch.get_world_size())
    args.cpu = args.cpu or num_cuda_devices() == 0
    available = None if args.cpu else num_cuda_devices()
    if args.devices is None:
        args.devices = 4 if args.cpu else available
    if args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
    if available is not None and args.devices > available:
        parser.error(f"--devices {args.devices}: only {available} GPUs are visible (or pass --cpu)")
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if not 1 <= args.batch_size <= train_size:
        parser.error(f"--batch-size must be between 1 and the {train_size} training samples, got {args.batch_size}")
    if args.batch_size % (args.devices * shards):
        every = args.devices * shards
        what = f"--devices {args.devices}" + (f" x {shards} processes" if shards > 1 else "")
        parser.error(f"--batch-size {args.batch_size} must be a multiple of {what} (every device gets the same "
                     f"share), e.g. {max(every, args.batch_size // every * every)}")
    if args.lr <= 0 or args.lr_step_epochs < 1:
        parser.error(f"--lr must be > 0 and --lr-step-epochs >= 1, got {args.lr} and {args.lr_step_epochs}")
    if args.resume and not args.checkpoint.exists():
        parser.error(f"--resume: there is no checkpoint at {args.checkpoint} (train once without --resume, or "
                     f"pass --checkpoint)")
    return args


class EpochEnd(HookBase):
    """After each epoch: test accuracy, the checkpoint (atomic), and the epoch's line on the console."""

    def __init__(self, test, x_test, y_test, path: Path, steps_per_epoch: int, epochs: int, progress,
                 say: bool = True) -> None:
        self.test, self.x_test, self.y_test, self.path, self.say = test, x_test, y_test, path, say
        self.steps, self.epochs, self.progress = steps_per_epoch, epochs, progress
        self.accuracy = float("nan")
        self._bar = None

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
        losses = [v for it, v in storage.history["scaled_loss"] if it >= done - self.steps]
        self.accuracy = evaluate(self.test, self.x_test, self.y_test)
        storage.put_scalar("test_accuracy", self.accuracy)
        storage.put_scalar("epoch_loss", float(np.mean(losses)))
        if self.say:  # one process writes the checkpoint (atomically); every process can load it
            checkpoint.save(self.path, dpm.GetCheckpointParams(self.trainer.model),
                            metadata={"epoch": done // self.steps})
            print(f"epoch {done // self.steps:2d}  loss {np.mean(losses):.4f}  test accuracy {self.accuracy:.2%}")

    def after_train(self) -> None:
        if self._bar is not None:
            self._bar.close()


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.num_processes > 1 and launch.get_world_size() == 1:
        launch.launch(run, args.num_processes, args=(args,))
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Train in this process: alone, or as one shard of launch.get_world_size()."""
    shard, shards, say = launch.get_rank(), launch.get_world_size(), launch.is_main_process()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    devices = list(range(args.devices))
    steps_per_epoch = len(y_train) // args.batch_size
    max_iter = args.epochs * steps_per_epoch
    if args.resume:
        done = checkpoint.read_metadata(args.checkpoint)["iteration"] or 0
        if done >= max_iter:
            print(f"nothing to do: {args.checkpoint} is at epoch {done // steps_per_epoch} of {args.epochs}; "
                  f"pass a larger --epochs (e.g. --epochs {args.epochs + 4}) to train longer")
            return 0
    workspace.ResetWorkspace()
    workspace.SetSeed(args.seed)
    train, test = build(devices, args.cpu, args.lr, args.lr_step_epochs * steps_per_epoch,
                        not args.no_finite_check, launch.rendezvous(), args.dtype)
    where = f"{shards} processes x {args.devices}" if shards > 1 else f"{args.devices}"
    if say:
        print(f"graphpar: training a CNN on {len(y_train)} digits over {where} {'CPU' if args.cpu else 'CUDA'} "
              f"devices ({args.batch_size // (args.devices * shards)} samples each per step)")

    metrics = args.checkpoint.parent / "metrics.json"
    if say and not args.resume:
        metrics.unlink(missing_ok=True)
    loader = ShardOf(ArrayLoader({"data": x_train, "label": y_train}, args.batch_size, seed=args.seed), shard, shards)
    with DeviceFeeder(loader, train) as feeder:
        epoch_end = EpochEnd(test, x_test, y_test, args.checkpoint, steps_per_epoch, args.epochs,
                             _progress_bar(say), say)
        hooks = [IterationTimer(), LRScheduler(), epoch_end]
        if say:
            hooks.append(PeriodicWriter(args.checkpoint.parent, steps_per_epoch, console=False))
        trainer = Trainer(train, feeder, hooks, max_iter=max_iter)
        trainer.initialize()
        dpm.RunInitNet(test)
        if args.resume:
            trainer.resume_or_load(resume=True, path=args.checkpoint)
            if say:
                print(f"resumed from {args.checkpoint} at epoch {trainer.iter // steps_per_epoch}")
        try:
            trainer.train()
        except KeyboardInterrupt:
            print(f"\ninterrupted at iteration {trainer.iter}; {args.checkpoint} holds the last finished epoch: "
                  f"continue with --resume", file=sys.stderr)
            return 130
    dpm.Synchronize(train)  # the last checkpoint is written before any process returns
    if not say:
        return 0
    print(f"final test accuracy {epoch_end.accuracy:.2%}; checkpoint: {args.checkpoint}; metrics: {metrics}")
    if args.plot:
        _plot(metrics, args.checkpoint.parent / "training.png")
    return 0


def _progress_bar(show: bool = True):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        show = False
    if not show:
        class _Quiet:
            def update(self) -> None: ...

            def close(self) -> None: ...

        return lambda total, desc: _Quiet()
    return lambda total, desc: tqdm(total=total, desc=desc, leave=False)


def _plot(metrics: Path, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); metrics.json has the numbers")
        return
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    epochs = [r for r in rows if "test_accuracy" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot([r["iteration"] + 1 for r in epochs], [r["epoch_loss"] for r in epochs], marker="o")
    left.set(xlabel="iteration", ylabel="training loss")
    right.plot([r["iteration"] + 1 for r in epochs], [r["test_accuracy"] for r in epochs], marker="o")
    right.set(xlabel="iteration", ylabel="test accuracy")
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot: {out}")


if __name__ == "__main__":
    sys.exit(main())
