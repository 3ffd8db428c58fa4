"""Time of one training step (forward, backward, SGD with momentum) on one CPU device: graphpar vs eager.

graphpar runs a ModelHelper built with brew + `optimizer.build_sgd(momentum=0.9)` through
`workspace.RunNet`; eager PyTorch runs the same model as an `nn.Module` with `torch.optim.SGD`
(momentum 0.9), starting from graphpar's initial weights. Both train on one fixed batch, alternated in
one process, after warm-up; the table gives the median step times and their ratio (target <= 1.25).
Models: an overhead-bound MLP (batch 32, 64-128-10), a compute-bound MLP (batch 256, 512-1024-10), a
small CNN (batch 32, 3x32x32: conv-bn-relu-pool twice, then fc) and the zoo's ResNet-18 (width 32,
batch 16, 3x64x64; the eager copy starts from its own weights, so only its time is compared).

    python -m benchmarks.step_time [--repeats 30] [--warmup 5] [--threads 1] [--check-finite]

`--check-finite` adds the check that `Parallelize(check_finite_loss=True)` adds (a CheckFinite op on
the loss, before the gradients), to measure its cost.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import eager_models
from benchmarks._common import compare, markdown_table, median, write_json
from graphpar import models
from graphpar.model import brew, optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.runtime import workspace

LR, MOMENTUM = 0.01, 0.9


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, int, int]) -> None:
        super().__init__()
        self.fc1, self.pred = nn.Linear(dims[0], dims[1]), nn.Linear(dims[1], dims[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pred(F.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=0.1)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32, momentum=0.1)
        self.pred = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2, 2)
        return self.pred(h.flatten(1))


def mlp_forward(dims: tuple[int, int, int]) -> Callable[[ModelHelper], str]:
    def forward(model: ModelHelper) -> str:
        h = brew.fc(model, "data", "fc1", dim_in=dims[0], dim_out=dims[1])
        h = brew.relu(model, h, h)
        return brew.fc(model, h, "pred", dim_in=dims[1], dim_out=dims[2])

    return forward


def cnn_forward(model: ModelHelper) -> str:
    h = "data"
    for i, (c_in, c_out) in enumerate(((3, 16), (16, 32)), start=1):
        h = brew.conv(model, h, f"conv{i}", dim_in=c_in, dim_out=c_out, kernel=3, pad=1)
        h = brew.spatial_bn(model, h, f"bn{i}", dim_in=c_out, momentum=0.9)
        h = brew.relu(model, h, h)
        h = brew.max_pool(model, h, f"pool{i}", kernel=2, stride=2)
    return brew.fc(model, h, "pred", dim_in=32 * 8 * 8, dim_out=10)


@dataclass
class Case:
    name: str
    batch: int
    input_shape: tuple[int, ...]
    forward: Callable[[ModelHelper], str]
    module: Callable[[], nn.Module]
    blobs: dict[str, str]  # graphpar param -> torch state_dict key


def _linear_blobs(*names: str) -> dict[str, str]:
    return {f"{n}_{p}": f"{n}.{k}" for n in names for p, k in (("w", "weight"), ("b", "bias"))}


def resnet18_forward(model: ModelHelper) -> str:
    """The zoo's ResNet-18 (width 32, 10 classes) up to its `pred` blob."""
    models.resnet18(model, 1.0, num_classes=10, in_channels=3, width=32)
    return "pred"


CASES = [
    Case("MLP 64-128-10, batch 32 (overhead-bound)", 32, (64,), mlp_forward((64, 128, 10)),
         lambda: MLP((64, 128, 10)), _linear_blobs("fc1", "pred")),
    Case("MLP 512-1024-10, batch 256 (compute-bound)", 256, (512,), mlp_forward((512, 1024, 10)),
         lambda: MLP((512, 1024, 10)), _linear_blobs("fc1", "pred")),
    Case("CNN conv-bn-relu-pool x2 + fc, batch 32, 3x32x32", 32, (3, 32, 32), cnn_forward, CNN,
         {**_linear_blobs("conv1", "conv2", "pred"),
          **{f"bn{i}_{p}": f"bn{i}.{k}" for i in (1, 2) for p, k in (("s", "weight"), ("b", "bias"))}}),
    Case("ResNet-18 width 32, batch 16, 3x64x64 (own initial weights)", 16, (3, 64, 64), resnet18_forward,
         lambda: eager_models.resnet18(3, 32, 10), {}),
]


def graphpar_step(case: Case, x: np.ndarray, y: np.ndarray, check_finite: bool = False) -> Callable[[], object]:
    """Build, initialise and create the graphpar train net; return one RunNet call."""
    workspace.ResetWorkspace()
    model = ModelHelper(name="step_time")
    pred = case.forward(model)
    loss = "loss" if model.net.BlobIsDefined("loss") else model.net.SoftmaxWithLoss([pred, "label"],
                                                                                    ["softmax", "loss"])[1]
    if check_finite:
        model.net.CheckFinite([loss], [])
    model.AddGradientOperators([loss])
    optimizer.build_sgd(model, LR, momentum=MOMENTUM)
    workspace.RunNetOnce(model.param_init_net)
    workspace.FeedBlob("data", x)
    workspace.FeedBlob("label", y)
    workspace.CreateNet(model.net)
    name = model.net.Name()
    return lambda: workspace.RunNet(name)


def eager_step(case: Case, x: np.ndarray, y: np.ndarray) -> tuple[Callable[[], object], nn.Module]:
    """One SGD step on the same batch, and the nn.Module it trains (from graphpar's initial weights)."""
    module = case.module()
    module.load_state_dict({key: workspace.FetchTensor(blob) for blob, key in case.blobs.items()}, strict=False)
    return eager_models.sgd_step(module, x, y, LR, MOMENTUM), module


def check_same_step(case: Case, graphpar: Callable[[], object], eager: Callable[[], object],
                    module: nn.Module) -> None:
    """One step of each from the same weights gives the same params (both sides do the same work)."""
    graphpar()
    eager()
    state = module.state_dict()
    for blob, key in case.blobs.items():
        torch.testing.assert_close(workspace.FetchTensor(blob), state[key], rtol=1e-4, atol=1e-5)


def measure(case: Case, repeats: int, warmup: int, check_finite: bool = False) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, *case.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, case.batch).astype(np.int32)
    graphpar = graphpar_step(case, x, y, check_finite)
    eager, module = eager_step(case, x, y)
    check_same_step(case, graphpar, eager, module)
    times = compare({"graphpar": graphpar, "eager": eager}, repeats=repeats, warmup=warmup)
    g, e = median(times["graphpar"]), median(times["eager"])
    return {"graphpar_ms": 1e3 * g, "eager_ms": 1e3 * e, "ratio": g / e}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (both sides)")
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/ (tracked files: only when asked)")
    parser.add_argument("--check-finite", action="store_true", help="add a CheckFinite op on the loss")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    results = {case.name: measure(case, opts.repeats, opts.warmup, opts.check_finite) for case in CASES}
    rows = [(name, r["graphpar_ms"], r["eager_ms"], r["ratio"]) for name, r in results.items()]
    print(markdown_table(["model (one SGD-momentum step, CPU)", "graphpar ms", "eager ms", "ratio"], rows))
    if opts.save:
        path = write_json("step_time", {"repeats": opts.repeats, "warmup": opts.warmup, "threads": opts.threads,
                                        "target_ratio": 1.25, "results": results})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
