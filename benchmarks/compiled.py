"""The compiled step against op-by-op graphpar, eager PyTorch and torch.compile of the eager step (CPU).

Per model, one training step (forward, backward, SGD with momentum 0.9 and a step LR policy) by

- `simple`: `Parallelize(devices=[0], net_type="simple")` + `RunNet` (op by op);
- `compiled`: `Parallelize(devices=[0], compile=True)` + `RunNet` (inductor);
- `eager`: the same model as an `nn.Module` with `torch.optim.SGD`;
- `torch.compile`: the eager step (zero_grad, forward, loss, backward, `optimizer.step()`) as one
  function compiled by `torch.compile` (inductor),

alternated in one process after warm-up; the table gives median step ms, the ratio to eager and the
seconds the first run of each compiled contender took (its compile, cold: inductor's caches are off for
it and its on-disk cache is a fresh directory, so a kernel built by an earlier run is built again;
inductor's once-per-process start is paid before either). A data-parallel row trains the CNN on 2 CPU devices (`compiled`, and `simple` for reference) at the same global batch as eager.

    python -m benchmarks.compiled [--repeats 25] [--warmup 5] [--models mlp,cnn,resnet18,cnn_dp2] [--save]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

from benchmarks import eager_models
from benchmarks._common import compare, environment, markdown_table, median, write_json
from graphpar import models
from graphpar.model import brew, optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

LR, MOMENTUM, STEPSIZE, GAMMA = 0.01, 0.9, 1000, 0.5


def _mlp(model: ModelHelper, loss_scale: float) -> list:
    h = "data"
    for k, (d_in, d_out) in enumerate(((784, 512), (512, 512)), start=1):
        h = brew.relu(model, brew.fc(model, h, f"fc{k}", dim_in=d_in, dim_out=d_out), f"fc{k}")
    return _loss(model, brew.fc(model, h, "pred", dim_in=512, dim_out=10), loss_scale)


def _cnn(model: ModelHelper, loss_scale: float) -> list:
    h = "data"
    for k, (c_in, c_out) in enumerate(((3, 16), (16, 32)), start=1):
        h = brew.conv(model, h, f"conv{k}", dim_in=c_in, dim_out=c_out, kernel=3, pad=1)
        h = brew.spatial_bn(model, h, f"bn{k}", dim_in=c_out, momentum=0.9)
        h = brew.relu(model, h, h)
        h = brew.max_pool(model, h, f"pool{k}", kernel=2, stride=2)
    return _loss(model, brew.fc(model, h, "pred", dim_in=32 * 8 * 8, dim_out=10), loss_scale)


def _resnet18(model: ModelHelper, loss_scale: float) -> list:
    return models.resnet18(model, loss_scale, num_classes=10, in_channels=3, width=64)


def _loss(model: ModelHelper, pred: Any, loss_scale: float) -> list:
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.pred = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2, 2)
        return self.pred(h.flatten(1))


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    input_shape: tuple[int, ...]
    forward: Callable[[ModelHelper, float], list]
    module: Callable[[], nn.Module]
    devices: int = 1


CASES = {
    "mlp": Case("MLP 784-512-512-10, batch 128", 128, (784,), _mlp, lambda: eager_models.mlp(784, (512, 512), 10)),
    "cnn": Case("CNN (conv-bn-relu-pool)x2 + fc, 3x32x32, batch 64", 64, (3, 32, 32), _cnn, _CNN),
    "resnet18": Case("ResNet-18 width 64, 3x32x32, batch 32", 32, (3, 32, 32), _resnet18,
                     lambda: eager_models.resnet18(3, 64, 10)),
    "cnn_dp2": Case("CNN on 2 CPU devices, global batch 64", 64, (3, 32, 32), _cnn, _CNN, devices=2),
}


def graphpar_step(case: Case, x: np.ndarray, y: np.ndarray, compile_: bool | dict, name: str) -> Callable[[], None]:
    """A parallelized model of `case` in workspace `name`, fed once; returns one RunNet of its train net."""
    workspace.SwitchWorkspace(name, True)
    workspace.ResetWorkspace()
    model = ModelHelper(name=name)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=case.forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM, policy="step",
                                                                          stepsize=STEPSIZE, gamma=GAMMA),
                    devices=list(range(case.devices)), cpu_device=True, compile=compile_,
                    net_type="simple")
    workspace.RunNetOnce(model.param_init_net)
    rows = case.batch // case.devices
    for k, device in enumerate(model._devices):
        workspace.FeedBlob(f"cpu_{device}/data", x[k * rows:(k + 1) * rows])
        workspace.FeedBlob(f"cpu_{device}/label", y[k * rows:(k + 1) * rows])
    workspace.CreateNet(model.net)
    net = model.net.Name()

    def step() -> None:
        workspace.SwitchWorkspace(name)
        workspace.RunNet(net)

    return step


def eager_step(case: Case, x: np.ndarray, y: np.ndarray, compiled: bool) -> Callable[[], None]:
    """One eager SGD step of `case`'s module (one compiled function of the whole step when `compiled`)."""
    step = eager_models.sgd_step(case.module(), x, y, LR, MOMENTUM)
    return torch.compile(step) if compiled else step


def warm_inductor() -> None:
    """Pay inductor's once-per-process start (its imports, the C++ toolchain's checks: about 15 s here) on a
    trivial function, so that it is not charged to whichever contender compiles first."""
    with torch._inductor.config.patch(force_disable_caches=True):
        torch.compile(lambda x: (x.sin() + 1).sum(), fullgraph=True)(torch.ones(8))


def first_run(step: Callable[[], None]) -> float:
    """Seconds of `step`'s first call (a compiled contender's compile, with inductor's caches off)."""
    with torch._inductor.config.patch(force_disable_caches=True):
        began = time.perf_counter()
        step()
        return time.perf_counter() - began


def measure(case: Case, repeats: int, warmup: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, *case.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, case.batch).astype(np.int32)
    steps = {"simple": graphpar_step(case, x, y, False, "bench_simple"),
             "compiled": graphpar_step(case, x, y, True, "bench_compiled"),
             "eager": eager_step(case, x, y, compiled=False)}
    if case.devices == 1:
        steps["torch.compile"] = eager_step(case, x, y, compiled=True)
    compile_s = {name: first_run(steps[name]) for name in steps}
    times = compare(steps, repeats=repeats, warmup=warmup)
    ms = {name: 1e3 * median(t) for name, t in times.items()}
    return {"ms": ms, "ratio_to_eager": {name: ms[name] / ms["eager"] for name in ms},
            "first_run_s": {name: compile_s[name] for name in ("compiled", "torch.compile") if name in compile_s}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/compiled.json")
    opts = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="graphpar_bench_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold compiles
    torch.manual_seed(0)
    warm_inductor()
    results = {}
    for key in opts.models.split(","):
        case = CASES[key]
        try:
            results[case.name] = measure(case, opts.repeats, opts.warmup)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        r = results[case.name]
        print(f"{case.name}: " + ", ".join(f"{n} {v:.2f} ms ({r['ratio_to_eager'][n]:.2f}x)" for n, v in r["ms"].items())
              + "; first run " + ", ".join(f"{n} {v:.1f} s" for n, v in r["first_run_s"].items()), flush=True)
    names = ["simple", "compiled", "eager", "torch.compile"]
    rows = [(model, *(f"{r['ms'][n]:.2f} ({r['ratio_to_eager'][n]:.2f}x)" if n in r["ms"] else "-" for n in names),
             *(f"{r['first_run_s'][n]:.1f}" if n in r["first_run_s"] else "-" for n in ("compiled", "torch.compile")))
            for model, r in results.items()]
    print(markdown_table(["model (CPU)", *(f"{n} ms (/ eager)" for n in names), "compiled: first run s",
                          "torch.compile: first run s"], rows))
    if opts.save:
        path = write_json("compiled", {"repeats": opts.repeats, "warmup": opts.warmup,
                                       "threads": torch.get_num_threads(), "environment": environment(),
                                       "results": results})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
