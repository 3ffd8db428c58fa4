"""Per-op overhead of RunNet against the same torch calls in a plain Python loop.

A net of 1,000 tiny ops (Add, Mul, Relu, Scale in turn, on [8] float32 tensors, through the real
registered operators) runs through `workspace.RunNet`; eager baselines make the same torch calls in
a Python loop. Everything runs in one process, single-threaded, each net alternated with its eager
baseline, after warm-up; medians over repeats of this thread's CPU time (so a busy machine's
scheduling does not count) give microseconds per op and ratios (target: RunNet / eager <= 1.5).

Two nets, each against the eager loop with the same memory behaviour:
- "rebinding": every op writes blob `x` (in place), as `x = f(x)` does in the eager loop, so each
  intermediate is freed as soon as the next exists;
- "fresh blobs": op i writes `x{i+1}`, so 1,000 tensors stay alive, as in an eager loop that keeps
  every intermediate in a list. The last row compares this net with the rebinding eager loop: the
  extra cost there is that of holding 1,000 live tensors, not the executor's.

    python -m benchmarks.op_overhead [--ops 1000] [--repeats 40] [--warmup 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._common import compare, markdown_table, median, write_json
from graphpar.core import NetDef, OperatorDef
from graphpar.runtime import workspace

CYCLE = ("Add", "Mul", "Relu", "Scale")
SCALE = 0.5
Program = list[tuple[Callable[..., torch.Tensor], Any]]


def build_net(num_ops: int, fresh_blobs: bool) -> NetDef:
    """Op i applies CYCLE[i % 4] (Add and Mul with `y`) to the previous result."""
    ops = []
    for i in range(num_ops):
        op_type = CYCLE[i % len(CYCLE)]
        x_in, x_out = (f"x{i}", f"x{i + 1}") if fresh_blobs else ("x", "x")
        inputs = [x_in, "y"] if op_type in ("Add", "Mul") else [x_in]
        ops.append(OperatorDef(op_type, inputs, [x_out], {"scale": SCALE} if op_type == "Scale" else {}))
    return NetDef("op_overhead_fresh" if fresh_blobs else "op_overhead_rebind", ops)


def eager_program(num_ops: int, y: torch.Tensor) -> Program:
    """The net's torch calls as (function, second argument or None), in the same order."""
    calls = [(torch.add, y), (torch.mul, y), (torch.relu, None), (torch.mul, SCALE)]
    return [calls[i % len(calls)] for i in range(num_ops)]


def eager_loop(program: Program, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The program in a plain Python loop; each intermediate is freed as soon as the next exists."""
    def run() -> torch.Tensor:
        value = x
        for fn, arg in program:
            value = fn(value) if arg is None else fn(value, arg)
        return value

    return run


def eager_loop_keeping(program: Program, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same loop keeping every intermediate alive in a list, as a net's blobs are."""
    kept = [x] * (len(program) + 1)

    def run() -> torch.Tensor:
        for i, (fn, arg) in enumerate(program):
            kept[i + 1] = fn(kept[i]) if arg is None else fn(kept[i], arg)
        return kept[-1]

    return run


def _create(x: np.ndarray, num_ops: int, fresh_blobs: bool, expected: torch.Tensor) -> str:
    """Feed the input, create the net, check one run against eager; return the net's name."""
    net = build_net(num_ops, fresh_blobs)
    workspace.FeedBlob("x0" if fresh_blobs else "x", x)
    workspace.CreateNet(net)
    workspace.RunNet(net.name)
    torch.testing.assert_close(workspace.FetchTensor(f"x{num_ops}" if fresh_blobs else "x"), expected)
    return net.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/ (tracked files: only when asked)")
    opts = parser.parse_args()

    torch.set_num_threads(1)
    rng = np.random.RandomState(0)
    x = rng.rand(8).astype(np.float32)
    y = (1.0 + 0.01 * rng.rand(8)).astype(np.float32)  # keeps values in a normal float range
    workspace.FeedBlob("y", y)
    program = eager_program(opts.ops, torch.from_numpy(y))
    eager = eager_loop(program, torch.from_numpy(x))
    rebind = _create(x, opts.ops, fresh_blobs=False, expected=eager())
    fresh = _create(x, opts.ops, fresh_blobs=True, expected=eager())

    # Each net alternates with its own eager baseline: holding 1,000 live tensors in one candidate
    # changes the allocator's state for every other candidate alternated with it.
    times = {**compare({"RunNet, rebinding": lambda: workspace.RunNet(rebind), "eager loop": eager},
                       repeats=opts.repeats, warmup=opts.warmup, clock=time.thread_time),
             **compare({"RunNet, fresh blobs": lambda: workspace.RunNet(fresh),
                        "eager loop, kept": eager_loop_keeping(program, torch.from_numpy(x))},
                       repeats=opts.repeats, warmup=opts.warmup, clock=time.thread_time)}
    us = {name: median(t) / opts.ops * 1e6 for name, t in times.items()}
    cases = [("rebinding net vs eager loop", "RunNet, rebinding", "eager loop"),
             ("fresh-blob net vs eager loop keeping intermediates", "RunNet, fresh blobs", "eager loop, kept"),
             ("fresh-blob net vs eager loop (includes 1,000 live tensors)", "RunNet, fresh blobs", "eager loop")]
    rows = [[case, us[net], us[base], us[net] / us[base]] for case, net, base in cases]
    print(markdown_table(["case", "RunNet µs/op", "eager µs/op", "ratio"], rows))
    ratio = max(rows[0][3], rows[1][3])
    if opts.save:
        path = write_json("op_overhead", {
            "benchmark": "op_overhead", "num_ops": opts.ops, "repeats": opts.repeats, "warmup": opts.warmup,
            "tensor_shape": [8], "ops": list(CYCLE), "clock": "thread CPU time", "us_per_op_median": us,
            "ratios": {case: r for case, _, _, r in rows}, "ratio": ratio, "target_ratio": 1.5})
        print(f"wrote {path}")
    print(f"\nRunNet / eager, like for like: {ratio:.3f} (target <= 1.5)")


if __name__ == "__main__":
    main()
