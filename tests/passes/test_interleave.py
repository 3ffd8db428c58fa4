from __future__ import annotations

import pytest

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.interleave import interleave_ops
from tests.passes.helpers import cpu, gpu, layout


def _replica_ops(device, types: list[str], scope: str) -> list[OperatorDef]:
    """A chain of ops on one replica: op k reads blob k and writes blob k + 1."""
    return [OperatorDef(t, [f"{scope}/b{k}"], [f"{scope}/b{k + 1}"], device_option=device)
            for k, t in enumerate(types)]


def _net(devices: list[int], types: list[str], make=cpu) -> NetDef:
    prefix = "gpu" if make is gpu else "cpu"
    return NetDef("n", [op for d in devices for op in _replica_ops(make(d), types, f"{prefix}_{d}")])


def test_the_jth_op_of_every_device_becomes_adjacent_in_device_list_order():
    devices = [7, 2, 4]  # ids are not 0..N-1 and not sorted: the position in `devices` decides
    net = _net(devices, ["Conv", "SpatialBN", "Relu"])
    by_device = {d: [op for op in net.ops if op.device_option.device_id == d] for d in devices}
    assert interleave_ops(net, devices) is net
    assert [(op.type, op.device_option.device_id, op.outputs[0]) for op in net.ops] == [
        ("Conv", 7, "cpu_7/b1"), ("Conv", 2, "cpu_2/b1"), ("Conv", 4, "cpu_4/b1"),
        ("SpatialBN", 7, "cpu_7/b2"), ("SpatialBN", 2, "cpu_2/b2"), ("SpatialBN", 4, "cpu_4/b2"),
        ("Relu", 7, "cpu_7/b3"), ("Relu", 2, "cpu_2/b3"), ("Relu", 4, "cpu_4/b3"),
    ]
    for position, d in enumerate(devices):  # the same op objects, each replica's order kept
        assert net.ops[position::3] == by_device[d]


def test_cuda_devices_and_ops_without_option_take_the_nets_device():
    net = _net([1, 3], ["Tanh", "Sqr"], make=gpu)
    net.device_option = gpu(3)
    for op in net.ops[2:]:
        op.device_option = None  # inherits the net's gpu 3
    interleave_ops(net, [1, 3])
    assert [(op.type, net.op_device(op)) for op in net.ops] == [
        ("Tanh", gpu(1)), ("Tanh", gpu(3)), ("Sqr", gpu(1)), ("Sqr", gpu(3))]


def test_host_side_ops_of_gpu_replicas_go_by_their_blobs_scope():
    """A GPU replica's CPU ops run on CPU device 0 whatever the replica: their blobs say which it is."""
    net = _net([2, 0], ["Relu"], make=gpu)
    for d in (2, 0):
        net.ops.insert(net.ops.index(next(op for op in net.ops if op.outputs[0] == f"gpu_{d}/b1")) + 1,
                       OperatorDef("CopyGPUToCPU", [f"gpu_{d}/b1"], [f"gpu_{d}/host"], device_option=cpu(0)))
    interleave_ops(net, [2, 0], layout([2, 0], gpu=True).replica_of)
    assert [(op.type, op.outputs[0]) for op in net.ops] == [
        ("Relu", "gpu_2/b1"), ("Relu", "gpu_0/b1"), ("CopyGPUToCPU", "gpu_2/host"), ("CopyGPUToCPU", "gpu_0/host")]


def test_one_device_keeps_the_order():
    net = _net([5], ["A", "B", "C"])
    before = list(net.ops)
    assert interleave_ops(net, [5]).ops == before


def test_different_op_types_name_the_first_mismatch():
    net = NetDef("train", _replica_ops(cpu(0), ["Conv", "Relu", "FC"], "cpu_0")
                 + _replica_ops(cpu(1), ["Conv", "Tanh", "FC"], "cpu_1"))
    before = list(net.ops)
    with pytest.raises(ParallelizeError, match=r"net 'train': the replicas differ at op index 1 "
                                               r"\(device 0: Relu, device 1: Tanh\)"):
        interleave_ops(net, [0, 1])
    assert net.ops == before


def test_different_op_counts_name_the_first_missing_op_and_the_counts():
    net = NetDef("n", _replica_ops(cpu(2), ["Conv", "Relu", "FC"], "cpu_2")
                 + _replica_ops(cpu(6), ["Conv", "Relu"], "cpu_6"))
    with pytest.raises(ParallelizeError, match=r"op index 2 \(device 2: FC, device 6: <no op>\); op counts "
                                               r"\(device 2: 3, device 6: 2\)"):
        interleave_ops(net, [2, 6])


def test_an_op_on_another_device_is_refused():
    net = _net([0, 1], ["Relu"])
    net.ops.append(OperatorDef("Iter", ["it"], ["it"], device_option=cpu(9)))
    with pytest.raises(ParallelizeError, match=r"op #2 Iter runs on device 9, which is not one of the "
                                               r"replicas \[0, 1\]"):
        interleave_ops(net, [0, 1])


@pytest.mark.parametrize("devices", [[], [1, 1]])
def test_devices_must_be_distinct_and_non_empty(devices):
    with pytest.raises(ParallelizeError, match="distinct and non-empty"):
        interleave_ops(NetDef("n"), devices)
