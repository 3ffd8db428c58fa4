"""Reducers: the exact ops each one emits, with their inputs' devices named in the ops."""

from __future__ import annotations

import pytest

from graphpar.passes.reducers import NcclReducer, TreeReducer, make_reducer
from tests.passes.helpers import cpu, gpu, layout, summary


def _ids(ops):
    return [op.args.get("input_device_ids") for op in ops]


def test_make_reducer_picks_nccl_only_for_cuda_replicas_with_use_nccl():
    assert isinstance(make_reducer(layout([0, 1], gpu=True), {}, use_nccl=True), NcclReducer)
    assert isinstance(make_reducer(layout([0, 1], gpu=True), {}), TreeReducer)
    assert isinstance(make_reducer(layout([0, 1]), {}, use_nccl=True), TreeReducer)


def test_tree_allreduce_sums_onto_the_first_device_and_copies_back_naming_input_devices():
    lay = layout([7, 4, 9, 5], gpu=True)
    ops = make_reducer(lay, {}).allreduce("g", [lay.scoped(d, "g") for d in lay.devices])
    assert summary(ops) == [
        ("Sum", ["gpu_7/g", "gpu_4/g"], ["gpu_7/g"], gpu(7), "dpm", []),
        ("Sum", ["gpu_9/g", "gpu_5/g"], ["gpu_9/g"], gpu(9), "dpm", []),
        ("Sum", ["gpu_7/g", "gpu_9/g"], ["gpu_7/g"], gpu(7), "dpm", []),
        ("Copy", ["gpu_7/g"], ["gpu_4/g"], gpu(4), "", []),
        ("Copy", ["gpu_7/g"], ["gpu_9/g"], gpu(9), "", []),
        ("Copy", ["gpu_7/g"], ["gpu_5/g"], gpu(5), "", []),
    ]
    assert _ids(ops) == [[7, 4], [9, 5], [7, 9], [7], [7], [7]]


def test_tree_allreduce_copies_peers_without_p2p_access_to_the_root():
    lay = layout([0, 1], gpu=True)
    ops = make_reducer(lay, {}, peer_access=lambda a, b: a == b).allreduce("g", ["gpu_0/g", "gpu_1/g"], False)
    assert summary(ops) == [("Copy", ["gpu_1/g"], ["gpu_0/g_gpu1_copy"], gpu(0), "", []),
                            ("Sum", ["gpu_0/g", "gpu_0/g_gpu1_copy"], ["gpu_0/g"], gpu(0), "dpm", [])]
    assert _ids(ops) == [[1], [0, 0]]


def test_tree_broadcast_copies_onto_each_destination_device():
    lay = layout([2, 0, 1], gpu=True)
    ops = make_reducer(lay, {"gpu_0/it": cpu(0), "gpu_2/it": cpu(0)}).broadcast(lay.group("it"))
    assert summary(ops) == [("Copy", ["gpu_2/it"], ["gpu_0/it"], cpu(0), "", []),
                            ("Copy", ["gpu_2/it"], ["gpu_1/it"], gpu(1), "", [])]
    assert _ids(ops) == [[0], [0]]


def test_nccl_reducer_emits_one_inplace_collective_and_copies_host_blobs():
    lay = layout([3, 1], gpu=True)
    red = make_reducer(lay, {"gpu_3/it": cpu(0)}, use_nccl=True)
    (op,) = red.allreduce("w", ["gpu_3/w", "gpu_1/w"])
    assert summary([op]) == [("NCCLAllreduce", ["gpu_3/w", "gpu_1/w"], ["gpu_3/w", "gpu_1/w"], gpu(3), "", [])]
    assert op.args == {"input_device_ids": [3, 1]}
    (op,) = red.broadcast(lay.group("w"))
    assert summary([op]) == [("NCCLBroadcast", ["gpu_3/w", "gpu_1/w"], ["gpu_3/w", "gpu_1/w"], gpu(3), "", [])]
    assert op.args == {"root": 0, "input_device_ids": [3, 1]}
    assert [op.type for op in red.broadcast(lay.group("it"))] == ["Copy"]


@pytest.mark.parametrize("use_nccl", [False, True])
def test_one_device_needs_no_broadcast(use_nccl):
    lay = layout([4], gpu=True)
    assert make_reducer(lay, {}, use_nccl=use_nccl).broadcast(lay.group("w")) == []
