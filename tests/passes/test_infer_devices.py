from __future__ import annotations

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.passes.infer_devices import infer_blob_devices
from tests.passes.helpers import cpu, fill, gpu


def test_first_op_places_a_blob_and_iter_counters_live_on_the_cpu():
    init = NetDef("init", [fill("gpu_1/w", gpu(1)),
                           OperatorDef("ConstantFill", [], ["gpu_1/ITER"],
                                       {"shape": [1], "value": 0, "dtype": "int64"}, cpu(0))])
    net = NetDef("net", [OperatorDef("Iter", ["gpu_1/ITER"], ["gpu_1/ITER"], {}, gpu(1)),
                         OperatorDef("Copy", ["gpu_1/w"], ["gpu_0/w"], {}, gpu(0)),
                         OperatorDef("Relu", ["gpu_0/w"], ["gpu_0/y"], {}, gpu(3))])
    devices = infer_blob_devices([init, net])
    assert devices == {"gpu_1/w": gpu(1), "gpu_1/ITER": cpu(0), "gpu_0/w": gpu(0), "gpu_0/y": gpu(3)}


def test_iter_created_in_the_train_net_is_still_on_the_cpu():
    net = NetDef("net", [OperatorDef("Iter", ["gpu_1/ITER"], ["gpu_1/ITER"], {}, gpu(1))])
    assert infer_blob_devices([net])["gpu_1/ITER"] == cpu(0)
