"""The main job: train a small CNN data-parallel on scikit-learn's handwritten digits.

    python -m graphpar.examples.train                 # 4 CPU devices (all GPUs when present)
    python -m graphpar.examples.train --resume        # continue from the checkpoint it wrote
    python -m graphpar.examples.train --num-processes 2 --devices 2   # 2 processes x 2 devices, gloo
    python -m graphpar.launch --nproc-per-node 2 -m graphpar.examples.train --devices 2   # the same

The 1,797 8x8 digit images ship inside scikit-learn, so nothing is downloaded. Each step feeds one
global batch split evenly over the devices; gradients are all-reduced, so N devices train exactly
like one device on the whole batch. With several processes (`--num-processes`, `graphpar.launch` or
`torchrun`) each one is a shard owning `--devices` devices and feeding its share of the global batch;
gradients are all-reduced across processes too (gloo), so the numbers are the same. After every epoch it prints the mean loss and the test accuracy
(over 95% after the default 12 epochs) and writes a checkpoint that `--resume` continues from,
learning-rate schedule included.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import numpy as np

from graphpar import brew, checkpoint, launch, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.data import feed_batch, minibatches
from graphpar.devices import num_cuda_devices


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


def build(devices: list[int], cpu: bool, lr: float, lr_step: int, rendezvous: dict | None = None):
    """The training model (Nesterov SGD, LR x0.1 every `lr_step` steps; across processes with a
    `rendezvous`) and a forward-only test model that shares its params."""
    train = model_helper.ModelHelper(name="digits_train")
    dpm.Parallelize(
        train, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
        optimizer_builder_fun=lambda m: optimizer.build_sgd(
            m, base_learning_rate=lr, policy="step", stepsize=lr_step,
            gamma=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        devices=devices, cpu_device=cpu, rendezvous=rendezvous)
    test = model_helper.ModelHelper(name="digits_test", init_params=False)
    dpm.Parallelize(test, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
                    devices=devices, cpu_device=cpu)
    return train, test


def evaluate(test: model_helper.ModelHelper, images: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy of the test net on as many samples as split evenly over the devices."""
    n = len(labels) - len(labels) % len(test._devices)
    feed_batch(test, {"data": images[:n], "label": labels[:n]})
    dpm.RunNet(test, 1)
    predictions = np.concatenate([
        workspace.FetchBlob(f"{test._device_prefix}_{d}/softmax").argmax(axis=1) for d in test._devices])
    return float((predictions == labels[:n]).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="number of devices (default: all GPUs, else 4 CPU devices)")
    parser.add_argument("--cpu", action="store_true", help="use CPU devices even when GPUs are present")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the devices")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lr-step-epochs", type=int, default=8, help="decay the LR x0.1 every N epochs")
    parser.add_argument("--checkpoint", type=Path, default=Path("graphpar_digits.safetensors"))
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes (shards) on this machine, each with --devices devices (gloo)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.num_processes > 1 and launch.get_world_size() == 1:
        launch.launch(run, args.num_processes, args=(args,))
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Train in this process: alone, or as one shard of launch.get_world_size()."""
    shard, shards, say = launch.get_rank(), launch.get_world_size(), launch.is_main_process()

    cpu = args.cpu or num_cuda_devices() == 0
    count = args.devices or (4 if cpu else num_cuda_devices())
    devices = list(range(count))
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    steps_per_epoch = len(y_train) // args.batch_size
    workspace.ResetWorkspace()
    workspace.SetSeed(args.seed)
    train, test = build(devices, cpu, args.lr, args.lr_step_epochs * steps_per_epoch, launch.rendezvous())
    if say:
        print(f"graphpar: training a CNN on {len(y_train)} digits over {shards} x {count} "
              f"{'CPU' if cpu else 'CUDA'} devices ({args.batch_size // (count * shards)} samples each per step)")
    share = args.batch_size // shards  # this shard's contiguous part of each global batch

    def mine(index: np.ndarray) -> np.ndarray:
        return index[shard * share:(shard + 1) * share]

    first = mine(np.arange(args.batch_size))
    feed_batch(train, {"data": x_train[first], "label": y_train[first]})
    dpm.RunInitNet(train)
    dpm.RunInitNet(test)
    start_epoch = 0
    if args.resume:
        checkpoint.load(args.checkpoint)
        dpm.FinalizeAfterCheckpoint(train)
        start_epoch = int(workspace.FetchBlob("optimizer_iteration")[0]) // steps_per_epoch
        if say:
            print(f"resumed from {args.checkpoint} at epoch {start_epoch}")

    rng = np.random.default_rng(args.seed)
    for _ in range(start_epoch):  # replay the shuffles so a resumed run sees the same batches
        rng.permutation(len(y_train))
    progress = _progress_bar()
    accuracy = math.nan
    for epoch in range(start_epoch, args.epochs):
        losses = []
        batches = minibatches(len(y_train), args.batch_size, rng)
        for index in progress(batches, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}",
                              disable=not say):
            index = mine(index)
            feed_batch(train, {"data": x_train[index], "label": y_train[index]})
            dpm.RunNet(train, 1)
            losses.append(sum(float(workspace.FetchBlob(f"{train._device_prefix}_{d}/loss"))
                              for d in devices) / count)
        accuracy = evaluate(test, x_test, y_test)  # every shard holds the same params
        dpm.save_checkpoint(train, args.checkpoint, metadata={"epoch": epoch + 1})  # shard 0 writes, atomically
        if say:
            print(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}  test accuracy {accuracy:.2%}")
    dpm.Synchronize(train)  # the last checkpoint is written before any shard returns
    if say:
        print(f"final test accuracy {accuracy:.2%}; checkpoint: {args.checkpoint}")
    return 0


def _progress_bar():
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return lambda it, **_: it
    return lambda it, disable=False, **kw: tqdm(it, leave=False, disable=disable, **kw)


if __name__ == "__main__":
    sys.exit(main())
