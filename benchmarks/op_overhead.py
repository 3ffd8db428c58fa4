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


def eager_loop(num_ops: int, x: torch.Tensor, y: torch.Tensor, keep: bool = False) -> Callable[[], torch.Tensor]:
    """The same torch calls as the net, in a plain Python loop.

    With `keep`, every intermediate stays alive in a list, as the net's blobs do: this separates
    the executor's own overhead from the cost of holding 1,000 live tensors.
    """
    calls = [(torch.add, True), (torch.mul, True), (torch.relu, False), (torch.mul, False)]
    program = [calls[i % len(calls)] for i in range(num_ops)]
    kept: list[torch.Tensor] = [x] * (num_ops + 1)

    def run() -> torch.Tensor:
        value = x
        for i, (fn, binary) in enumerate(program):
            value = fn(value, y) if binary else (fn(value) if fn is torch.relu else fn(value, SCALE))
            if keep:
                kept[i + 1] = value
        return value

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
    eager_inputs = torch.from_numpy(x), torch.from_numpy(y)
    eager = eager_loop(opts.ops, *eager_inputs)
    workspace.RunNet(net.name)
    torch.testing.assert_close(workspace.FetchTensor(f"x{opts.ops}"), eager())

    times = compare({"RunNet": lambda: workspace.RunNet(net.name), "eager loop": eager,
                     "eager loop, intermediates kept": eager_loop(opts.ops, *eager_inputs, keep=True)},
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
