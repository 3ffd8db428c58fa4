"""Sparse vs dense all-reduce and update of one embedding table, at several table sizes.

Each of `--devices` CPU replicas holds a [rows, dim] float32 table with its momentum and has looked
up `--lookups` rows (Zipf-skewed, duplicates included): its gradient is a slice of that many rows.
Two nets do the same step, built from the ops Parallelize emits:

- sparse: the slices are concatenated across replicas (Copy to the first, Concat, Copy back: the
  reducer's all-gather), then `SparseMomentumSGDUpdate` on each replica's table;
- dense: each replica densifies its slice (`SparseToDense`, what a dense embedding gradient costs),
  the dense gradients are all-reduced (Sum, Copy back), then `MomentumSGDUpdate` on each table.

Both give the same tables (checked). The table gives the bytes the cross-replica ops move and the
median step times (one process, alternated after warm-up); sparse wins once the table is much larger
than the lookups. With --save, results go to benchmarks/results/sparse.json.

    python -m benchmarks.sparse [--devices 4] [--dim 16] [--lookups 512] [--rows 1000 10000 100000 250000]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks._common import compare, markdown_table, median, write_json
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import Trait, has_trait
from graphpar.passes.common import DeviceLayout, make_op
from graphpar.passes.reducers import TreeReducer
from graphpar.runtime import workspace

MOMENTUM = 0.9


def _update_ops(layout: DeviceLayout, sparse: bool) -> list[OperatorDef]:
    ops = []
    for d in layout.devices:
        s = layout.scoped(d, "")
        if sparse:
            ops.append(make_op("SparseMomentumSGDUpdate", [s + "vals_concat", s + "mom", s + "lr", s + "table",
                                                          s + "idx_concat"],
                               [s + "vals_concat", s + "mom", s + "table"], layout.option(d), momentum=MOMENTUM))
        else:
            ops.append(make_op("MomentumSGDUpdate", [s + "grad", s + "mom", s + "lr", s + "table"],
                               [s + "grad", s + "mom", s + "table"], layout.option(d), momentum=MOMENTUM))
    return ops


def build(layout: DeviceLayout, sparse: bool) -> NetDef:
    """The step net: cross-replica combination of the gradient, then each replica's update."""
    reducer = TreeReducer(layout, {})
    group = {part: [layout.scoped(d, part) for d in layout.devices] for part in ("idx", "vals", "table", "grad")}
    if sparse:
        ops = [*reducer.allgather("idx", group["idx"], [b + "_concat" for b in group["idx"]]),
               *reducer.allgather("vals", group["vals"], [b + "_concat" for b in group["vals"]])]
    else:
        ops = [make_op("SparseToDense", [i, v, t], [g], layout.option(d))
               for d, i, v, t, g in zip(layout.devices, group["idx"], group["vals"], group["table"], group["grad"])]
        ops += reducer.allreduce("grad", group["grad"])
    return NetDef("sparse_step" if sparse else "dense_step", [*ops, *_update_ops(layout, sparse)])


def cross_device_bytes(net: NetDef, sizes: dict[str, int]) -> int:
    """Bytes read from another replica by the net's cross-device ops (every non-local input)."""
    total = 0
    for op in net.ops:
        if has_trait(op, Trait.CROSS_DEVICE) or op.name == "dpm":
            for blob, device in zip(op.inputs, op.args.get("input_device_ids", [])):
                total += sizes[blob] if device != op.device_option.device_id else 0
    return total


def feed(layout: DeviceLayout, rows: int, dim: int, lookups: int, seed: int = 0) -> dict[str, int]:
    """Fresh tables, momenta and slices; returns each blob's byte size (combined slices included)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    sizes = {}
    for d in layout.devices:
        s = layout.scoped(d, "")
        idx = ((rng.zipf(1.2, lookups) - 1) % rows).astype(np.int64)
        vals = rng.standard_normal((lookups, dim)).astype(np.float32)
        blobs = {"table": table, "mom": np.zeros_like(table), "lr": np.array([0.1], np.float32), "idx": idx,
                 "vals": vals}
        for name, value in blobs.items():
            workspace.FeedBlob(s + name, value.copy())
        sizes |= {s + "idx": idx.nbytes, s + "vals": vals.nbytes, s + "grad": table.nbytes,
                  s + "idx_concat": idx.nbytes * len(layout.devices),
                  s + "vals_concat": vals.nbytes * len(layout.devices)}
    return sizes


def _run(net: NetDef):  # noqa: ANN202
    return lambda: workspace.RunNet(net.name)


def measure(layout: DeviceLayout, rows: int, dim: int, lookups: int, repeats: int, warmup: int) -> dict:
    nets = {kind: build(layout, kind == "sparse") for kind in ("sparse", "dense")}
    tables = {}
    for kind, net in nets.items():
        sizes = feed(layout, rows, dim, lookups)
        workspace.CreateNet(net, overwrite=True)
        workspace.RunNet(net.name)
        tables[kind] = workspace.FetchBlob(layout.scoped(layout.devices[-1], "table"))
    np.testing.assert_allclose(tables["sparse"], tables["dense"], rtol=1e-5, atol=1e-6)
    times = compare({kind: _run(net) for kind, net in nets.items()}, repeats=repeats, warmup=warmup)
    return {"rows": rows, "table_mb": rows * dim * 4 / 2**20,
            "bytes_moved": {kind: cross_device_bytes(net, sizes) for kind, net in nets.items()},
            "step_ms": {kind: 1e3 * median(t) for kind, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lookups", type=int, default=512, help="rows looked up per replica")
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 10000, 100000, 250000])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--save", action="store_true",
                        help="also write benchmarks/results/sparse.json (a tracked file)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    layout = DeviceLayout(tuple(range(opts.devices)), "cpu")
    results = [measure(layout, rows, opts.dim, opts.lookups, opts.repeats, opts.warmup) for rows in opts.rows]
    print(f"{opts.devices} CPU replicas, {opts.lookups} lookups of dim {opts.dim} each, {opts.threads} thread(s)\n")
    print(markdown_table(
        ["rows", "table MB", "sparse MB moved", "dense MB moved", "sparse ms", "dense ms", "dense / sparse"],
        [[r["rows"], r["table_mb"], r["bytes_moved"]["sparse"] / 2**20, r["bytes_moved"]["dense"] / 2**20,
          r["step_ms"]["sparse"], r["step_ms"]["dense"], r["step_ms"]["dense"] / r["step_ms"]["sparse"]]
         for r in results]))
    if opts.save:
        path = write_json("sparse", {"devices": opts.devices, "dim": opts.dim, "lookups": opts.lookups,
                                     "repeats": opts.repeats, "warmup": opts.warmup, "threads": opts.threads,
                                     "results": results})
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
