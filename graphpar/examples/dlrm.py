"""Train the small DLRM click model data-parallel on synthetic clicks, with sparse embedding updates.

    python -m graphpar.examples.dlrm                      # 4 CPU devices, Adagrad
    python -m graphpar.examples.dlrm --optimizer momentum --devices 2

The embedding tables get sparse (GradientSlice) gradients: the replicas' lookups and row gradients
are concatenated across devices, and each replica updates only the rows its global batch looked up.
It prints the training loss and the accuracy on held-out clicks; the default run (300 steps of 256)
goes from 0.69 (chance) to a loss below 0.1 and over 95% held-out accuracy.
"""

from __future__ import annotations

from graphpar.examples import interrupt

if __name__ == "__main__":
    interrupt.exit_on_interrupt()  # from now on a Ctrl-C exits at once, status 130

import functools  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from graphpar.examples import cli  # noqa: E402


def make_parser() -> cli.ArgumentParser:
    """The options, each value checked as it is parsed (no torch needed: `--help` answers at once)."""
    parser = cli.parser("graphpar.examples.dlrm", __doc__)
    parser.add_argument("--devices", type=cli.integer(1), default=None, help="devices (default: all GPUs, else 4 CPUs)")
    parser.add_argument("--cpu", action="store_true", help="use CPU devices even when GPUs are present")
    parser.add_argument("--optimizer", choices=("adagrad", "adam", "momentum"), default="adagrad",
                        help="the update of the dense and the embedding (sparse) params")
    parser.add_argument("--lr", type=cli.number(0.0), default=0.1, help="learning rate of --optimizer")
    parser.add_argument("--steps", type=cli.integer(1), default=300, help="training steps")
    parser.add_argument("--batch", type=cli.integer(1), default=256, help="global batch, split over the devices")
    parser.add_argument("--verbose", action="store_true", help="log what Parallelize built; show an error's traceback")
    return parser


if __name__ == "__main__":
    make_parser().parse_args()  # --help and a malformed value answer before torch loads (main parses again)

import numpy as np  # noqa: E402

from graphpar.model import model_helper, optimizer  # noqa: E402
from graphpar.models.dlrm import dlrm, split_clicks, synthetic_clicks  # noqa: E402
from graphpar.parallel import data_parallel_model as dpm  # noqa: E402
from graphpar.platform.devices import num_cuda_devices  # noqa: E402
from graphpar.runtime import workspace  # noqa: E402

log = cli.log

TABLES = (1000, 500, 200)
OPTIMIZERS = {
    "adagrad": lambda m, lr: optimizer.build_adagrad(m, lr, epsilon=1e-6),
    "momentum": lambda m, lr: optimizer.build_sgd(m, lr, momentum=0.9),
    "adam": lambda m, lr: optimizer.build_adam(m, lr),
}


def _feed(model: model_helper.ModelHelper, feeds: dict[str, np.ndarray]) -> None:
    for device, chunk in zip(model._devices, split_clicks(feeds, len(model._devices))):
        for name, value in chunk.items():
            workspace.FeedBlob(f"{model._device_prefix}_{device}/{name}", value)


def _accuracy(model: model_helper.ModelHelper, feeds: dict[str, np.ndarray]) -> float:
    """Accuracy of the forward-only model on `feeds` (each replica scores its chunk)."""
    _feed(model, feeds)
    workspace.RunNet(model.net)
    logits = np.concatenate([workspace.FetchBlob(f"{model._device_prefix}_{d}/top1") for d in model._devices])
    return float(((logits[:, 0] > 0) == (feeds["label"][:, 0] > 0.5)).mean())


def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status (1 after an error, said in one line; 130 after Ctrl-C)."""
    return cli.guard(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    cli.setup_logger(args.verbose)
    gpus = 0 if args.cpu else num_cuda_devices()
    count = args.devices or (gpus or 4)
    if args.batch % count:
        parser.error(f"argument --batch: must be a multiple of the {count} devices, got {args.batch}")
    forward = functools.partial(dlrm, num_dense=4, table_rows=TABLES, dim=8, bottom=(16,), top=(32,))
    train = model_helper.ModelHelper(name="dlrm_train")
    dpm.Parallelize(train, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: OPTIMIZERS[args.optimizer](m, args.lr),
                    devices=list(range(count)), cpu_device=not gpus)
    test = model_helper.ModelHelper(name="dlrm_test", init_params=False)
    dpm.Parallelize(test, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    devices=list(range(count)), cpu_device=not gpus)
    held_out = synthetic_clicks(args.batch * 4, 4, TABLES, seed=10**6)
    losses = []
    for step in range(args.steps):
        _feed(train, synthetic_clicks(args.batch, 4, TABLES, seed=step))
        if step == 0:
            dpm.RunInitNet(train)
            dpm.RunInitNet(test)
        dpm.RunNet(train, 1)
        losses.append(sum(float(workspace.FetchBlob(f"{train._device_prefix}_{d}/scaled_loss"))
                          for d in train._devices))
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            log.info("step %d: loss %.4f", step + 1, np.mean(losses[-50:]))
    log.info("final loss %.4f, held-out accuracy %.1f%%", np.mean(losses[-50:]), 100 * _accuracy(test, held_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
