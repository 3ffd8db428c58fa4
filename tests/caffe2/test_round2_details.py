"""Caffe2 details its own tests and trainer rely on: SoftmaxWithLoss(only_loss=True), enable_tensor_core
through brew.arg_scope, ModelHelper.GetOptimizationParamInfo, Parallelize with a forward builder
returning [] (no loss on that replica), shape errors as Caffe2's run-time enforce failures,
and GetGpuPeerAccessPattern on logical GPUs placed on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import brew, core, data_parallel_model, model_helper, optimizer, workspace
from graphpar.devices import cuda_on_cpu
from graphpar.errors import ParallelizeError, ShapeInferenceError
from graphpar.model_helper import PseudoFP16Initializer


def test_softmax_with_loss_accepts_only_loss_and_computes_the_same() -> None:
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    label = np.array([0, 2, 1, 2], np.int32)
    results = []
    for args in ({}, {"only_loss": True}):
        workspace.ResetWorkspace()
        net = core.Net("swl")
        net.SoftmaxWithLoss(["x", "label"], ["p", "loss"], **args)
        workspace.FeedBlob("x", x)
        workspace.FeedBlob("label", label)
        workspace.RunNetOnce(net)
        results.append(float(workspace.FetchBlob("loss")))
    want = torch.nn.functional.cross_entropy(torch.from_numpy(x), torch.from_numpy(label).long()).item()
    assert results[1] == results[0] and abs(results[0] - want) < 1e-6


def test_enable_tensor_core_reaches_neither_fc_nor_conv() -> None:
    model = model_helper.ModelHelper("tc")
    with brew.arg_scope([brew.conv, brew.fc], enable_tensor_core=True):
        conv = brew.conv(model, "data", "conv", 3, 4, kernel=3)
        brew.fc(model, conv, "fc", 4 * 6 * 6, 2)
    ops = {op.type: op for op in model.net.Proto().op}
    assert "enable_tensor_core" not in ops["FC"].arg and "enable_tensor_core" not in ops["Conv"].arg
    workspace.ResetWorkspace()
    workspace.FeedBlob("data", np.ones((2, 3, 8, 8), np.float32))
    workspace.RunNetOnce(model.param_init_net)
    workspace.RunNetOnce(model.net)  # FC rejected the argument before
    assert workspace.FetchBlob("fc").shape == (2, 2)


def test_get_optimization_param_info_lists_params_with_gradients() -> None:
    model = model_helper.ModelHelper("info")
    fc1 = brew.fc(model, "data", "fc1", 3, 4)
    brew.fc(model, "data", "unused", 3, 4)  # no gradient: not listed
    loss = model.net.AveragedLoss(fc1, "loss")
    model.AddGradientOperators([loss])
    infos = model.GetOptimizationParamInfo()
    assert [(str(i.blob), str(i.grad)) for i in infos] == [("fc1_w", "fc1_w_grad"), ("fc1_b", "fc1_b_grad")]
    assert [str(i.blob) for i in model.GetOptimizationParamInfo(["fc1_b"])] == ["fc1_b"]
    assert [str(i.blob) for i in model.GetOptimizationParamInfo(model.GetParams())] == ["fc1_w", "fc1_b"]


def test_parallelize_accepts_a_forward_builder_returning_no_loss() -> None:
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper("barrier")
    data_parallel_model.Parallelize_CPU(model, input_builder_fun=lambda m: None,
                                        forward_pass_builder_fun=lambda m, s: [],
                                        optimizer_builder_fun=lambda m: None, devices=[1, 2, 3])
    data_parallel_model.RunInitNet(model)
    data_parallel_model.RunNet(model, 1)
    assert model._losses_by_gpu == {1: [], 2: [], 3: []}


def test_losses_on_some_replicas_only_are_refused() -> None:
    """A replica without a loss would get no gradients and drift from the others: a clear error."""
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper("mixed")

    def forward(m: model_helper.ModelHelper, scale: float) -> list:
        fc = brew.fc(m, "data", "fc", 3, 1)
        loss = m.net.Scale(m.net.AveragedLoss(fc, "l"), "sl", scale=scale)
        return [loss] if core.ScopedName("") == "cpu_0/" else []

    with pytest.raises(ParallelizeError, match=r"losses for devices \[0\] only"):
        data_parallel_model.Parallelize_CPU(
            model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
            optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 1.0), devices=[0, 1])


def test_a_shape_error_at_create_net_is_also_caffe2s_runtime_enforce_failure() -> None:
    """Caffe2's Split of 3 values into 2 failed when run, with a RuntimeError saying `enforce fail`;
    graphpar raises that too when the net runs, before any op (and it is still a ValueError)."""
    net = core.Net("split")
    net.Proto().type = "dag"
    a = net.AddExternalInput("a")
    net.Split(a, ["b", "c"], axis=0)
    workspace.ResetWorkspace()
    workspace.FeedBlob(a, np.array([1, 2, 3], dtype=np.float32))
    with pytest.raises(RuntimeError, match="enforce fail") as caught:
        workspace.RunNetOnce(net)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ShapeInferenceError)
    assert "Split(a -> b, c): dim 0 of size 3 does not split into 2" in str(caught.value)


def test_peer_access_pattern_describes_logical_gpus_on_the_cpu() -> None:
    workspace.ResetWorkspace()
    with cuda_on_cpu():
        net = core.Net("on_gpu_3")
        with core.DeviceScope(core.DeviceOption(core.CUDA, 3)):
            net.ConstantFill([], "x", shape=[1], value=1.0)
        workspace.CreateNet(net)
        pattern = workspace.GetGpuPeerAccessPattern()
        assert pattern.shape == (4, 4) and pattern.dtype == np.bool_ and pattern.all()  # one memory: all peers
        assert workspace.GetGpuPeerAccessPattern(2).shape == (2, 2)
    if workspace.NumCudaDevices() == 0:
        assert workspace.GetGpuPeerAccessPattern().shape == (0, 0)  # real GPUs: none here


def test_parameter_info_blob_copy_names_the_float32_master_of_a_float16_param() -> None:
    """Caffe2's trainer re-creates each master after the initial sync: HalfToFloat(blob, blob_copy[FLOAT])."""
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper("fp16")
    with brew.arg_scope([brew.fc], WeightInitializer=PseudoFP16Initializer, BiasInitializer=PseudoFP16Initializer):
        brew.fc(model, "data", "half", 3, 2)
    brew.fc(model, "half", "full", 2, 2)
    infos = {str(i.blob): i for i in (model.get_param_info(p) for p in model.GetParams())}
    assert infos["half_w"].blob_copy == {core.DataType.FLOAT: "half_w_fp32"} and infos["full_w"].blob_copy is None
    workspace.RunNetOnce(model.param_init_net)
    workspace.FeedBlob("half_w_fp32", np.zeros((2, 3), np.float32))  # a stale master
    info = infos["half_w"]
    workspace.RunOperatorOnce(core.CreateOperator("HalfToFloat", [info.blob], [info.blob_copy[core.DataType.FLOAT]]))
    np.testing.assert_array_equal(workspace.FetchBlob("half_w_fp32"), workspace.FetchBlob("half_w").astype(np.float32))
