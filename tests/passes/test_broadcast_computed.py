from __future__ import annotations

import numpy as np
import pytest

from graphpar import workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.devices import cuda_on_cpu
from graphpar.passes.broadcast_computed import average_computed_params, broadcast_computed_params
from graphpar.passes.finish import chain_collectives
from tests.passes.helpers import cpu, gpu, grad_net, layout, reducer, summary


def test_copies_each_computed_param_from_the_first_device_in_order():
    lay = layout([1, 0])
    net = grad_net(lay, ["bn_rm", "bn_riv"])
    grouped = {n: lay.group(n) for n in ("bn_rm", "bn_riv")}
    ops = broadcast_computed_params(net, ["bn_rm", "bn_riv"], grouped, reducer(lay))
    assert summary(ops) == [("Copy", ["cpu_1/bn_rm"], ["cpu_0/bn_rm"], cpu(0), "", []),
                            ("Copy", ["cpu_1/bn_riv"], ["cpu_0/bn_riv"], cpu(0), "", [])]
    assert net.ops[-2:] == ops


def test_nccl_broadcast_on_cuda_and_nothing_for_one_device():
    lay = layout([0, 1], gpu=True)
    ops = broadcast_computed_params(NetDef("n"), ["rm"], {"rm": lay.group("rm")}, reducer(lay, use_nccl=True))
    assert summary(ops) == [("NCCLBroadcast", ["gpu_0/rm", "gpu_1/rm"], ["gpu_0/rm", "gpu_1/rm"], gpu(0), "", [])]
    net = NetDef("n", [OperatorDef("NCCLAllreduce", ["gpu_0/s", "gpu_1/s"], ["gpu_0/s", "gpu_1/s"], {}, gpu(0))])
    ops = broadcast_computed_params(net, ["rm", "riv"], {n: lay.group(n) for n in ("rm", "riv")},
                                    reducer(lay, use_nccl=True))
    chain_collectives(net.ops)
    assert [op.control_inputs for op in ops] == [["gpu_0/s"], ["gpu_0/rm"]]  # one chain of collectives
    one = layout([2])
    assert broadcast_computed_params(NetDef("n"), ["rm"], {"rm": one.group("rm")}, reducer(one)) == []


def test_averaging_all_reduces_then_scales_every_copy_in_order():
    lay = layout([1, 0, 2])
    net = grad_net(lay, ["bn_rm", "bn_riv"])
    grouped = {n: lay.group(n) for n in ("bn_rm", "bn_riv")}
    ops = average_computed_params(net, ["bn_rm", "bn_riv"], grouped, reducer(lay), {})
    expected = []
    for name in ("bn_rm", "bn_riv"):
        expected += [("Sum", [f"cpu_{d}/{name}" for d in (1, 0, 2)], [f"cpu_1/{name}"], cpu(1), "dpm", []),
                     ("Copy", [f"cpu_1/{name}"], [f"cpu_0/{name}"], cpu(0), "", []),
                     ("Copy", [f"cpu_1/{name}"], [f"cpu_2/{name}"], cpu(2), "", [])]
        expected += [("Scale", [f"cpu_{d}/{name}"], [f"cpu_{d}/{name}"], cpu(d), "", []) for d in (1, 0, 2)]
    assert summary(ops) == expected
    assert {op.args["scale"] for op in ops if op.type == "Scale"} == {1.0 / 3}
    assert net.ops[-len(ops):] == ops
    validate_net(net)
    one = layout([2])
    assert average_computed_params(NetDef("n"), ["rm"], {"rm": one.group("rm")}, reducer(one), {}) == []


def test_averaging_with_nccl_is_one_chained_allreduce_per_blob_then_scales():
    lay = layout([0, 1], gpu=True)
    net = NetDef("n", [OperatorDef("NCCLAllreduce", ["gpu_0/s", "gpu_1/s"], ["gpu_0/s", "gpu_1/s"], {}, gpu(0))])
    ops = average_computed_params(net, ["rm", "riv"], {n: lay.group(n) for n in ("rm", "riv")},
                                  reducer(lay, use_nccl=True), {})
    chain_collectives(net.ops)
    assert summary(ops) == [
        ("NCCLAllreduce", ["gpu_0/rm", "gpu_1/rm"], ["gpu_0/rm", "gpu_1/rm"], gpu(0), "", ["gpu_0/s"]),
        ("Scale", ["gpu_0/rm"], ["gpu_0/rm"], gpu(0), "", []),
        ("Scale", ["gpu_1/rm"], ["gpu_1/rm"], gpu(1), "", []),
        ("NCCLAllreduce", ["gpu_0/riv", "gpu_1/riv"], ["gpu_0/riv", "gpu_1/riv"], gpu(0), "", ["gpu_0/rm"]),
        ("Scale", ["gpu_0/riv"], ["gpu_0/riv"], gpu(0), "", []),
        ("Scale", ["gpu_1/riv"], ["gpu_1/riv"], gpu(1), "", []),
    ]


@pytest.mark.parametrize(("gpu_", "use_nccl"), [(False, False), (True, False), (True, True)])
def test_every_copy_ends_up_holding_the_mean(gpu_, use_nccl):
    lay = layout([3, 4, 5, 6], gpu=gpu_)
    net = grad_net(lay, ["rm"])  # copy i holds i + 1
    average_computed_params(net, ["rm"], {"rm": lay.group("rm")}, reducer(lay, use_nccl=use_nccl), {})
    with cuda_on_cpu():
        workspace.RunNetOnce(net)
        for blob in lay.group("rm").values():
            np.testing.assert_allclose(workspace.FetchBlob(blob), np.full(3, 2.5, np.float32), err_msg=blob)
