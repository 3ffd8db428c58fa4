from __future__ import annotations

import numpy as np
import pytest

from graphpar import workspace
from graphpar.core.ir import GradientSlice, NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.devices import cuda_on_cpu
from graphpar.errors import ParallelizeError
from graphpar.passes.allreduce import allreduce_blobs
from graphpar.passes.finish import chain_collectives
from graphpar.passes.reducers import tree_levels
from tests.passes.helpers import cpu, gpu, grad_net, layout, reducer, summary


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6, 7, 9, 12, 15, 17])
def test_other_counts_are_one_flat_sum(count):
    assert tree_levels(count) == [[tuple(range(count))]]


def test_tree_pairings_for_4_8_16():
    assert tree_levels(4) == [[(0, 1), (2, 3)], [(0, 2)]]
    assert tree_levels(8) == [[(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (4, 6)], [(0, 4)]]
    assert tree_levels(16) == [[(i, i + 1) for i in range(0, 16, 2)], [(0, 2), (4, 6), (8, 10), (12, 14)],
                               [(0, 4), (8, 12)], [(0, 8)]]


def _sums(ops):
    return [(op.inputs, op.outputs[0]) for op in ops if op.type == "Sum"]


def test_three_devices_flat_sum_then_copies_back():
    lay = layout([0, 1, 2])
    net = grad_net(lay, ["w_grad"])
    ops = allreduce_blobs(net, ["w_grad"], {"w_grad": lay.group("w_grad")}, reducer(lay))
    assert summary(ops) == [
        ("Sum", ["cpu_0/w_grad", "cpu_1/w_grad", "cpu_2/w_grad"], ["cpu_0/w_grad"], cpu(0), "dpm", []),
        ("Copy", ["cpu_0/w_grad"], ["cpu_1/w_grad"], cpu(1), "", []),
        ("Copy", ["cpu_0/w_grad"], ["cpu_2/w_grad"], cpu(2), "", []),
    ]
    assert net.ops[-3:] == ops
    validate_net(net)


def test_four_devices_use_positions_not_ids():
    """Caffe2 #714: device ids that do not start at 0 crashed the old tree."""
    lay = layout([7, 4, 9, 5], gpu=True)
    net = grad_net(lay, ["g"])
    ops = allreduce_blobs(net, ["g"], {"g": lay.group("g")}, reducer(lay))
    assert summary(ops) == [
        ("Sum", ["gpu_7/g", "gpu_4/g"], ["gpu_7/g"], gpu(7), "dpm", []),
        ("Sum", ["gpu_9/g", "gpu_5/g"], ["gpu_9/g"], gpu(9), "dpm", []),
        ("Sum", ["gpu_7/g", "gpu_9/g"], ["gpu_7/g"], gpu(7), "dpm", []),
        ("Copy", ["gpu_7/g"], ["gpu_4/g"], gpu(4), "", []),
        ("Copy", ["gpu_7/g"], ["gpu_9/g"], gpu(9), "", []),
        ("Copy", ["gpu_7/g"], ["gpu_5/g"], gpu(5), "", []),
    ]


@pytest.mark.parametrize("count", [8, 16])
def test_eight_and_sixteen_devices_reduce_as_a_tree(count):
    lay = layout(list(range(1, count + 1)))
    ops = allreduce_blobs(grad_net(lay, ["g"]), ["g"], {"g": lay.group("g")}, reducer(lay))
    pairs = [(pos[0], pos[1]) for level in tree_levels(count) for pos in level]
    assert _sums(ops) == [([f"cpu_{a + 1}/g", f"cpu_{b + 1}/g"], f"cpu_{a + 1}/g") for a, b in pairs]
    copies = [(op.inputs, op.outputs) for op in ops if op.type == "Copy"]
    assert copies == [(["cpu_1/g"], [f"cpu_{d}/g"]) for d in range(2, count + 1)]
    assert len(ops) == 2 * (count - 1)


def test_gradients_are_reduced_in_the_order_given():
    lay = layout([0, 1])
    names = ["a_grad", "b_grad", "c_grad"]
    ops = allreduce_blobs(grad_net(lay, names), list(reversed(names)), {n: lay.group(n) for n in names},
                          reducer(lay))
    assert [op.outputs[0] for op in ops if op.type == "Sum"] == ["cpu_0/c_grad", "cpu_0/b_grad", "cpu_0/a_grad"]


def test_nccl_on_cuda_is_one_inplace_allreduce_per_gradient_chained_by_control_inputs():
    lay = layout([2, 3], gpu=True)
    names = ["a", "b", "c"]
    net = grad_net(lay, names)
    ops = allreduce_blobs(net, names, {n: lay.group(n) for n in names}, reducer(lay, use_nccl=True))
    chain_collectives(net.ops)
    assert net.ops[-3:] == ops  # Caffe2 put NCCL ops into model.net whatever net it was asked for
    assert summary(ops) == [
        ("NCCLAllreduce", ["gpu_2/a", "gpu_3/a"], ["gpu_2/a", "gpu_3/a"], gpu(2), "", []),
        ("NCCLAllreduce", ["gpu_2/b", "gpu_3/b"], ["gpu_2/b", "gpu_3/b"], gpu(2), "", ["gpu_2/a"]),
        ("NCCLAllreduce", ["gpu_2/c", "gpu_3/c"], ["gpu_2/c", "gpu_3/c"], gpu(2), "", ["gpu_2/b"]),
    ]


def test_collectives_are_chained_after_the_nets_earlier_collectives():
    """One chain per net: the first all-reduce waits for the collective before it (e.g. a computed-param
    NCCLBroadcast or an inter-device batch-norm all-reduce)."""
    lay = layout([0, 1], gpu=True)
    net = grad_net(lay, ["g", "rm"])
    net.ops.append(OperatorDef("NCCLBroadcast", ["gpu_0/rm", "gpu_1/rm"], ["gpu_0/rm", "gpu_1/rm"], {"root": 0},
                               gpu(0)))
    net.ops.append(OperatorDef("Relu", ["gpu_0/g"], ["gpu_0/h"], {}, gpu(0)))
    (op,) = allreduce_blobs(net, ["g"], {"g": lay.group("g")}, reducer(lay, use_nccl=True))
    chain_collectives(net.ops)
    assert op.control_inputs == ["gpu_0/rm"]


def test_nccl_is_ignored_on_cpu():
    lay = layout([0, 1])
    ops = allreduce_blobs(grad_net(lay, ["g"]), ["g"], {"g": lay.group("g")}, reducer(lay, use_nccl=True))
    assert [op.type for op in ops] == ["Sum", "Copy"]


def test_peers_without_p2p_access_are_copied_to_the_root_first_into_the_target_net():
    """Caffe2 #633/#659 (illegal access without P2P); Caffe2 added these copies to model.net (a bug)."""
    lay = layout([0, 1, 2, 3], gpu=True)
    net, other = grad_net(lay, ["g"]), NetDef("untouched")
    islands = {0: 0, 1: 0, 2: 1, 3: 1}
    ops = allreduce_blobs(net, ["g"], {"g": lay.group("g")},
                          reducer(lay, peer_access=lambda a, b: islands[a] == islands[b]))
    assert summary(ops[:5]) == [
        ("Sum", ["gpu_0/g", "gpu_1/g"], ["gpu_0/g"], gpu(0), "dpm", []),
        ("Sum", ["gpu_2/g", "gpu_3/g"], ["gpu_2/g"], gpu(2), "dpm", []),
        ("Copy", ["gpu_2/g"], ["gpu_0/g_gpu2_copy"], gpu(0), "", []),
        ("Sum", ["gpu_0/g", "gpu_0/g_gpu2_copy"], ["gpu_0/g"], gpu(0), "dpm", []),
        ("Copy", ["gpu_0/g"], ["gpu_1/g"], gpu(1), "", []),
    ]
    assert net.ops[-len(ops):] == ops and other.ops == []


def test_shared_models_keep_the_sum_on_the_first_device_only():
    lay = layout([0, 1, 2])
    ops = allreduce_blobs(grad_net(lay, ["g"]), ["g"], {"g": lay.group("g")}, reducer(lay), to_all=False)
    assert [op.type for op in ops] == ["Sum"]


def test_one_device_or_single_copy_adds_nothing():
    lay = layout([3])
    assert allreduce_blobs(grad_net(lay, ["g"]), ["g"], {"g": lay.group("g")}, reducer(lay)) == []
    two = layout([0, 1])
    assert allreduce_blobs(grad_net(two, ["g"]), ["g"], {"g": {0: "cpu_0/g"}}, reducer(two)) == []


def test_missing_copy_and_sparse_gradients_are_refused():
    lay = layout([0, 1, 2])
    with pytest.raises(ParallelizeError, match=r"'g' has no copy on device\(s\) \[2\]"):
        allreduce_blobs(NetDef("n"), ["g"], {"g": {0: "cpu_0/g", 1: "cpu_1/g"}}, reducer(lay))
    sparse = {d: GradientSlice(f"cpu_{d}/i", f"cpu_{d}/v") for d in (0, 1, 2)}
    with pytest.raises(ValueError, match="sparse"):
        allreduce_blobs(NetDef("n"), ["i:v"], {"i:v": sparse}, reducer(lay))


def _run_and_fetch(net: NetDef, blobs: list[str]) -> list[np.ndarray]:
    workspace.RunNetOnce(net)
    return [workspace.FetchBlob(b) for b in blobs]


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8, 16])
def test_every_copy_ends_up_holding_the_sum(count):
    lay = layout(list(range(3, 3 + count)))
    names = ["a", "b"]
    net = grad_net(lay, names)
    allreduce_blobs(net, names, {n: lay.group(n) for n in names}, reducer(lay))
    for k, name in enumerate(names):
        expected = np.full(3, sum(10.0 * k + i + 1 for i in range(count)), np.float32)
        for value in _run_and_fetch(net, list(lay.group(name).values())):
            np.testing.assert_array_equal(value, expected)


@pytest.mark.parametrize("use_nccl", [False, True])
def test_simulated_cuda_all_reduce_sums_on_every_device(use_nccl):
    lay = layout([1, 2, 3, 4], gpu=True)
    net = grad_net(lay, ["g"])
    allreduce_blobs(net, ["g"], {"g": lay.group("g")},
                    reducer(lay, use_nccl=use_nccl, peer_access=lambda a, b: False))
    with cuda_on_cpu():
        values = _run_and_fetch(net, list(lay.group("g").values()))
    for value in values:
        np.testing.assert_array_equal(value, np.full(3, 10.0, np.float32))
