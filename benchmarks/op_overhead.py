"""Per-op overhead of RunNet against the same torch calls in a plain Python loop.

A net of 1,000 tiny ops (Add, Mul, Relu, Scale in turn, on [8] float32 tensors, through the real
registered operators) runs through `workspace.RunNet`; the eager baseline makes the same torch calls
in a Python loop. Both run in one process, alternated, after warm-up; the medians over repeats give
microseconds per op and their ratio (target: RunNet / eager <= 1.5).

    python -m benchmarks.op_overhead [--ops 1000] [--repeats 30]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._common import compare, markdown_table, median, write_json
from graphpar import workspace
from graphpar.core import NetDef, OperatorDef

CYCLE = ("Add", "Mul", "Relu", "Scale")
SCALE = 0.5


def build_net(num_ops: int) -> NetDef:
    """x_{i+1} = Op_i(x_i[, y]) for Op_i cycling through CYCLE; every op writes a fresh blob."""
    ops = []
    for i in range(num_ops):
        op_type = CYCLE[i % len(CYCLE)]
        inputs = [f"x{i}", "y"] if op_type in ("Add", "Mul") else [f"x{i}"]
        args = {"scale": SCALE} if op_type == "Scale" else {}
        ops.append(OperatorDef(op_type, inputs, [f"x{i + 1}"], args))
    return NetDef("op_overhead", ops)


def eager_program(num_ops: int, y: torch.Tensor) -> list[tuple[Callable[..., torch.Tensor], Any]]:
    """The net's torch calls as (function, second argument or None), in the same order."""
    calls = [(torch.add, y), (torch.mul, y), (torch.relu, None), (torch.mul, SCALE)]
    return [calls[i % len(calls)] for i in range(num_ops)]


def eager_loop(program: list[tuple[Callable[..., torch.Tensor], Any]], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The program in a plain Python loop; each intermediate is freed as soon as the next exists."""
    def run() -> torch.Tensor:
        value = x
        for fn, arg in program:
            value = fn(value) if arg is None else fn(value, arg)
        return value

    return run


def eager_loop_keeping(program: list[tuple[Callable[..., torch.Tensor], Any]],
                       x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same loop keeping every intermediate alive, as a net's blobs are: this separates the
    executor's own overhead from the cost of holding 1,000 live tensors."""
    kept = [x] * (len(program) + 1)

    def run() -> torch.Tensor:
        for i, (fn, arg) in enumerate(program):
            kept[i + 1] = fn(kept[i]) if arg is None else fn(kept[i], arg)
        return kept[-1]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    opts = parser.parse_args()

    torch.set_num_threads(1)
    rng = np.random.RandomState(0)
    x = rng.rand(8).astype(np.float32)
    y = (1.0 + 0.01 * rng.rand(8)).astype(np.float32)  # keeps values in a normal float range
    workspace.FeedBlob("x0", x)
    workspace.FeedBlob("y", y)
    net = build_net(opts.ops)
    workspace.CreateNet(net)
    x_tensor, program = torch.from_numpy(x), eager_program(opts.ops, torch.from_numpy(y))
    eager = eager_loop(program, x_tensor)
    workspace.RunNet(net.name)
    torch.testing.assert_close(workspace.FetchTensor(f"x{opts.ops}"), eager())

    times = compare({"RunNet": lambda: workspace.RunNet(net.name), "eager loop": eager,
                     "eager loop, intermediates kept": eager_loop_keeping(program, x_tensor)},
                    repeats=opts.repeats, warmup=opts.warmup)
    per_op = {name: median(t) / opts.ops * 1e6 for name, t in times.items()}
    ratio = per_op["RunNet"] / per_op["eager loop"]
    print(markdown_table(["path", "µs/op (median)", "ratio to eager"],
                         [[name, us, us / per_op["eager loop"]] for name, us in per_op.items()]))
    path = write_json("op_overhead", {
        "benchmark": "op_overhead", "num_ops": opts.ops, "repeats": opts.repeats, "warmup": opts.warmup,
        "tensor_shape": [8], "ops": list(CYCLE), "us_per_op": per_op, "ratio": ratio, "target_ratio": 1.5})
    print(f"\nratio RunNet / eager = {ratio:.3f} (target <= 1.5); wrote {path}")


if __name__ == "__main__":
    main()
