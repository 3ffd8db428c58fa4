"""Mixed precision: graphpar's precision pass against eager `torch.autocast` + channels_last, side by side.

Per batch size, one training step (momentum SGD, one device) of:
- graphpar fp32; graphpar bf16 (`compute_dtype="bfloat16"`, `channels_last=True`); on CUDA also fp16
  (`compute_dtype="float16"`, dynamic `loss_scale`);
- eager fp32; eager bf16 (`torch.autocast(dtype=torch.bfloat16)` + `memory_format=torch.channels_last`);
  on CUDA also fp16 (autocast + `torch.amp.GradScaler`).
Step times are alternated between the candidates in one process (medians after warm-up) and reported as
images/s; on CUDA the peak memory of a step (`torch.cuda.max_memory_allocated` above what the candidate
held before it was built). Ratios are against eager in the same precision.

    python -m benchmarks.precision                  # CUDA: ResNet-50, 224x224, batches 64 and 256
    python -m benchmarks.precision --quick          # CPU: a small ResNet-18 (what the test runs)
    python -m benchmarks.precision --save           # also write benchmarks/results/precision.json
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import eager_models
from benchmarks._common import compare, markdown_table, median, write_json
from graphpar import models
from graphpar.model import model_helper, optimizer
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

LR, MOMENTUM = 0.01, 0.9


def _batch(batch: int, image: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, 3, image, image), dtype=np.float32),
            rng.integers(0, classes, batch).astype(np.int32))


def graphpar_step(name: str, forward: Callable, x: np.ndarray, y: np.ndarray, cuda: bool,
                  **options) -> Callable[[], None]:
    """One graphpar training step on device 0 in its own workspace (built and initialised)."""
    workspace.SwitchWorkspace(name, True)
    model = model_helper.ModelHelper(name=name)
    dpm.Parallelize(model, lambda m: None, forward, devices=[0], cpu_device=not cuda,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM), **options)
    prefix = "gpu_0" if cuda else "cpu_0"
    workspace.FeedBlob(f"{prefix}/data", x)
    workspace.FeedBlob(f"{prefix}/label", y)
    dpm.RunInitNet(model)

    def step() -> None:
        workspace.SwitchWorkspace(name)
        dpm.RunNet(model, 1)

    return step


def eager_step(module: nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device,
               dtype: torch.dtype | None) -> Callable[[], None]:
    """One eager step: fp32, or autocast to `dtype` with channels_last (and a GradScaler for float16)."""
    module = module.to(device)
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    if dtype is not None:
        module, xt = module.to(memory_format=torch.channels_last), xt.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(module(xt), yt)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _peak_bytes(step: Callable[[], None], before: int, cuda: bool) -> int | None:
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run(quick: bool, batches: list[int], repeats: int, warmup: int) -> list[dict]:
    """Measure every candidate per batch size; one row per candidate."""
    cuda = torch.cuda.is_available() and not quick
    device = torch.device("cuda" if cuda else "cpu")
    image, classes = (32, 10) if quick else (224, 1000)
    graph_model = (functools.partial(models.resnet18, num_classes=classes, width=8) if quick else
                   functools.partial(models.resnet50, num_classes=classes))
    eager_model = (functools.partial(eager_models.resnet18, 3, 8, classes) if quick else
                   functools.partial(eager_models.resnet50, 3, 64, classes))
    dtypes = {"fp32": None, "bf16": torch.bfloat16, **({"fp16": torch.float16} if cuda else {})}
    options = {"fp32": {}, "bf16": {"compute_dtype": "bfloat16", "channels_last": True},
               "fp16": {"compute_dtype": "float16", "loss_scale": "dynamic", "channels_last": True}}
    rows = []
    for batch in batches:
        x, y = _batch(batch, image, classes)
        steps, peaks = {}, {}
        for precision, dtype in dtypes.items():
            for system in ("graphpar", "eager"):
                before = torch.cuda.memory_allocated() if cuda else 0
                key = (system, precision)
                steps[key] = (graphpar_step(f"precision_{precision}_{batch}", graph_model, x, y, cuda,
                                            **options[precision]) if system == "graphpar" else
                              eager_step(eager_model(), x, y, device, dtype))
                for _ in range(warmup):
                    steps[key]()
                peaks[key] = _peak_bytes(steps[key], before, cuda)
        times = compare({f"{s} {p}": fn for (s, p), fn in steps.items()}, repeats=repeats, warmup=1)
        for (system, precision) in steps:
            seconds = median(times[f"{system} {precision}"])
            eager = median(times[f"eager {precision}"])
            rows.append({"batch": batch, "system": system, "precision": precision, "images_per_s": batch / seconds,
                         "vs_eager": eager / seconds, "peak_gib": None if peaks[(system, precision)] is None
                         else peaks[(system, precision)] / 2 ** 30})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, small ResNet-18 at 32x32 (what the test runs)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 64,256; quick: 8)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/precision.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([8] if args.quick else [64, 256])
    repeats = args.repeats or (3 if args.quick else 20)
    rows = run(args.quick, batches, repeats, warmup=1 if args.quick else 3)
    print(markdown_table(["batch", "system", "precision", "images/s", "x eager", "peak GiB"],
                         [[r["batch"], r["system"], r["precision"], r["images_per_s"], r["vs_eager"],
                           "n/a" if r["peak_gib"] is None else r["peak_gib"]] for r in rows]))
    if args.save:
        print(write_json("precision" + ("_quick" if args.quick else ""), {"rows": rows, "quick": args.quick}))
    return rows


if __name__ == "__main__":
    main()
