from __future__ import annotations

from graphpar.core.ir import CPU, CUDA, NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.passes.common import append_ops, broadcast_ops, make_op
from tests.passes.helpers import cpu, gpu, layout, summary


def test_layout_names_scopes_and_devices():
    lay = layout([4, 5, 7], gpu=True)
    assert lay.device_type == CUDA and lay.master == 4
    assert lay.scoped(7, "fc_w") == "gpu_7/fc_w" and lay.scope(5) == "gpu_5"
    assert lay.option(5) == gpu(5) and lay.option(5) is lay.option(5)  # one shared option per replica
    assert lay.option(6) == gpu(6)  # not a replica: still the device of that id
    assert lay.group("w") == {4: "gpu_4/w", 5: "gpu_5/w", 7: "gpu_7/w"}
    assert [lay.replica_of(b) for b in ("gpu_5/a/b", "gpu_6/x", "cpu_5/x", "x", "gpu_5")] == [5, None, None,
                                                                                          None, None]
    assert layout([0]).device_type == CPU


def test_append_ops_declares_unproduced_inputs_as_external():
    net = NetDef("n", [OperatorDef("ConstantFill", [], ["a"], {"shape": [1]})], external_inputs=["x"])
    append_ops(net, [make_op("Sum", ["a", "x", "y"], ["z"], None), make_op("Copy", ["z"], ["w"], None)])
    assert net.external_inputs == ["x", "y"]
    assert [op.type for op in net.ops] == ["ConstantFill", "Sum", "Copy"]
    validate_net(net)


def test_broadcast_copies_from_the_first_device_onto_each_destination_device():
    lay = layout([2, 0, 1], gpu=True)
    group = lay.group("it")
    ops = broadcast_ops(lay, group, {"gpu_0/it": cpu(0)})
    assert summary(ops) == [("Copy", ["gpu_2/it"], ["gpu_0/it"], cpu(0), "", []),
                            ("Copy", ["gpu_2/it"], ["gpu_1/it"], gpu(1), "", [])]


def test_broadcast_with_nccl_is_one_inplace_op_on_cuda_only():
    lay = layout([3, 1], gpu=True)
    (op,) = broadcast_ops(lay, lay.group("w"), {}, use_nccl=True)
    assert summary([op]) == [("NCCLBroadcast", ["gpu_3/w", "gpu_1/w"], ["gpu_3/w", "gpu_1/w"], gpu(3), "", [])]
    assert op.args == {"root": 0}
    cpu_ops = broadcast_ops(layout([0, 1]), layout([0, 1]).group("w"), {}, use_nccl=True)
    assert [op.type for op in cpu_ops] == ["Copy"]
    host_blob = broadcast_ops(lay, lay.group("it"), {"gpu_3/it": cpu(0)}, use_nccl=True)
    assert [op.type for op in host_blob] == ["Copy"]
