"""Caffe2's model-zoo builders `resnet.create_resnext` / `create_resnet50`: their parameter counts equal
torchvision's published ones for the same architectures, their blob names are Caffe2's, and a small
ResNeXt trains a step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graphpar import workspace
from graphpar.model_helper import ModelHelper
from graphpar.models import resnet


def _count(model: ModelHelper) -> int:
    return sum(math.prod(model.get_param_info(p).shape) for p in model.GetParams())


@pytest.mark.parametrize("layers, groups, width, params", [
    (50, 32, 4, 25_028_904),  # torchvision.models.resnext50_32x4d
    (50, 1, 64, 25_557_032),  # torchvision.models.resnet50
    (101, 32, 8, 88_791_336),  # torchvision.models.resnext101_32x8d
])
def test_parameter_counts_are_torchvisions(layers: int, groups: int, width: int, params: int) -> None:
    model = ModelHelper("count")
    resnet.create_resnext(model, "data", 3, 1000, layers, groups, width, no_bias=True, no_loss=True)
    assert _count(model) == params


def test_create_resnet50_is_resnext_1x64d_with_caffe2s_names() -> None:
    model = ModelHelper("r50")
    pred = resnet.create_resnet50(model, "data", 3, 10, no_bias=True, no_loss=True)
    assert str(pred) == "last_out_L10"
    names = {str(p) for p in model.GetParams()}
    assert {"conv1_w", "conv1_spatbn_relu_s", "comp_0_conv_1_w", "comp_0_spatbn_3_b", "shortcut_projection_0_w",
            "comp_15_conv_3_w", "last_out_L10_w"} <= names
    assert "conv1_b" not in names and "conv1_b" in {str(p) for p in _with_bias().GetParams()}


def _with_bias() -> ModelHelper:
    model = ModelHelper("bias")
    resnet.create_resnet50(model, "data", 3, 10, no_loss=True)  # Caffe2's default: convolutions with biases
    return model


def test_a_small_resnext_trains_a_step_with_softmax_loss() -> None:
    workspace.ResetWorkspace()
    model = ModelHelper("tiny")
    softmax, loss = resnet.create_resnext(model, "data", 3, 5, 18, 2, 4, label="label", conv1_kernel=3)
    model.AddGradientOperators([loss])
    rng = np.random.default_rng(0)
    workspace.FeedBlob("data", rng.standard_normal((2, 3, 32, 32)).astype(np.float32))
    workspace.FeedBlob("label", np.array([1, 3], np.int32))
    workspace.RunNetOnce(model.param_init_net)
    workspace.RunNetOnce(model.net)
    assert workspace.FetchBlob(str(softmax)).shape == (2, 5) and np.isfinite(workspace.FetchBlob(str(loss)))
    assert workspace.FetchBlob("comp_0_conv_2_w_grad").shape == (8, 4, 3, 3)  # 2 groups of 4 channels


def test_an_unknown_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="42 layers is not a ResNe"):
        resnet.create_resnext(ModelHelper("unknown_depth"), "data", 3, 10, 42, 1, 64)
