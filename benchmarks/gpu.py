"""graphpar against eager PyTorch on one GPU: the figures issue 31's goals need, in one budgeted run.

Cases, each a set of contenders built in one process and timed alternately after warm-up (one SGD step
with momentum 0.9, `torch.backends.cudnn.benchmark = True` for all):
- `mlp` (64-128-10, batch 32) and `resnet50` (batch 64, 3x224x224), fp32: `eager` (the same
  architecture as an `nn.Module`, `benchmarks.eager_models`, + `torch.optim.SGD`), graphpar `simple`,
  `dag` and `cuda_graph` (`Parallelize(devices=[0])`, the batch fed once), and graphpar's `Trainer`
  (its lean-memory default, numpy batches fed every step; on the MLP also through a `DeviceFeeder`);
- `resnet50_bf16` (batch 64): eager `torch.autocast(bfloat16)` + channels-last against graphpar
  `compute_dtype="bfloat16", channels_last=True` (`dag`, `cuda_graph`);
- `mlp_2_replicas`, `resnet50_2_replicas` (each replica a half batch): the dag executor launching from
  one thread (its default on CUDA devices) against worker threads, on two GPUs when there are two,
  else on two replicas a device map puts on GPU 0;
- `eager + torch.compile` of `mlp` and `resnet50`, last, each in a subprocess under its own time limit
  (ResNet-50 alone compiled 62.8 s on an H100): a compile that runs out of time loses only itself.

Per contender: median step ms (each sample times a block of steps), images/s, memory (below), and per
step: host syncs, counted by `torch.cuda.set_sync_debug_mode("warn")` over steady steps (each
synchronizing CUDA call warns; nothing of the benchmark's runs inside that window), and, from
torch.profiler with the profile of an empty body subtracted, host-to-device copies (of which from
pageable memory), device-to-host and device-to-device copies. Memory: resident (what the contender
keeps allocated between steps: allocated after its build minus before; for a CUDA graph plus its
private pool's reserved segments) and step peak (`max_memory_allocated` during one step minus what
was allocated before it, `reset_peak_memory_stats` first), each measured for the contender alone.

Each row is printed as it is measured, and `--out` (with `--save`: benchmarks/results/gpu.json) is
rewritten after every contender with `"partial": true`, then once more at the end without it: a run
stopped by a time limit keeps every figure measured so far. A case that would start after `--budget-s`
is skipped, with the reason in its rows.

    python -m benchmarks.gpu [--save | --out PATH] [--cases mlp,resnet50,...] [--budget-s 170]
    python -m benchmarks.gpu --smoke [--out PATH]    # seconds: the same code on logical CUDA devices

`--smoke` runs every path on the CPU: graphpar's replicas are logical CUDA devices placed on the CPU,
a stand-in replays the captured step, models are tiny (a LeNet stands in for ResNet-50), and
torch.compile uses its `eager` backend.
Without CUDA (and without `--smoke`) it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import eager_models
from benchmarks._common import RESULTS_DIR, compare, environment, markdown_table, median
from graphpar import models
from graphpar.executor import dag
from graphpar.executor.graphs import graph_backend
from graphpar.model import model_helper, optimizer
from graphpar.parallel import data_parallel_model as dpm
from graphpar.platform import devices as gp_devices
from graphpar.runtime import workspace
from graphpar.training.data import feed
from graphpar.training.engine import Trainer
from graphpar.training.feeder import DeviceFeeder

LR, MOMENTUM = 0.01, 0.9
SYNC_WARNING = "called a synchronizing CUDA operation"
COPIES = {"h2d": "Memcpy HtoD", "d2h": "Memcpy DtoH", "d2d": "Memcpy DtoD"}
TRAFFIC_STEPS = 3
COMPILED = "eager + torch.compile"


# ---- what is measured ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """A model in both forms, its batch, and what its contenders are."""

    builder: Callable  # graphpar forward_pass_builder_fun
    module: Callable[[], torch.nn.Module]  # eager
    input_shape: tuple[int, ...]
    batch: int
    classes: int
    contenders: tuple[str, ...]
    bf16: bool = False  # eager under autocast(bfloat16) + channels-last; graphpar compute_dtype + channels_last
    replicas: int = 1


FP32 = ("eager", "graphpar simple", "graphpar dag", "graphpar cuda_graph", "graphpar Trainer (lean, numpy batches)")
THREADS = ("graphpar dag, one launching thread", "graphpar dag, worker threads")


SMOKE_CASES = "mlp,resnet50_bf16,mlp_2_replicas,mlp:compile"  # every path once


def cases(smoke: bool) -> dict[str, Case]:
    """Every case (`smoke`: tiny sizes, and a LeNet of 4 and 8 channels on 1x16x16 for ResNet-50:
    bf16 convolutions are emulated on a CPU, a tiny ResNet-50 takes seconds per step there)."""
    width, batch, side, classes = (8, 2, 16, 10) if smoke else (64, 64, 224, 1000)
    resnet = functools.partial(models.resnet50, num_classes=classes, width=width)
    eager_resnet = functools.partial(eager_models.resnet50, 3, width, classes)
    shape = (3, side, side)
    if smoke:
        resnet = functools.partial(models.lenet, in_channels=1, image_size=side, channels=(4, 8), hidden=16)
        eager_resnet = functools.partial(eager_models.lenet, 1, side, (4, 8), 16, classes)
        shape = (1, side, side)
    mlp = functools.partial(models.mlp, dim_in=64, hidden=(128,), num_classes=10)
    eager_mlp = functools.partial(eager_models.mlp, 64, (128,), 10)
    return {
        "mlp": Case(mlp, eager_mlp, (64,), 32, 10, (*FP32, "graphpar Trainer (lean, DeviceFeeder)")),
        "resnet50": Case(resnet, eager_resnet, shape, batch, classes, FP32),
        "resnet50_bf16": Case(resnet, eager_resnet, shape, batch, classes,
                              ("eager", "graphpar dag", "graphpar cuda_graph"), bf16=True),
        "mlp_2_replicas": Case(mlp, eager_mlp, (64,), 32, 10, THREADS, replicas=2),
        "resnet50_2_replicas": Case(resnet, eager_resnet, shape, batch, classes, THREADS, replicas=2),
    }


@dataclass
class Contender:
    step: Callable[[], None] | None
    resident: int | None = None  # bytes kept allocated between steps
    note: str = ""


@dataclass(frozen=True)
class Machine:
    """Where the run happens: a GPU, or (smoke) logical CUDA devices on the CPU."""

    device: torch.device
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def graph_pools(self) -> tuple[int, int]:
        """(reserved, allocated) bytes of the segments CUDA graphs' private pools hold on the device."""
        if not self.cuda:
            return 0, 0
        segments = [s for s in torch.cuda.memory_snapshot()
                    if s.get("device") == self.device.index and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
        return sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments)

    def sync_mode(self, mode: str) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(mode)


# ---- counting ----------------------------------------------------------------------------------------

def count_syncs(step: Callable[[], None], steps: int, set_mode: Callable[[str], None]) -> float:
    """Synchronizing CUDA calls per step: `set_mode("warn")` makes each one warn (torch's sync debug
    mode); the warnings of `steps` steps are counted. Nothing else runs inside that window."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            set_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught) / steps


def copies(table: Iterable[tuple[str, int]], baseline: Iterable[tuple[str, int]], steps: int) -> dict[str, float]:
    """Copies per step from a profiler table of (event name, count), less an empty body's table:
    h2d (and h2d_pageable: from pageable host memory, which makes the stream wait), d2h, d2d."""
    counts = dict.fromkeys((*COPIES, "h2d_pageable"), 0)
    for rows, sign in ((table, 1), (baseline, -1)):
        for key, count in rows:
            for name, prefix in COPIES.items():
                if key.startswith(prefix):
                    counts[name] += sign * count
                    if name == "h2d" and "Pageable" in key:
                        counts["h2d_pageable"] += sign * count
    return {name: max(0, value) / steps for name, value in counts.items()}


def _profile(machine: Machine, body: Callable[[], None]) -> list[tuple[str, int]]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if machine.cuda else [])
    with profile(activities=activities) as prof:
        body()
    return [(event.key, event.count) for event in prof.key_averages()]


def traffic(machine: Machine, step: Callable[[], None], opts: argparse.Namespace) -> dict[str, float]:
    """Syncs (over `opts.sync_steps` steps: a Trainer reads its losses every 20) and copies per steady
    step (see the module docstring)."""
    machine.synchronize()
    syncs = count_syncs(step, opts.sync_steps, machine.sync_mode)
    machine.synchronize()
    table = _profile(machine, lambda: [step() for _ in range(TRAFFIC_STEPS)])
    return {"syncs": syncs, **copies(table, _empty_profile(machine), TRAFFIC_STEPS)}


@functools.cache
def _empty_profile(machine: Machine) -> tuple[tuple[str, int], ...]:
    """What the profiler records around an empty body (once per run)."""
    return tuple(_profile(machine, lambda: None))


def step_peak(machine: Machine, step: Callable[[], None]) -> int | None:
    """Bytes allocated at the peak of one step above what was allocated before it."""
    if not machine.cuda:
        return None
    machine.synchronize()
    base = torch.cuda.memory_allocated(machine.device)
    torch.cuda.reset_peak_memory_stats(machine.device)
    step()
    machine.synchronize()
    return torch.cuda.max_memory_allocated(machine.device) - base


# ---- the contenders ------------------------------------------------------------------------------------

def _batch(case: Case) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, *case.input_shape)).astype(np.float32)
    return x, rng.integers(0, case.classes, case.batch).astype(np.int32)


def eager(case: Case, machine: Machine, compile_backend: str | None = None) -> Callable[[], None]:
    """The eager step (`compile_backend`: of the module compiled with that torch.compile backend)."""
    device = torch.device("cpu") if machine.smoke else machine.device
    module = case.module().to(device)
    x, y = _batch(case)
    data, label = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    if case.bf16:
        module, data = module.to(memory_format=torch.channels_last), data.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(module.parameters(), LR, momentum=MOMENTUM)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=case.bf16)
    forward = module if compile_backend is None else torch.compile(module, backend=compile_backend)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = F.cross_entropy(forward(data), label)
        loss.backward()
        opt.step()

    return step


def _replicas(case: Case, machine: Machine) -> tuple[list[int], Any]:
    """The device ids of `case`'s replicas and the device map context they need (two on one GPU)."""
    ids = list(range(case.replicas))
    shared = case.replicas > 1 and machine.cuda and torch.cuda.device_count() < case.replicas
    return ids, (gp_devices.device_map([0] * case.replicas) if shared else contextlib.nullcontext())


def _parallelized(case: Case, machine: Machine, name: str, ids: list[int], **options: Any) -> model_helper.ModelHelper:
    workspace.SwitchWorkspace(f"gpu_bench_{name}", create_if_missing=True)
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name=f"gpu_bench_{name}")
    if case.bf16:
        options.update(compute_dtype="bfloat16", channels_last=True)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=case.builder,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, LR, momentum=MOMENTUM),
                    devices=ids, **options)
    return model


def _in_workspace(name: str, run: Callable[[], None], context: Callable[[], Any] = contextlib.nullcontext
                  ) -> Callable[[], None]:
    """`run` in workspace `name` (each contender has its own) inside `context`."""
    def step() -> None:
        workspace.SwitchWorkspace(name)
        with context():
            run()

    return step


def graphpar(case: Case, machine: Machine, name: str, threads: bool = False, **options: Any) -> Callable[[], None]:
    """Parallelize, initialise, feed once; one RunNet per call (`threads`: the dag on worker threads)."""
    ids, mapped = _replicas(case, machine)
    with mapped:
        model = _parallelized(case, machine, name, ids, **options)
        x, y = _batch(case)
        feed(model, {"data": x, "label": y})
        dpm.RunInitNet(model)
    ws_name, net = workspace.CurrentWorkspace(), model.net.Proto().name
    run = functools.partial(workspace.get_workspace().run_net, net)

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replicas(case, machine)[1])
            if threads:
                stack.enter_context(_patched(dag, "one_launching_thread", lambda *args: False))
            yield

    return _in_workspace(ws_name, run, context)


def trainer(case: Case, machine: Machine, name: str, feeder: bool = False) -> Callable[[], None]:
    """The Trainer (its defaults: lean memory on CUDA) over numpy batches, fed every step (`feeder`:
    through a DeviceFeeder); one iteration per call."""
    model = _parallelized(case, machine, name, [0])
    x, y = _batch(case)
    batches: Iterable[Any] = [{"data": x, "label": y}] * 16
    if feeder:
        batches = DeviceFeeder(batches, model)
    run = Trainer(model, batches, max_iter=1 << 30)
    run.initialize()
    return _in_workspace(workspace.CurrentWorkspace(), run.run_step)


@contextlib.contextmanager
def _patched(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    old = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, old)


def makers(case: Case, machine: Machine) -> dict[str, Callable[[], Callable[[], None]]]:
    every = {
        "eager": functools.partial(eager, case, machine),
        "graphpar simple": functools.partial(graphpar, case, machine, "simple", net_type="simple"),
        "graphpar dag": functools.partial(graphpar, case, machine, "dag", net_type="dag"),
        "graphpar cuda_graph": functools.partial(graphpar, case, machine, "cuda_graph", cuda_graph=True),
        "graphpar Trainer (lean, numpy batches)": functools.partial(trainer, case, machine, "trainer"),
        "graphpar Trainer (lean, DeviceFeeder)": functools.partial(trainer, case, machine, "feeder", feeder=True),
        "graphpar dag, one launching thread": functools.partial(graphpar, case, machine, "one_thread"),
        "graphpar dag, worker threads": functools.partial(graphpar, case, machine, "threads", threads=True),
    }
    return {name: every[name] for name in case.contenders}


def build(name: str, make: Callable[[], Callable[[], None]], machine: Machine, warmup: int) -> Contender:
    """One contender, built and warmed up; its resident memory; a note instead when it cannot be built."""
    machine.synchronize()
    before, pools = machine.allocated(), machine.graph_pools()
    try:
        step = make()
        for _ in range(max(warmup, 3)):  # a CUDA graph captures at the third run
            step()
        machine.synchronize()
    except Exception as exc:  # reported, not raised: one refused contender must not end the run
        return Contender(step=None, note=f"not available: {type(exc).__name__}: {exc}"[:300])
    if before is None:
        return Contender(step)
    (reserved, allocated), (reserved_before, allocated_before) = machine.graph_pools(), pools
    # a graph's pool counts whole (its intermediates stay reserved there), its live tensors once
    resident = machine.allocated() - before - (allocated - allocated_before) + (reserved - reserved_before)
    return Contender(step, resident)


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20


# ---- the run --------------------------------------------------------------------------------------------

class Report:
    """The results so far; each contender's row is printed and the JSON rewritten as it is measured."""

    def __init__(self, machine: Machine, out: Path | None) -> None:
        self.machine, self.out, self.start = machine, out, time.perf_counter()
        self.results: dict[str, dict[str, dict]] = {}
        name = torch.cuda.get_device_name(machine.device) if machine.cuda else "cpu (logical CUDA devices)"
        self.head = {"benchmark": "gpu", "device": name, "torch": torch.__version__, "smoke": machine.smoke}

    def add(self, case: str, contender: str, row: dict) -> None:
        self.results.setdefault(case, {})[contender] = row
        print(table({case: {contender: row}}, header=False), flush=True)
        self.write(partial=True)

    def write(self, partial: bool) -> None:
        if self.out is None:
            return
        payload = {**self.head, "partial": partial, "seconds": time.perf_counter() - self.start,
                   "results": self.results, "environment": environment()}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.out.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(temporary, self.out)  # never a half-written file


def measure_case(name: str, case: Case, machine: Machine, opts: argparse.Namespace, report: Report) -> None:
    built = {contender: build(contender, make, machine, opts.warmup) for contender, make in makers(case, machine).items()}
    running = {n: c for n, c in built.items() if c.step is not None}
    block = _block(case, opts)
    times = compare({n: (lambda step=c.step: [step() for _ in range(block)]) for n, c in running.items()},
                    repeats=opts.repeats, warmup=1)
    for contender, c in built.items():
        if c.step is None:
            report.add(name, contender, {"note": c.note})
            continue
        seconds = median(times[contender]) / block
        report.add(name, contender, {
            "step_ms": 1e3 * seconds, "images_per_s": case.batch / seconds, "resident_mib": _mib(c.resident),
            "step_peak_mib": _mib(step_peak(machine, c.step)), **traffic(machine, c.step, opts), "note": c.note})
    built.clear()
    running.clear()
    gc.collect()
    if machine.cuda:
        torch.cuda.empty_cache()


def compile_in_subprocess(name: str, opts: argparse.Namespace, seconds: float) -> dict:
    """`eager + torch.compile` of case `name`, measured in a process of its own within `seconds`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(opts.compile_out)
    argv = [sys.executable, "-m", "benchmarks.gpu", "--compile-only", name, "--out", str(opts.compile_out),
            "--repeats", str(opts.repeats), *(["--smoke"] if opts.smoke else [])]
    # the checkout's benchmarks package whatever the working directory (graphpar's install has only graphpar)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # a session of its own: at the limit its whole group goes (inductor's compile workers too)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as process:
        try:
            _, stderr = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return {"note": f"not measured: the compile and its steps did not finish within {seconds:.0f} s"}
    if process.returncode != 0 or not Path(opts.compile_out).exists():
        return {"note": f"not measured: exit status {process.returncode}: {stderr.strip()[-300:]}"}
    row = json.loads(Path(opts.compile_out).read_text())
    os.unlink(opts.compile_out)
    return row


def compile_only(name: str, machine: Machine, opts: argparse.Namespace) -> dict:
    """The measurement `compile_in_subprocess` runs: the compiled module, built, warmed up, timed."""
    case = cases(opts.smoke)[name]
    backend = "eager" if opts.smoke else "inductor"  # smoke: dynamo's tracing only, in seconds
    start = time.perf_counter()
    contender = build(COMPILED, functools.partial(eager, case, machine, backend), machine, opts.warmup)
    took = time.perf_counter() - start
    if contender.step is None:
        return {"note": contender.note}
    block = _block(case, opts)
    step = contender.step
    times = compare({COMPILED: lambda: [step() for _ in range(block)]}, repeats=opts.repeats, warmup=1)
    seconds = median(times[COMPILED]) / block
    return {"step_ms": 1e3 * seconds, "images_per_s": case.batch / seconds, "resident_mib": _mib(contender.resident),
            "step_peak_mib": _mib(step_peak(machine, step)), **traffic(machine, step, opts),
            "note": f"torch.compile(backend={backend!r}): build + compile + warm-up {took:.0f} s"}


def _block(case: Case, opts: argparse.Namespace) -> int:
    """Steps per timed sample: enough that a sample is not one short step's noise."""
    return 1 if opts.smoke else (3 if case.batch >= 64 else 20)


def run(opts: argparse.Namespace) -> dict[str, Any] | None:
    """Every case within the budget, then the compiles; None when there is no GPU (and no --smoke)."""
    if not opts.smoke and not torch.cuda.is_available():
        return None
    machine = Machine(torch.device("cpu") if opts.smoke else torch.device("cuda", 0), opts.smoke)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    if opts.smoke:
        torch.set_num_threads(1)  # a smoke run checks paths; intra-op threads only wait on a shared CPU
    report = Report(machine, opts.out)
    chosen = opts.cases.split(",")
    every = cases(opts.smoke)
    with contextlib.ExitStack() as stack:
        if opts.smoke:
            stack.enter_context(gp_devices.cuda_on_cpu())
            stack.enter_context(graph_backend(ReplayBody()))
        print(table({}, header=True), flush=True)
        for name in chosen:
            if name.endswith(":compile"):
                continue
            left = opts.budget_s - (time.perf_counter() - report.start)
            if left < opts.case_needs_s:
                for contender in every[name].contenders:
                    report.add(name, contender, {"note": f"skipped: {max(left, 0):.0f} s of the budget left"})
                continue
            measure_case(name, every[name], machine, opts, report)
    for name in [n.removesuffix(":compile") for n in chosen if n.endswith(":compile")]:
        left = opts.budget_s - (time.perf_counter() - report.start)
        row = (compile_in_subprocess(name, opts, min(left, opts.compile_timeout_s)) if left > 10
               else {"note": f"skipped: {max(left, 0):.0f} s of the budget left"})
        report.add(name, COMPILED, row)
    report.write(partial=False)
    return {**report.head, "results": report.results, "seconds": time.perf_counter() - report.start}


class ReplayBody:
    """The smoke run's CUDA-graph stand-in: the capture records nothing and the replay runs the body."""

    def check(self, net_name: str, devices: object) -> None:
        return None

    def warming(self, devices: object) -> Any:
        return contextlib.nullcontext()

    def capture(self, body: Callable[[], None], devices: object) -> Callable[[], None]:
        return body


# ---- output -----------------------------------------------------------------------------------------------

HEADERS = ["case", "contender", "step ms", "images/s", "resident + peak MiB", "syncs/step",
           "H2D/step (pageable)", "D2H/step", "D2D/step", "note"]


def table(results: Mapping[str, Mapping[str, dict]], header: bool = True) -> str:
    rows = []
    for case, per_contender in results.items():
        for name, r in per_contender.items():
            if "step_ms" not in r:
                rows.append((case, name, *["-"] * 7, r["note"]))
                continue
            memory = ("n/a" if r.get("resident_mib") is None or r.get("step_peak_mib") is None
                      else f"{r['resident_mib']:.0f} + {r['step_peak_mib']:.0f}")
            rows.append((case, name, r["step_ms"], r["images_per_s"], memory, r["syncs"],
                         f"{r['h2d']:g} ({r['h2d_pageable']:g})", r["d2h"], r["d2d"], r["note"]))
    text = markdown_table(HEADERS, rows)
    return text if header else "\n".join(text.splitlines()[2:])


def ratios(results: Mapping[str, Mapping[str, dict]]) -> str:
    """Each contender's step time and memory against its case's eager, or its first contender (one
    launching thread) where there is no eager: the goals are ratios."""
    rows = []
    for case, per_contender in results.items():
        first = "eager" if "eager" in per_contender else next(iter(per_contender))
        base = per_contender[first]
        for name, r in per_contender.items():
            if name == first or "step_ms" not in r or "step_ms" not in base:
                continue
            memory = [x.get("resident_mib", None) for x in (r, base)]
            peak = [x.get("step_peak_mib", None) for x in (r, base)]
            total = (None if None in memory or None in peak else (memory[0] + peak[0]) / (memory[1] + peak[1]))
            rows.append((case, name, r["step_ms"] / base["step_ms"], "-" if total is None else total))
    return markdown_table(["case", "contender", "time vs base", "memory vs base"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None,
                        help="cases in order (default: all; smoke: " + SMOKE_CASES + "); NAME:compile adds "
                             "`eager + torch.compile` of NAME (run last)")
    parser.add_argument("--smoke", action="store_true", help="every path on the CPU, tiny sizes (seconds)")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per contender (9; smoke 2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=170.0, help="no case starts after this many seconds")
    parser.add_argument("--case-needs-s", type=float, default=15.0, help="a case starts only with this much left")
    parser.add_argument("--compile-timeout-s", type=float, default=100.0, help="the limit of one compile's process")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/gpu.json (not with --smoke)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (after every contender)")
    parser.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    opts.cases = opts.cases or (SMOKE_CASES if opts.smoke else ",".join([*cases(False), "mlp:compile",
                                                                          "resnet50:compile"]))
    opts.repeats = opts.repeats or (2 if opts.smoke else 9)
    opts.sync_steps = 3 if opts.smoke else 20
    if opts.save and not opts.smoke and opts.out is None:
        opts.out = RESULTS_DIR / "gpu.json"
    opts.compile_out = Path(f"{opts.out or RESULTS_DIR / 'gpu.json'}.compile")
    unknown = {n.removesuffix(":compile") for n in opts.cases.split(",")} - set(cases(False))
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {sorted(cases(False))}")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.compile_only:
        machine = Machine(torch.device("cpu") if opts.smoke else torch.device("cuda", 0), opts.smoke)
        torch.backends.cudnn.benchmark = True
        opts.out.write_text(json.dumps(compile_only(opts.compile_only, machine, opts)))
        return 0
    payload = run(opts)
    if payload is None:
        print("benchmarks.gpu: no CUDA device here; nothing measured (run it on a GPU machine, or --smoke)")
        return 0
    print(f"\n{payload['device']}, torch {payload['torch']}, {payload['seconds']:.0f} s\n")
    print(ratios(payload["results"]))
    measured = sum("step_ms" in r for rows in payload["results"].values() for r in rows.values())
    rows = sum(len(rows) for rows in payload["results"].values())
    print(f"\nbenchmarks.gpu: {measured} of {rows} contenders measured in {payload['seconds']:.0f} s"
          f"{f'; wrote {opts.out}' if opts.out is not None else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
