"""The sparse all-gather: exact ops, values after running them, shared indices, the state rebound."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from graphpar import workspace
from graphpar.core.ir import GradientSlice, NetDef
from graphpar.core.schema import validate_net
from graphpar.errors import ParallelizeError
from graphpar.passes.sparse_allreduce import allgather_slice, allgather_slices
from tests.passes.helpers import cpu, gpu, layout, reducer, summary


def test_allgather_copies_to_the_first_device_concatenates_and_copies_back():
    lay = layout([4, 2], gpu=True)
    copies = {d: GradientSlice(f"gpu_{d}/idx", f"gpu_{d}/vals") for d in (4, 2)}
    ops, combined = allgather_slice("idx:vals", copies, reducer(lay), {})
    assert summary(ops) == [
        ("Copy", ["gpu_2/idx"], ["gpu_4/idx_gpu2_copy"], gpu(4), "", []),
        ("Concat", ["gpu_4/idx", "gpu_4/idx_gpu2_copy"], ["gpu_4/idx_concat", "gpu_4/idx_concat_split_info"],
         gpu(4), "", []),
        ("Copy", ["gpu_4/idx_concat"], ["gpu_2/idx_concat"], gpu(2), "", []),
        ("Copy", ["gpu_2/vals"], ["gpu_4/vals_gpu2_copy"], gpu(4), "", []),
        ("Concat", ["gpu_4/vals", "gpu_4/vals_gpu2_copy"], ["gpu_4/vals_concat", "gpu_4/vals_concat_split_info"],
         gpu(4), "", []),
        ("Copy", ["gpu_4/vals_concat"], ["gpu_2/vals_concat"], gpu(2), "", []),
    ]
    assert combined == {d: GradientSlice(f"gpu_{d}/idx_concat", f"gpu_{d}/vals_concat") for d in (4, 2)}
    assert [op.args.get("input_device_ids") for op in ops if op.type == "Copy"][0] == [2]


def test_the_concatenation_runs_and_an_empty_chunk_works():
    lay = layout([0, 1, 2])
    copies = {d: GradientSlice(f"cpu_{d}/i", f"cpu_{d}/v") for d in (0, 1, 2)}
    ops, combined = allgather_slice("i:v", copies, reducer(lay), {})
    net = NetDef("gather", ops)
    validate_net(net)
    feeds = {0: [3, 1], 1: [], 2: [1]}
    for d, rows in feeds.items():
        workspace.FeedBlob(f"cpu_{d}/i", np.array(rows, np.int64))
        workspace.FeedBlob(f"cpu_{d}/v", np.arange(len(rows) * 2, dtype=np.float32).reshape(-1, 2) + 10 * d)
    workspace.RunNetOnce(net)
    for d in (0, 1, 2):
        assert workspace.FetchBlob(combined[d].indices).tolist() == [3, 1, 1]
        assert workspace.FetchBlob(combined[d].values).tolist() == [[0, 1], [2, 3], [20, 21]]


def test_shared_indices_are_gathered_once_and_the_state_is_rebound():
    lay = layout([0, 1])
    grouped = {"idx:a_grad": {d: GradientSlice(f"cpu_{d}/idx", f"cpu_{d}/a_grad") for d in (0, 1)},
               "idx:b_grad": {d: GradientSlice(f"cpu_{d}/idx", f"cpu_{d}/b_grad") for d in (0, 1)}}
    model = SimpleNamespace(param_to_grad={f"cpu_{d}/{p}": grouped[f"idx:{p}_grad"][d] for d in (0, 1)
                                           for p in "ab"})
    state = SimpleNamespace(model=model, grouped=grouped, reducer=reducer(lay), layout=lay)
    ops = allgather_slices(state, ["idx:b_grad", "idx:a_grad"], {})
    assert [op.outputs[0] for op in ops if op.type == "Concat"] == ["cpu_0/idx_concat", "cpu_0/b_grad_concat",
                                                                   "cpu_0/a_grad_concat"]
    assert model.param_to_grad["cpu_1/a"] == GradientSlice("cpu_1/idx_concat", "cpu_1/a_grad_concat")
    assert grouped["idx:b_grad"][0] == GradientSlice("cpu_0/idx_concat", "cpu_0/b_grad_concat")


def test_a_dense_or_missing_copy_is_refused():
    lay = layout([0, 1])
    with pytest.raises(ParallelizeError, match="dense on \\[1\\]"):
        allgather_slice("i:v", {0: GradientSlice("cpu_0/i", "cpu_0/v"), 1: "cpu_1/v"}, reducer(lay), {})
    with pytest.raises(ParallelizeError, match="missing on \\[1\\]"):
        allgather_slice("i:v", {0: GradientSlice("cpu_0/i", "cpu_0/v")}, reducer(lay), {})


def test_nccl_reducer_gathers_with_copies():
    lay = layout([0, 1], gpu=True)
    ops, _ = allgather_slice("i:v", {d: GradientSlice(f"gpu_{d}/i", f"gpu_{d}/v") for d in (0, 1)},
                             reducer(lay, use_nccl=True), {})
    assert {op.type for op in ops} == {"Copy", "Concat"}
    assert cpu(0) not in {op.device_option for op in ops}
