from __future__ import annotations

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.passes.broadcast_computed import add_computed_params_broadcast
from tests.passes.helpers import cpu, gpu, grad_net, layout, summary


def test_copies_each_computed_param_from_the_first_device_in_order():
    lay = layout([1, 0])
    net = grad_net(lay, ["bn_rm", "bn_riv"])
    grouped = {n: lay.group(n) for n in ("bn_rm", "bn_riv")}
    ops = add_computed_params_broadcast(net, ["bn_rm", "bn_riv"], grouped, lay, {})
    assert summary(ops) == [("Copy", ["cpu_1/bn_rm"], ["cpu_0/bn_rm"], cpu(0), "", []),
                            ("Copy", ["cpu_1/bn_riv"], ["cpu_0/bn_riv"], cpu(0), "", [])]
    assert net.ops[-2:] == ops


def test_nccl_broadcast_on_cuda_and_nothing_for_one_device():
    lay = layout([0, 1], gpu=True)
    ops = add_computed_params_broadcast(NetDef("n"), ["rm"], {"rm": lay.group("rm")}, lay, {}, use_nccl=True)
    assert summary(ops) == [("NCCLBroadcast", ["gpu_0/rm", "gpu_1/rm"], ["gpu_0/rm", "gpu_1/rm"], gpu(0), "", [])]
    net = NetDef("n", [OperatorDef("NCCLAllreduce", ["gpu_0/s", "gpu_1/s"], ["gpu_0/s", "gpu_1/s"], {}, gpu(0))])
    ops = add_computed_params_broadcast(net, ["rm", "riv"], {n: lay.group(n) for n in ("rm", "riv")}, lay, {},
                                        use_nccl=True)
    assert [op.control_inputs for op in ops] == [["gpu_0/s"], ["gpu_0/rm"]]  # one chain of collectives
    one = layout([2])
    assert add_computed_params_broadcast(NetDef("n"), ["rm"], {"rm": one.group("rm")}, one, {}) == []
