"""graphpar against eager PyTorch on one GPU: ResNet-50 (batch 64, 3x224x224) and the MLP 64-128-10 (batch 32).

Contenders, built in one process and timed alternately after warm-up (one SGD step with momentum 0.9
each, fp32, `torch.backends.cudnn.benchmark = True` for all):
- `eager`: the same architecture as an `nn.Module` (`benchmarks.eager_models`) + `torch.optim.SGD`;
- `eager + torch.compile`: the module compiled (default mode), when the compile fits the time
  budget (`--budget-s`); the time its warm-up took is reported;
- graphpar `simple` and `dag`: `Parallelize(devices=[0])` with that net type;
- graphpar `cuda_graph`: `Parallelize(..., cuda_graph=True)`; "not available" with the reason when
  Parallelize (or the capture) refuses it.

Per contender: median step ms (each sample times `--block` steps), images/s, resident memory (what it
keeps allocated between steps) and the step peak above everything resident
(`torch.cuda.max_memory_allocated`), and per step, from torch.profiler over 3 steps: host syncs
(`cudaStreamSynchronize`/`cudaDeviceSynchronize`/`cudaEventSynchronize`), host-to-device copies
(`Memcpy HtoD`, of which from pageable memory), device-to-device copies (`Memcpy DtoD`: SpatialBN's
running statistics outside CUDA graphs, docs/engine.md) and `aten::item` calls.

    python -m benchmarks.gpu [--save] [--models resnet50,mlp] [--repeats 15]
    python -m benchmarks.gpu --device cpu --quick      # a seconds-long smoke run of the same code

Without CUDA (and without `--device cpu`) it says so and exits with status 0. `--save` writes
benchmarks/results/gpu.json (CUDA runs only) with the device name and the torch version.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import eager_models
from benchmarks._common import compare, markdown_table, median, synchronize, write_json
from graphpar import models
from graphpar.model import model_helper, optimizer
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace

LR, MOMENTUM = 0.01, 0.9
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
PROFILED_STEPS = 3


@dataclass(frozen=True)
class Case:
    """A model in both forms, with its batch."""

    builder: Callable  # graphpar forward_pass_builder_fun
    module: Callable[[], torch.nn.Module]  # eager
    input_shape: tuple[int, ...]
    batch: int
    classes: int


def cases(quick: bool) -> dict[str, Case]:
    """The two models; `quick` shrinks ResNet-50 (width 8, batch 2, 32x32) for smoke runs."""
    width, batch, side, classes = (8, 2, 32, 10) if quick else (64, 64, 224, 1000)
    return {
        "resnet50": Case(functools.partial(models.resnet50, num_classes=classes, width=width),
                         functools.partial(eager_models.resnet50, 3, width, classes), (3, side, side), batch, classes),
        "mlp": Case(functools.partial(models.mlp, dim_in=64, hidden=(128,), num_classes=10),
                    functools.partial(eager_models.mlp, 64, (128,), 10), (64,), 32, 10),
    }


@dataclass
class Contender:
    step: Callable[[], None]
    resident: int | None = None  # bytes kept allocated between steps
    note: str = ""


def _batch(case: Case) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, *case.input_shape)).astype(np.float32)
    return x, rng.integers(0, case.classes, case.batch).astype(np.int32)


def eager(case: Case, device: torch.device, compiled: bool) -> Callable[[], None]:
    module = case.module().to(device)
    forward = torch.compile(module) if compiled else module
    opt = torch.optim.SGD(module.parameters(), LR, momentum=MOMENTUM)
    x, y = _batch(case)
    data, label = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(forward(data), label).backward()
        opt.step()

    return step


def graphpar(case: Case, device: torch.device, name: str, **options: Any) -> Callable[[], None]:
    """Parallelize on device 0 (in a workspace of its own), initialise, feed; one RunNet per call."""
    workspace.SwitchWorkspace(f"gpu_bench_{name}", create_if_missing=True)
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name=f"gpu_bench_{name}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=case.builder,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM),
                    devices=[0], cpu_device=device.type == "cpu", **options)
    prefix = model._device_prefix
    x, y = _batch(case)
    workspace.FeedBlob(f"{prefix}_0/data", x)
    workspace.FeedBlob(f"{prefix}_0/label", y)
    dpm.RunInitNet(model)
    ws, net = workspace.get_workspace(), model.net.Proto().name
    return lambda: ws.run_net(net)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def build(case: Case, device: torch.device, compile_skip: str | None, warmup: int) -> dict[str, Contender]:
    """Every contender of `case`, warmed up; a contender that cannot be built (or is skipped: torch.compile
    when `compile_skip` says why) gets a note instead."""
    makers: dict[str, Callable[[], Callable[[], None]]] = {
        "eager": functools.partial(eager, case, device, False),
        "eager + torch.compile": functools.partial(eager, case, device, True),
        "graphpar simple": functools.partial(graphpar, case, device, "simple", net_type="simple"),
        "graphpar dag": functools.partial(graphpar, case, device, "dag", net_type="dag"),
        "graphpar cuda_graph": functools.partial(graphpar, case, device, "cuda_graph", cuda_graph=True),
    }
    built: dict[str, Contender] = {}
    for name, make in makers.items():
        if name == "eager + torch.compile" and compile_skip:
            built[name] = Contender(step=None, note=compile_skip)
            continue
        before, start = _allocated(device), time.perf_counter()
        try:
            step = make()
            for _ in range(max(warmup, 2)):
                step()
            synchronize()
        except Exception as exc:  # reported, not raised: one refused contender must not end the run
            built[name] = Contender(step=None, note=f"not available: {type(exc).__name__}: {exc}"[:200])
            continue
        after = _allocated(device)
        took = time.perf_counter() - start
        note = f"build + warm-up {took:.0f} s" if name == "eager + torch.compile" else ""
        built[name] = Contender(step, None if before is None else after - before, note)
    return built


def step_peak(step: Callable[[], None], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one step above what was allocated before it."""
    if device.type != "cuda":
        return None
    synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def host_traffic(step: Callable[[], None], device: torch.device) -> dict[str, float]:
    """Per step, from torch.profiler: host syncs, host-to-device copies (and from pageable memory),
    device-to-device copies, `aten::item` calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        synchronize()
    counts = {"syncs": 0, "h2d": 0, "h2d_pageable": 0, "d2d": 0, "item": 0}
    for event in prof.key_averages():
        if event.key in SYNCS:
            counts["syncs"] += event.count
        elif event.key.startswith("Memcpy HtoD"):
            counts["h2d"] += event.count
            counts["h2d_pageable"] += event.count if "Pageable" in event.key else 0
        elif event.key.startswith("Memcpy DtoD"):
            counts["d2d"] += event.count
        elif event.key == "aten::item":
            counts["item"] += event.count
    return {k: v / PROFILED_STEPS for k, v in counts.items()}


def measure(case: Case, device: torch.device, opts: argparse.Namespace, compile_skip: str | None) -> dict[str, dict]:
    built = build(case, device, compile_skip, opts.warmup)
    running = {name: c for name, c in built.items() if c.step is not None}
    block = 1 if opts.quick else (3 if case.batch >= 64 else 20)

    def blocked(step: Callable[[], None]) -> Callable[[], None]:
        return lambda: [step() for _ in range(block)]

    times = compare({n: blocked(c.step) for n, c in running.items()}, repeats=opts.repeats, warmup=1)
    results: dict[str, dict] = {}
    for name, contender in built.items():
        if contender.step is None:
            results[name] = {"note": contender.note}
            continue
        seconds = median(times[name]) / block
        results[name] = {"step_ms": 1e3 * seconds, "images_per_s": case.batch / seconds,
                         "resident_mib": _mib(contender.resident),
                         "step_peak_mib": _mib(step_peak(contender.step, device)),
                         **host_traffic(contender.step, device), "note": contender.note}
    return results


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def table(results: dict[str, dict[str, dict]]) -> str:
    rows = []
    for model, per_contender in results.items():
        base = per_contender.get("eager", {})
        base_memory = _total(base)
        for name, r in per_contender.items():
            if "step_ms" not in r:
                rows.append((model, name, "-", "-", "-", "-", "-", "-", "-", "-", "-", r["note"]))
                continue
            ratio = r["step_ms"] / base["step_ms"] if "step_ms" in base else "-"
            memory = _total(r)
            rows.append((model, name, r["step_ms"], r["images_per_s"], ratio,
                         "n/a" if memory is None else f"{r['resident_mib']:.0f} + {r['step_peak_mib']:.0f}",
                         memory / base_memory if memory is not None and base_memory else "-",
                         r["syncs"], f"{r['h2d']:g} ({r['h2d_pageable']:g})", r["d2d"], r["item"], r["note"]))
    return markdown_table(["model", "contender", "step ms", "images/s", "vs eager", "resident + peak MiB",
                           "memory vs eager", "syncs/step", "H2D/step (pageable)", "D2D/step", "item/step", "note"],
                          rows)


def _total(r: dict) -> float | None:
    if r.get("resident_mib") is None or r.get("step_peak_mib") is None:
        return None
    return r["resident_mib"] + r["step_peak_mib"]


def run(opts: argparse.Namespace) -> dict[str, Any] | None:
    """Measure every model; None when there is no CUDA device to measure on."""
    if opts.device == "cuda" and not torch.cuda.is_available():
        return None
    device = torch.device(opts.device, 0) if opts.device == "cuda" else torch.device("cpu")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    start, results = time.perf_counter(), {}
    for name in opts.models.split(","):
        left = opts.budget_s - (time.perf_counter() - start)
        skip = ("skipped: --quick" if opts.quick else None if left > opts.compile_needs_s else
                f"skipped: {left:.0f} s of the budget left, compiling needs about {opts.compile_needs_s:.0f} s")
        results[name] = measure(cases(opts.quick)[name], device, opts, skip)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "quick": opts.quick, "repeats": opts.repeats,
            "results": results, "seconds": time.perf_counter() - start}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per contender (15; 2 quick)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=200.0, help="the whole run's time budget")
    parser.add_argument("--compile-needs-s", type=float, default=110.0,
                        help="try torch.compile for a model only while this much budget is left")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/gpu.json (CUDA only)")
    opts = parser.parse_args(argv)
    opts.repeats = opts.repeats or (2 if opts.quick else 15)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    payload = run(opts)
    if payload is None:
        print("benchmarks.gpu: no CUDA device here; nothing measured (run it on a GPU machine, or "
              "`--device cpu --quick` for a smoke run)")
        return 0
    print(f"{payload['device']}, torch {payload['torch']}, {payload['seconds']:.0f} s\n")
    print(table(payload["results"]))
    if opts.save and opts.device == "cuda":
        print(f"\nwrote {write_json('gpu', {'benchmark': 'gpu', **payload})}")
    elif opts.save:
        print("\nnot saved: a --device cpu run is a smoke run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
