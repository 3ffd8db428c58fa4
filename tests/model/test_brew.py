"""brew helpers: the exact params, initialisers and ops each records, and argument-scope merging."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphpar import brew, workspace
from graphpar.core import CPU, CUDA, BlobReference, DeviceOption, DeviceScope, NameScope
from graphpar.model_helper import Initializer, ModelHelper

NCHW = {"order": "NCHW"}  # the default model.arg_scope reaches ops of helpers that take **kwargs


def ops_of(net):
    """(type, inputs, outputs, args) of every op, for exact comparisons."""
    return [(op.type, op.inputs, op.outputs, op.args) for op in net.Proto().ops]


def test_fc_params_and_ops():
    model = ModelHelper(name="brew_fc")
    out = brew.fc(model, "data", "fc1", dim_in=4, dim_out=3)
    assert out == "fc1" and isinstance(out, BlobReference)
    assert ops_of(model.param_init_net) == [
        ("XavierFill", [], ["fc1_w"], {"shape": [3, 4]}),
        ("ConstantFill", [], ["fc1_b"], {"shape": [3]}),
    ]
    assert ops_of(model.net) == [("FC", ["data", "fc1_w", "fc1_b"], ["fc1"], NCHW)]
    assert model.params == ["fc1_w", "fc1_b"]
    assert model.weights == ["fc1_w"] and model.biases == ["fc1_b"]


def test_fc_in_device_and_name_scope():
    model = ModelHelper(name="brew_fc_scoped")
    with DeviceScope(DeviceOption(CUDA, 1)), NameScope("gpu_1"):
        out = brew.fc(model, "data", "fc1", dim_in=4, dim_out=3, axis=2)
        again = brew.fc(model, out, out + "_2", dim_in=3, dim_out=3)  # a BlobReference keeps its name
    assert out == "gpu_1/fc1" and again == "gpu_1/fc1_2"
    assert model.params == ["gpu_1/fc1_w", "gpu_1/fc1_b", "gpu_1/fc1_2_w", "gpu_1/fc1_2_b"]
    assert model.net.Proto().ops[0].args == {"axis": 2, **NCHW}
    every_op = model.param_init_net.Proto().ops + model.net.Proto().ops
    assert all(op.device_option == DeviceOption(CUDA, 1) for op in every_op)


class RecordingInitializer(Initializer):
    """A custom Initializer class, as Caffe2's WeightInitializer/BiasInitializer arguments take."""

    made: list[tuple[str, dict]] = []

    def __init__(self, op_name: str, **kwargs: object) -> None:
        super().__init__(op_name, **kwargs)
        RecordingInitializer.made.append((op_name, kwargs))


def test_fc_custom_initialisers():
    model = ModelHelper(name="brew_fc_init")
    RecordingInitializer.made.clear()
    brew.fc(model, "x", "a", 2, 5, weight_init=("GaussianFill", {"std": 0.1}),
            bias_init=("ConstantFill", {"value": 0.5}))
    brew.fc(model, "x", "b", 2, 5, WeightInitializer=RecordingInitializer)
    assert ops_of(model.param_init_net) == [
        ("GaussianFill", [], ["a_w"], {"shape": [5, 2], "std": 0.1}),
        ("ConstantFill", [], ["a_b"], {"shape": [5], "value": 0.5}),
        ("XavierFill", [], ["b_w"], {"shape": [5, 2]}),
        ("ConstantFill", [], ["b_b"], {"shape": [5]}),
    ]
    assert RecordingInitializer.made == [("XavierFill", {})]
    with pytest.raises(TypeError, match="op_name, kwargs"):
        brew.fc(model, "x", "c", 2, 5, weight_init="GaussianFill")


def test_init_params_false_creates_no_init_ops():
    model = ModelHelper(name="brew_noinit", init_params=False)
    brew.fc(model, "x", "fc", 2, 3)
    brew.conv(model, "img", "conv", 3, 4, kernel=3)
    brew.spatial_bn(model, "conv", "bn", 4, is_test=True)
    assert model.param_init_net.Proto().ops == []
    assert model.params == ["fc_w", "fc_b", "conv_w", "conv_b", "bn_s", "bn_b"]
    assert model._computed_params == ["bn_rm", "bn_riv"]
    assert [op.type for op in model.net.Proto().ops] == ["FC", "Conv", "SpatialBN"]


def test_conv_params_and_ops():
    model = ModelHelper(name="brew_conv")
    brew.conv(model, "img", "c1", dim_in=4, dim_out=6, kernel=3, stride=2, pad=1, group=2)
    brew.conv(model, "c1", "c2", dim_in=6, dim_out=8, kernel=[3, 1], no_bias=True, dilation=2)
    assert ops_of(model.param_init_net) == [
        ("XavierFill", [], ["c1_w"], {"shape": [6, 2, 3, 3]}),
        ("ConstantFill", [], ["c1_b"], {"shape": [6]}),
        ("XavierFill", [], ["c2_w"], {"shape": [8, 6, 3, 1]}),
    ]
    assert ops_of(model.net) == [
        ("Conv", ["img", "c1_w", "c1_b"], ["c1"], {"kernel": 3, "order": "NCHW", "stride": 2, "pad": 1,
                                                   "group": 2}),
        ("Conv", ["c1", "c2_w"], ["c2"], {"kernel_h": 3, "kernel_w": 1, "order": "NCHW", "dilation": 2}),
    ]
    assert model.weights == ["c1_w", "c2_w"] and model.biases == ["c1_b"]


def test_conv_and_fc_accept_numpy_integer_sizes():
    model = ModelHelper(name="brew_np_ints")
    dim, k = np.int64(4), np.int64(3)
    brew.conv(model, "img", "c1", dim_in=dim, dim_out=6, kernel=k)
    brew.conv(model, "c1", "c2", dim_in=6, dim_out=dim, kernel=[k, np.int32(1)])
    brew.fc(model, "c2", "fc", dim_in=dim * 2, dim_out=np.int32(5))
    shapes = [op.args["shape"] for op in model.param_init_net.Proto().ops]
    assert shapes == [[6, 4, 3, 3], [6], [4, 6, 3, 1], [4], [5, 8], [5]]
    conv1, conv2, _ = model.net.Proto().ops
    assert conv1.args["kernel"] == 3 and (conv2.args["kernel_h"], conv2.args["kernel_w"]) == (3, 1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"order": "CHWN"}, "order must be 'NCHW' or 'NHWC'"),
    ({"group": 3}, "divisible by group=3"),
    ({"kernel": [1, 2, 3]}, "2-D only"),
])
def test_conv_rejects_bad_arguments(kwargs, match):
    model = ModelHelper(name="brew_conv_bad")
    with pytest.raises(ValueError, match=match):
        brew.conv(model, "img", "c", **{"dim_in": 4, "dim_out": 4, "kernel": 3, **kwargs})
    assert model.params == []


def test_spatial_bn_training():
    model = ModelHelper(name="brew_bn")
    with NameScope("gpu_0"):
        out = brew.spatial_bn(model, "x", "bn", dim_in=3, init_scale=2, epsilon=1e-3, momentum=0.8)
    assert out == "gpu_0/bn"
    assert ops_of(model.param_init_net) == [
        ("ConstantFill", [], ["gpu_0/bn_s"], {"shape": [3], "value": 2.0}),
        ("ConstantFill", [], ["gpu_0/bn_b"], {"shape": [3], "value": 0.0}),
        ("ConstantFill", [], ["gpu_0/bn_rm"], {"shape": [3], "value": 0.0}),
        ("ConstantFill", [], ["gpu_0/bn_riv"], {"shape": [3], "value": 1.0}),
    ]
    assert ops_of(model.net) == [(
        "SpatialBN", ["gpu_0/x", "gpu_0/bn_s", "gpu_0/bn_b", "gpu_0/bn_rm", "gpu_0/bn_riv"],
        ["gpu_0/bn", "gpu_0/bn_rm", "gpu_0/bn_riv", "gpu_0/bn_sm", "gpu_0/bn_siv"],
        {"order": "NCHW", "epsilon": 1e-3, "momentum": 0.8})]
    assert model.params == ["gpu_0/bn_s", "gpu_0/bn_b"]
    assert model.weights == ["gpu_0/bn_s"] and model.biases == ["gpu_0/bn_b"]
    assert model.GetComputedParams("gpu_0") == ["gpu_0/bn_rm", "gpu_0/bn_riv"]


def test_spatial_bn_test_mode_has_one_output():
    model = ModelHelper(name="brew_bn_test")
    out = brew.spatial_bn(model, "x", "bn", 2, is_test=True)
    assert out == "bn"
    assert ops_of(model.net) == [("SpatialBN", ["x", "bn_s", "bn_b", "bn_rm", "bn_riv"], ["bn"],
                                  {"order": "NCHW", "is_test": True})]


@pytest.mark.parametrize(("helper", "op_type", "kwargs", "args"), [
    (brew.relu, "Relu", {}, NCHW),
    (brew.leaky_relu, "LeakyRelu", {}, {}),
    (brew.leaky_relu, "LeakyRelu", {"alpha": 0.2}, {"alpha": 0.2}),
    (brew.sigmoid, "Sigmoid", {}, NCHW),
    (brew.tanh, "Tanh", {}, NCHW),
    (brew.softmax, "Softmax", {"axis": 1}, {"axis": 1, **NCHW}),
    (brew.max_pool, "MaxPool", {"kernel": 2, "stride": 2, "is_test": True}, {"kernel": 2, "stride": 2, **NCHW}),
    (brew.average_pool, "AveragePool", {"global_pooling": True}, {"global_pooling": True, **NCHW}),
    (brew.flatten, "Flatten", {}, NCHW),
])
def test_single_op_helpers(helper, op_type, kwargs, args):
    model = ModelHelper(name=f"brew_{op_type}")
    with NameScope("gpu_0"):
        out = helper(model, "x", "y", **kwargs)
    assert out == "gpu_0/y"
    assert ops_of(model.net) == [(op_type, ["gpu_0/x"], ["gpu_0/y"], args)]
    assert model.params == [] and model.param_init_net.Proto().ops == []


def test_max_pool_records_its_indices_when_training():
    model = ModelHelper(name="brew_max_pool")
    with NameScope("gpu_0"):
        out = brew.max_pool(model, "x", "p", kernel=2)
    assert out == "gpu_0/p"
    assert ops_of(model.net) == [("MaxPool", ["gpu_0/x"], ["gpu_0/p", "gpu_0/p_index"], {"kernel": 2, **NCHW})]
    with brew.arg_scope(brew.max_pool, is_test=True):
        brew.max_pool(model, "x", "q", kernel=2)
    assert model.net.Proto().ops[-1].outputs == ["q"]


def test_relu_in_place_and_softmax_auto_name():
    model = ModelHelper(name="brew_inplace")
    h = brew.fc(model, "x", "h", 2, 2)
    assert brew.relu(model, h, h) == "h"
    auto = brew.softmax(model, h)
    assert model.net.Proto().ops[-1].outputs == [auto] and auto.startswith(model.net.Name() + "/Softmax")


def test_dropout_mask_name_keeps_the_scope():
    model = ModelHelper(name="brew_dropout")
    with NameScope("gpu_0"):
        out = brew.dropout(model, "x", "d", ratio=0.3, is_test=False)
        ref = brew.dropout(model, out, out + "_2", is_test=True)
    assert out == "gpu_0/d" and ref == "gpu_0/d_2"
    assert ops_of(model.net) == [
        ("Dropout", ["gpu_0/x"], ["gpu_0/d", "gpu_0/_d_mask"], {"ratio": 0.3, "is_test": False, **NCHW}),
        ("Dropout", ["gpu_0/d"], ["gpu_0/d_2", "gpu_0/_d_2_mask"], {"is_test": True, **NCHW}),
    ]
    with pytest.raises(TypeError, match="'is_test' is required"):
        brew.dropout(model, "x", "e")


def test_concat_axis_resolution():
    model = ModelHelper(name="brew_concat")
    assert brew.concat(model, ["a", "b"], "c") == "c"
    brew.concat(model, ["a", "b"], "c0", axis=0)
    brew.concat(model, ["a", "b"], "c3", order="NHWC")
    assert ops_of(model.net) == [
        ("Concat", ["a", "b"], ["c", "_c_concat_dims"], {"axis": 1}),
        ("Concat", ["a", "b"], ["c0", "_c0_concat_dims"], {"axis": 0}),
        ("Concat", ["a", "b"], ["c3", "_c3_concat_dims"], {"axis": 3}),
    ]
    with pytest.raises(ValueError, match="order must be"):
        brew.concat(model, ["a", "b"], "bad", order="CHWN")


def test_sum_and_accuracy():
    model = ModelHelper(name="brew_sum_acc")
    brew.sum(model, ["a", "b", "c"], "s")
    brew.accuracy(model, ["pred", "label"], "acc", top_k=3)
    brew.accuracy(model, ["pred", "label"], "acc1")
    assert ops_of(model.net) == [
        ("Sum", ["a", "b", "c"], ["s"], NCHW),
        ("Accuracy", ["pred", "label"], ["acc"], {"top_k": 3, **NCHW}),
        ("Accuracy", ["pred", "label"], ["acc1"], {"top_k": 1, **NCHW}),
    ]


def test_iter_is_a_cpu_counter_even_in_a_cuda_scope():
    model = ModelHelper(name="brew_iter")
    with DeviceScope(DeviceOption(CUDA, 2)), NameScope("gpu_2"):
        it = brew.iter(model, "ITER")
    assert it == "gpu_2/ITER"
    assert ops_of(model.param_init_net) == [
        ("ConstantFill", [], ["gpu_2/ITER"], {"shape": [1], "value": 0, "dtype": "int64"})]
    assert ops_of(model.net) == [("Iter", ["gpu_2/ITER"], ["gpu_2/ITER"], {})]
    every_op = model.param_init_net.Proto().ops + model.net.Proto().ops
    assert all(op.device_option == DeviceOption(CPU, 0) for op in every_op)
    assert model.params == []


def test_arg_scope_precedence():
    model = ModelHelper(name="brew_argscope", arg_scope={"axis": 3})
    brew.fc(model, "x", "a", 2, 2)  # model.arg_scope reaches the op of a helper that takes **kwargs
    with brew.arg_scope([brew.fc, brew.softmax], axis=2):
        brew.fc(model, "x", "b", 2, 2)  # arg_scope beats model.arg_scope
        brew.fc(model, "x", "c", 2, 2, axis=1)  # explicit beats both
        with brew.arg_scope(brew.fc, axis_w=1):  # nested scopes add up
            brew.fc(model, "x", "d", 2, 2)
        brew.softmax(model, "x", "s")
    brew.fc(model, "x", "e", 2, 2)  # the scope is gone
    brew.leaky_relu(model, "x", "l")  # no **kwargs: model.arg_scope filtered to its own arguments
    assert [op.args for op in model.net.Proto().ops] == [
        {"axis": 3, **NCHW},
        {"axis": 2, **NCHW},
        {"axis": 1, **NCHW},
        {"axis": 2, "axis_w": 1, **NCHW},
        {"axis": 2, **NCHW},
        {"axis": 3, **NCHW},
        {},
    ]
    with_alpha = ModelHelper(name="brew_argscope_alpha", arg_scope={"alpha": 0.3})
    brew.leaky_relu(with_alpha, "x", "l")  # a named argument is taken from model.arg_scope
    with brew.arg_scope(brew.leaky_relu, alpha=0.2):
        brew.leaky_relu(with_alpha, "x", "m")
        brew.leaky_relu(with_alpha, "x", "n", 0.1)  # positional arguments win over scopes too
    assert [op.args for op in with_alpha.net.Proto().ops] == [{"alpha": 0.3}, {"alpha": 0.2}, {"alpha": 0.1}]


def test_arg_scope_takes_only_brew_helpers():
    with pytest.raises(TypeError, match="brew helpers"):
        with brew.arg_scope(print, x=1):
            pass
    with pytest.raises(TypeError, match="brew helpers"):
        with brew.arg_scope(["fc"], x=1):
            pass


def test_helpers_need_a_model_first():
    with pytest.raises(TypeError, match="first argument must be a ModelHelper"):
        brew.fc("data", "fc", 2, 2)
    model = ModelHelper(name="brew_model_kw")
    assert brew.relu(model=model, blob_in="x", blob_out="y") == "y"


def test_register_custom_helper():
    def brew_test_scaled_fc(model, blob_in, blob_out, dim, scale=1.0):
        h = brew.fc(model, blob_in, blob_out + "_fc", dim, dim)
        return model.net.Scale(h, blob_out, scale=scale)

    helper = brew.Register(brew_test_scaled_fc)
    try:
        assert brew.brew_test_scaled_fc is helper
        model = ModelHelper(name="brew_custom")
        with brew.arg_scope(helper, scale=0.5):
            brew.brew_test_scaled_fc(model, "x", "y", 2)
        assert ops_of(model.net)[-1] == ("Scale", ["y_fc"], ["y"], {"scale": 0.5})
        with pytest.raises(ValueError, match="already exists"):
            brew.Register(brew_test_scaled_fc)
    finally:
        brew._HELPERS.pop("brew_test_scaled_fc")
    with pytest.raises(AttributeError, match="no helper 'no_such_helper'"):
        brew.no_such_helper  # noqa: B018


def test_output_names_must_be_strings():
    with pytest.raises(TypeError, match="output blob names must be strings"):
        brew.fc(ModelHelper(name="brew_none"), "x", None, 2, 2)


def test_parameter_sharing_through_brew():
    model = ModelHelper(name="brew_share")
    brew.fc(model, "x", "fc", 2, 3)
    brew.fc(model, "y", BlobReference("fc"), 2, 3)  # same names and shapes: shared, no new fills
    assert model.params == ["fc_w", "fc_b"] and len(model.param_init_net.Proto().ops) == 2
    assert [op.inputs for op in model.net.Proto().ops] == [["x", "fc_w", "fc_b"], ["y", "fc_w", "fc_b"]]
    with pytest.raises(ValueError, match="already exists"):
        brew.fc(model, "z", "fc", 2, 4)


# ---- numerics: brew layers run through the workspace equal torch.nn.functional --------------------


def run_model(model: ModelHelper, feeds: dict[str, np.ndarray]) -> None:
    for name, value in feeds.items():
        workspace.FeedBlob(name, value)
    workspace.RunNetOnce(model.param_init_net)
    workspace.RunNetOnce(model.net)


def fetch(name: str) -> torch.Tensor:
    return workspace.FetchTensor(name)


def test_fc_forward_and_initialisers_numerically():
    model = ModelHelper(name="brew_num_fc")
    brew.fc(model, "x", "y", dim_in=50, dim_out=30)
    x = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)
    run_model(model, {"x": x})
    w, b = fetch("y_w"), fetch("y_b")
    assert w.shape == (30, 50) and w.dtype == torch.float32 and torch.equal(b, torch.zeros(30))
    bound = math.sqrt(3 / 50)  # XavierFill: U(-sqrt(3/fan_in), +sqrt(3/fan_in))
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    torch.testing.assert_close(fetch("y"), F.linear(torch.from_numpy(x), w, b))


@pytest.mark.parametrize(("kwargs", "torch_kwargs"), [
    ({"kernel": 3, "stride": 2, "pad": 1, "group": 2}, {"stride": 2, "padding": 1, "groups": 2}),
    ({"kernel": [3, 1], "no_bias": True, "dilation": 2}, {"dilation": 2}),
])
def test_conv_forward_numerically(kwargs, torch_kwargs):
    model = ModelHelper(name="brew_num_conv")
    brew.conv(model, "x", "y", dim_in=4, dim_out=6, **kwargs)
    x = np.random.default_rng(1).standard_normal((2, 4, 9, 8)).astype(np.float32)
    run_model(model, {"x": x})
    bias = fetch("y_b") if workspace.HasBlob("y_b") else None
    expected = F.conv2d(torch.from_numpy(x), fetch("y_w"), bias, **torch_kwargs)
    torch.testing.assert_close(fetch("y"), expected)


def test_spatial_bn_training_and_test_numerically():
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((4, 3, 5, 5)).astype(np.float32)) * 2 + 1
    model = ModelHelper(name="brew_num_bn")
    brew.spatial_bn(model, "x", "y", dim_in=3, init_scale=1.5, init_bias=0.25, epsilon=1e-3, momentum=0.8)
    run_model(model, {"x": x.numpy()})
    scale, bias = torch.full((3,), 1.5), torch.full((3,), 0.25)
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    expected = F.batch_norm(x, running_mean, running_var, scale, bias, training=True, momentum=0.2, eps=1e-3)
    torch.testing.assert_close(fetch("y"), expected)
    torch.testing.assert_close(fetch("y_rm"), running_mean)
    torch.testing.assert_close(fetch("y_riv"), running_var)
    mean, var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(fetch("y_sm"), mean)
    torch.testing.assert_close(fetch("y_siv"), 1 / torch.sqrt(var + 1e-3))

    test_model = ModelHelper(name="brew_num_bn_test", init_params=False)  # reads the trained stats
    brew.spatial_bn(test_model, "x", "y_test", dim_in=3, epsilon=1e-3, is_test=True)
    for suffix in ("_s", "_b", "_rm", "_riv"):
        workspace.FeedBlob("y_test" + suffix, workspace.FetchBlob("y" + suffix))
    workspace.RunNetOnce(test_model.net)
    expected = F.batch_norm(x, running_mean, running_var, scale, bias, training=False, eps=1e-3)
    torch.testing.assert_close(fetch("y_test"), expected)
