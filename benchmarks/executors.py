"""Does the "dag" executor cost anything where it cannot win? "simple" against "dag", alternated.

On one device (and on CUDA devices, whose kernels launch asynchronously) worker threads cannot
overlap anything, so `"dag"` must be as fast as `"simple"` (issue 21, item 5). Each case creates one
net twice, as a "simple" and as a "dag" net, and alternates their RunNet calls in one process, after
warm-up; the table gives median µs per run and their ratio. The default clock is this process's CPU
time, all threads together (`--clock process`): a worker thread's hand-offs count, time the process
spends descheduled on a busy machine does not; `--clock wall` for wall-clock time. Kernels run on
`--threads` intra-op threads (default 1). Cases:

- the 1,000 tiny ops of `benchmarks.op_overhead` (rebinding net) on the CPU;
- the overhead-bound MLP and the CNN of `benchmarks.step_time` (SGD with momentum, `Parallelize` on
  one CPU device);
- the same MLP parallelized on one logical CUDA device placed on the CPU, with a stream backend that
  is active for every device and does nothing: what the dag's thread hand-offs and stream
  bookkeeping cost on the host, where a real GPU run would pay them (`executor.streams`);
- the same MLP as a `"cuda_graph"` net whose replay does nothing, against `"simple"`: the host time a
  captured step spends outside the graph (the host prologue, refreshing static inputs, the frame and
  commit), which a real replay adds to the graph's own launch; the "simple" column is the whole
  eager step, kernels included, for scale.

    python -m benchmarks.executors [--repeats 40] [--warmup 5] [--save]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from benchmarks import op_overhead, step_time
from benchmarks._common import compare, markdown_table, median, write_json
from graphpar.core import NetDef
from graphpar.executor.graphs import graph_backend
from graphpar.executor.streams import NoStreams, stream_backend
from graphpar.model import optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.parallel import data_parallel_model as dpm
from graphpar.platform.devices import cuda_on_cpu
from graphpar.runtime import workspace


class IdleStreams(NoStreams):
    """A stream backend that takes every device and does nothing (the host side of TorchStreams)."""

    def active(self, device: torch.device) -> bool:
        return True


class IdleGraphs:
    """A CUDA graph backend whose replay does nothing (the host side of a replayed step)."""

    def check(self, net_name: str, devices: object) -> None:
        return None

    def warming(self, devices: object) -> Any:
        return nullcontext()

    def capture(self, body: Callable[[], None], devices: object) -> Callable[[], None]:
        return lambda: None


def _two_nets(proto: NetDef, other: str = "dag") -> dict[str, str]:
    """Create `proto` as a "simple" net and as an `other` one; {type: net name}."""
    names = {}
    for net_type in ("simple", other):
        copy = proto.copy(f"{proto.name}_{net_type}")
        copy.type = net_type
        workspace.CreateNet(copy)
        names[net_type] = copy.name
    return names


def op_chain(ops: int) -> dict[str, str]:
    workspace.ResetWorkspace()
    rng = np.random.RandomState(0)
    workspace.FeedBlob("x", rng.rand(8).astype(np.float32))
    workspace.FeedBlob("y", (1.0 + 0.01 * rng.rand(8)).astype(np.float32))
    return _two_nets(op_overhead.build_net(ops, fresh_blobs=False))


def parallelized(case: step_time.Case, gpu: bool, other: str = "dag") -> dict[str, str]:
    """`case` parallelized on one device (CPU, or a logical CUDA device), fed one batch."""
    workspace.ResetWorkspace()
    rng = np.random.default_rng(0)
    model = ModelHelper(name="executors")

    def forward(m: ModelHelper, loss_scale: float) -> list[str]:
        pred = case.forward(m)
        return [m.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])[1]]

    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, step_time.LR, momentum=step_time.MOMENTUM),
                    devices=[0], cpu_device=not gpu)
    prefix = "gpu_0" if gpu else "cpu_0"
    workspace.FeedBlob(f"{prefix}/data", rng.standard_normal((case.batch, *case.input_shape)).astype(np.float32))
    workspace.FeedBlob(f"{prefix}/label", rng.integers(0, 10, case.batch).astype(np.int32))
    workspace.RunNetOnce(model.param_init_net)
    return _two_nets(model.net.Proto(), other)


@contextmanager
def logical_gpu() -> Iterator[None]:
    with cuda_on_cpu(), stream_backend(IdleStreams()):
        yield


@contextmanager
def idle_graphs() -> Iterator[None]:
    with cuda_on_cpu(), graph_backend(IdleGraphs()):
        yield


CASES: list[tuple[str, Callable[[], dict[str, str]], Callable[[], Any]]] = [
    ("1,000 tiny ops, CPU", lambda: op_chain(1000), nullcontext),
    ("MLP 64-128-10 b32, 1 CPU device", lambda: parallelized(step_time.CASES[0], gpu=False), nullcontext),
    ("CNN b32, 1 CPU device", lambda: parallelized(step_time.CASES[2], gpu=False), nullcontext),
    ("MLP 64-128-10 b32, 1 logical CUDA device, idle streams", lambda: parallelized(step_time.CASES[0], gpu=True),
     logical_gpu),
    ("MLP 64-128-10 b32, 1 logical CUDA device, cuda_graph with an idle replay",
     lambda: parallelized(step_time.CASES[0], gpu=True, other="cuda_graph"), idle_graphs),
]


def measure(build: Callable[[], dict[str, str]], context: Callable[[], Any], repeats: int,
            warmup: int, clock: Callable[[], float]) -> dict[str, float]:
    with ExitStack() as stack:
        stack.enter_context(context())
        names = build()
        times = compare({t: (lambda n=n: workspace.RunNet(n)) for t, n in names.items()},
                        repeats=repeats, warmup=warmup, clock=clock)
    other = next(t for t in names if t != "simple")
    simple, theirs = median(times["simple"]), median(times[other])
    return {"other": other, "simple_us": 1e6 * simple, "other_us": 1e6 * theirs, "ratio": theirs / simple}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clock", choices=("process", "wall"), default="process")
    parser.add_argument("--threads", type=int, default=1, help="the thread budget (GRAPHPAR_NUM_THREADS)")
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/ (tracked files: only when asked)")
    opts = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(opts.threads)
    clock = time.process_time if opts.clock == "process" else time.perf_counter
    results = {name: measure(build, context, opts.repeats, opts.warmup, clock) for name, build, context in CASES}
    rows = [(name, r["simple_us"], r["other"], r["other_us"], r["ratio"]) for name, r in results.items()]
    print(markdown_table(["case", "simple µs/run", "other", "other µs/run", "other / simple"], rows))
    if opts.save:
        path = write_json("executors", {"repeats": opts.repeats, "warmup": opts.warmup, "clock": opts.clock,
                                        "threads": opts.threads, "results": results})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
