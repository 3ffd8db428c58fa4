"""One multi-tensor update per device: the exact op, what blocks fusing, and bit-identical training."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.core.ir import OperatorDef
from graphpar.models import lenet, mlp
from graphpar.passes.fuse_updates import fuse_update_ops

MLP = functools.partial(mlp, dim_in=6, hidden=(5,), num_classes=3)
OPTIMIZERS = {
    "momentum": lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
    "nesterov": lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda m: optimizer.build_adam(m, 0.01),
}


def _model(build=OPTIMIZERS["momentum"], forward=MLP, devices=(0, 1)) -> model_helper.ModelHelper:  # noqa: ANN001
    model = model_helper.ModelHelper(name="fuse")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=build, devices=list(devices), cpu_device=True,
                    cpu_update_once=False)  # every replica's updates, to fuse
    return model


def test_each_devices_updates_become_one_multi_tensor_op_in_place_of_the_last():
    model = _model()
    net = model.net.Proto()
    updates = [op for op in net.ops if op.type == "MomentumSGDUpdate"]
    last = {d: max(i for i, op in enumerate(net.ops) if op.type == "MomentumSGDUpdate"
                   and op.inputs[3].startswith(f"cpu_{d}/")) for d in (0, 1)}
    fused = fuse_update_ops(net)
    assert [op.type for op in net.ops].count("MomentumSGDUpdate") == 0 and len(fused) == 2
    for d, op in zip((0, 1), fused):
        mine = [u for u in updates if u.inputs[3].startswith(f"cpu_{d}/")]
        assert op.type == "MultiTensorMomentumSGDUpdate" and op.args == mine[0].args
        assert op.inputs == [u.inputs[0] for u in mine] + [u.inputs[1] for u in mine] + \
            [u.inputs[3] for u in mine] + [mine[0].inputs[2]]
        assert op.outputs == op.inputs[:-1] and op.device_option == mine[0].device_option
    assert net.ops.index(fused[0]) == last[0] - 3  # the three ops before it were folded in


def test_an_op_in_between_that_reads_an_updated_param_keeps_that_update_in_place():
    model = _model()
    net = model.net.Proto()
    first = next(i for i, op in enumerate(net.ops) if op.type == "MomentumSGDUpdate")
    param = net.ops[first].inputs[3]
    net.ops.insert(first + 1, OperatorDef("Relu", [param], ["cpu_0/after_update"], {},
                                          net.ops[first].device_option))
    fuse_update_ops(net)
    assert [op.inputs[3] for op in net.ops if op.type == "MomentumSGDUpdate"] == [param]


def _train(build, forward, shape, fuse: bool) -> dict[str, np.ndarray]:  # noqa: ANN001
    workspace.ResetWorkspace()
    model = _model(build, forward)
    if fuse:
        assert fuse_update_ops(model.net.Proto())
    rng = np.random.default_rng(3)
    storage = {}
    for step in range(3):
        for d in (0, 1):
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((2, *shape), dtype=np.float32))
            workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 2).astype(np.int32))
        if step == 0:
            dpm.RunInitNet(model)
            storage = {p: workspace.FetchTensor(p).untyped_storage().data_ptr() for p in model.GetParams("")}
        dpm.RunNet(model, 1)
    assert {p: workspace.FetchTensor(p).untyped_storage().data_ptr() for p in storage} == storage  # in place
    return {name: workspace.FetchBlob(name) for name in workspace.Blobs() if name.startswith("cpu_")}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_updates_train_bit_identically_in_place(name: str):
    cnn = functools.partial(lenet, channels=(2, 3), hidden=4, num_classes=3, image_size=16)
    for forward, shape in ((MLP, (6,)), (cnn, (1, 16, 16))):
        plain = _train(OPTIMIZERS[name], forward, shape, fuse=False)
        fused = _train(OPTIMIZERS[name], forward, shape, fuse=True)
        assert plain.keys() == fused.keys()
        for blob, value in plain.items():
            np.testing.assert_array_equal(fused[blob], value, err_msg=blob)
