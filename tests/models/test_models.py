from __future__ import annotations

import functools

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.models import lenet, mlp, resnet18, resnet50


def _parallelize(forward, devices=(0,), **kwargs) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="zoo")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9),
                    devices=list(devices), cpu_device=True, **kwargs)
    return model


def _names(model, scope="cpu_0/") -> list[str]:
    return [p[len(scope):] for p in model.GetParams(scope)]


def test_resnet50_has_caffe2_layer_names_and_counts():
    model = _parallelize(resnet50)
    names = _names(model)
    assert len(names) == 161 and len(model.GetComputedParams("cpu_0/")) == 106
    assert names[:3] == ["conv1_w", "conv1_bn_s", "conv1_bn_b"]
    for name in ("res2_0_branch2a_w", "res2_0_branch1_w", "res3_0_branch1_bn_s", "res5_2_branch2c_w",
                 "pred_w", "pred_b"):
        assert name in names
    assert "res2_1_branch1_w" not in names
    shapes = {op.outputs[0]: op.args.get("shape") for op in model.param_init_net.Proto().ops}
    assert shapes["cpu_0/res2_0_branch2c_w"] == [256, 64, 1, 1] and shapes["cpu_0/pred_w"] == [1000, 2048]
    assert "cpu_0/res5_2_sum" in {b for op in model.net.Proto().ops for b in op.outputs}


def test_resnet18_uses_basic_blocks():
    model = _parallelize(resnet18)
    names = _names(model)
    assert len(names) == 20 * 3 + 2
    assert "res2_0_branch2c_w" not in names and "res3_0_branch1_w" in names


@pytest.mark.slow
def test_a_tiny_resnet_trains_on_two_devices_with_identical_replicas():
    model = _parallelize(functools.partial(resnet18, num_classes=3, width=4), devices=[1, 2])
    rng = np.random.default_rng(0)
    for step in range(2):
        for d in (1, 2):
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((2, 3, 8, 8), dtype=np.float32))
            workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 2).astype(np.int32))
        if step == 0:
            dpm.RunInitNet(model)
            before = workspace.FetchBlob("cpu_1/res2_0_branch2a_w")
        dpm.RunNet(model, 1)
    after = workspace.FetchBlob("cpu_1/res2_0_branch2a_w")
    assert not np.array_equal(before, after)
    for name in _names(model, "cpu_1/"):
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_1/{name}"), workspace.FetchBlob(f"cpu_2/{name}"))
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_1/conv1_bn_rm"), workspace.FetchBlob("cpu_2/conv1_bn_rm"))
    assert np.isfinite(workspace.FetchBlob("cpu_2/loss"))


def test_mlp_and_lenet_names():
    assert _names(_parallelize(functools.partial(mlp, hidden=(4, 3)))) == [
        "fc1_w", "fc1_b", "fc2_w", "fc2_b", "pred_w", "pred_b"]
    assert _names(_parallelize(lenet)) == ["conv1_w", "conv1_b", "conv2_w", "conv2_b", "fc3_w", "fc3_b",
                                           "pred_w", "pred_b"]
    with pytest.raises(ValueError, match="too small"):
        lenet(model_helper.ModelHelper(name="tiny"), 1.0, image_size=12)
