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


# ---- sharded state: reduce_scatter, gather_shards, scatter_shards -------------------------------------


def test_tree_reduce_scatter_sums_each_part_with_the_allreduce_tree_on_its_owner():
    lay = layout([7, 4, 9, 5], gpu=True)
    group = [lay.scoped(d, "g") for d in lay.devices]
    ops = make_reducer(lay, {}).reduce_scatter("g", group, [f"{b}_shard" for b in group], [3, 3, 2, 2])
    assert summary(ops[:2]) == [
        ("FlattenToVec", ["gpu_7/g"], ["gpu_7/g_flat"], gpu(7), "", []),
        ("Split", ["gpu_7/g_flat"], [f"gpu_7/g_part_{k}" for k in range(4)], gpu(7), "", [])]
    assert ops[1].args == {"axis": 0, "split": [3, 3, 2, 2]}
    sums = ops[8:]
    assert [op.type for op in sums] == ["Sum"] * 12 and {op.name for op in sums} == {"dpm"}
    # part 1 (device 4's): ((0 + 1) + (2 + 3)) over positions, as the all-reduce's tree, every Sum on device 4
    assert summary(sums[3:6]) == [
        ("Sum", ["gpu_7/g_part_1", "gpu_4/g_part_1"], ["gpu_4/g_shard_sum_0"], gpu(4), "dpm", []),
        ("Sum", ["gpu_9/g_part_1", "gpu_5/g_part_1"], ["gpu_4/g_shard_sum_2"], gpu(4), "dpm", []),
        ("Sum", ["gpu_4/g_shard_sum_0", "gpu_4/g_shard_sum_2"], ["gpu_4/g_shard"], gpu(4), "dpm", [])]
    assert _ids(sums[3:6]) == [[7, 4], [9, 5], [4, 4]]


def test_tree_reduce_scatter_copies_parts_without_p2p_access_to_their_owner():
    lay = layout([0, 1], gpu=True)
    red = make_reducer(lay, {}, peer_access=lambda a, b: a == b)
    ops = red.reduce_scatter("g", ["gpu_0/g", "gpu_1/g"], ["gpu_0/g_shard", "gpu_1/g_shard"], [2, 1])
    assert summary(ops[4:]) == [
        ("Copy", ["gpu_1/g_part_0"], ["gpu_0/g_shard_gpu1_copy"], gpu(0), "", []),
        ("Sum", ["gpu_0/g_part_0", "gpu_0/g_shard_gpu1_copy"], ["gpu_0/g_shard"], gpu(0), "dpm", []),
        ("Copy", ["gpu_0/g_part_1"], ["gpu_1/g_shard_gpu0_copy"], gpu(1), "", []),
        ("Sum", ["gpu_1/g_shard_gpu0_copy", "gpu_1/g_part_1"], ["gpu_1/g_shard"], gpu(1), "dpm", [])]


def test_nccl_reduce_scatter_all_reduces_then_keeps_each_devices_part():
    lay = layout([3, 1], gpu=True)
    ops = make_reducer(lay, {}, use_nccl=True).reduce_scatter("w", ["gpu_3/w", "gpu_1/w"],
                                                              ["gpu_3/w_shard", "gpu_1/w_shard"], [4, 3])
    assert summary(ops) == [
        ("NCCLAllreduce", ["gpu_3/w", "gpu_1/w"], ["gpu_3/w", "gpu_1/w"], gpu(3), "", []),
        ("FlattenToVec", ["gpu_3/w"], ["gpu_3/w_flat"], gpu(3), "", []),
        ("Slice", ["gpu_3/w_flat"], ["gpu_3/w_shard"], gpu(3), "", []),
        ("FlattenToVec", ["gpu_1/w"], ["gpu_1/w_flat"], gpu(1), "", []),
        ("Slice", ["gpu_1/w_flat"], ["gpu_1/w_shard"], gpu(1), "", [])]
    assert [(op.args["starts"], op.args["ends"]) for op in ops if op.type == "Slice"] == [([0], [4]), ([4], [7])]


@pytest.mark.parametrize("use_nccl", [False, True])
def test_local_gather_concatenates_on_the_first_device_and_scatter_cuts_from_it(use_nccl):
    lay = layout([2, 0], gpu=True)
    red = make_reducer(lay, {}, use_nccl=use_nccl)
    parts, wholes = ["gpu_2/w_shard", "gpu_0/w_shard"], ["gpu_2/w", "gpu_0/w"]
    assert summary(red.gather_shards("w", parts, wholes, [5, 4], [3, 3])) == [
        ("Copy", ["gpu_0/w_shard"], ["gpu_2/w_gpu0_copy"], gpu(2), "", []),
        ("Concat", ["gpu_2/w_shard", "gpu_2/w_gpu0_copy"], ["gpu_2/w_gathered", "gpu_2/w_gathered_split_info"],
         gpu(2), "", []),
        ("Reshape", ["gpu_2/w_gathered"], ["gpu_2/w", "gpu_2/w_old_shape"], gpu(2), "", []),
        ("Copy", ["gpu_2/w"], ["gpu_0/w"], gpu(0), "", [])]
    assert summary(red.scatter_shards("w", "gpu_2/w", parts, [5, 4])) == [
        ("FlattenToVec", ["gpu_2/w"], ["gpu_2/w_flat"], gpu(2), "", []),
        ("Split", ["gpu_2/w_flat"], ["gpu_2/w_shard", "gpu_2/w_flat_part_1"], gpu(2), "", []),
        ("Copy", ["gpu_2/w_flat_part_1"], ["gpu_0/w_shard"], gpu(0), "", [])]


def test_distributed_reduce_scatter_sums_locally_then_reduce_scatters_this_shards_chunk():
    lay = layout([0, 1])
    red = make_reducer(lay, {}, num_shards=2, max_concurrent=2, order="tree", shard_id=1)
    ops = red.reduce_scatter("g", ["cpu_0/g", "cpu_1/g"], ["cpu_0/g_shard", "cpu_1/g_shard"], [3, 3, 2, 2])
    assert summary(ops) == [
        ("Sum", ["cpu_0/g", "cpu_1/g"], ["cpu_0/g"], cpu(0), "dpm", []),
        ("FlattenToVec", ["cpu_0/g"], ["cpu_0/g_flat"], cpu(0), "", []),
        ("ReduceScatter", ["graphpar_cw_0", "cpu_0/g_flat"], ["cpu_0/g_chunk"], cpu(0), "", []),
        ("Split", ["cpu_0/g_chunk"], ["cpu_0/g_shard", "cpu_0/g_chunk_part_1"], cpu(0), "", []),
        ("Copy", ["cpu_0/g_chunk_part_1"], ["cpu_1/g_shard"], cpu(1), "", [])]
    assert ops[2].args == {"split": [6, 4], "order": "tree"}  # shard 0's parts, then shard 1's
    assert ops[3].args["split"] == [2, 2]  # shard 1 owns global parts 2 and 3


def test_distributed_gather_and_scatter_go_through_shard_collectives():
    lay = layout([0, 1])
    red = make_reducer(lay, {}, num_shards=2, max_concurrent=1, shard_id=1)
    parts = ["cpu_0/w_shard", "cpu_1/w_shard"]
    gather = red.gather_shards("w", parts, ["cpu_0/w"], [3, 3, 2, 2], [10])
    assert [(op.type, op.inputs, op.outputs) for op in gather] == [
        ("Copy", ["cpu_1/w_shard"], ["cpu_0/w_cpu1_copy"]),
        ("Concat", ["cpu_0/w_shard", "cpu_0/w_cpu1_copy"], ["cpu_0/w_chunk", "cpu_0/w_chunk_split_info"]),
        ("Allgather", ["graphpar_cw_0", "cpu_0/w_chunk"], ["cpu_0/w_gathered"]),
        ("Reshape", ["cpu_0/w_gathered"], ["cpu_0/w", "cpu_0/w_old_shape"])]
    scatter = red.scatter_shards("w", "cpu_0/w", parts, [3, 3, 2, 2])
    assert [(op.type, op.inputs, op.outputs) for op in scatter] == [
        ("Broadcast", ["graphpar_cw_0", "cpu_0/w"], ["cpu_0/w"]),
        ("FlattenToVec", ["cpu_0/w"], ["cpu_0/w_flat"]),
        ("Slice", ["cpu_0/w_flat"], ["cpu_0/w_chunk"]),
        ("Split", ["cpu_0/w_chunk"], ["cpu_0/w_shard", "cpu_0/w_chunk_part_1"]),
        ("Copy", ["cpu_0/w_chunk_part_1"], ["cpu_1/w_shard"])]
    assert (scatter[2].args, scatter[3].args["split"]) == ({"starts": [6], "ends": [10]}, [2, 2])
