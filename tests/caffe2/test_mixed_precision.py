"""Caffe2's mixed-precision recipe: float16 params made from float32 masters (PseudoFP16Initializer),
float16 forward and backward, static loss scaling, and build_multi_precision_sgd updating the
masters. The reference is the same model in float32 from the same initial values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import brew, model_helper, optimizer, workspace
from graphpar.model_helper import PseudoFP16Initializer

LOSS_SCALE = 128.0


def _model(fp16: bool) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="fp16" if fp16 else "fp32")
    init = PseudoFP16Initializer if fp16 else None
    data = model.net.FloatToHalf(["data"], "data_fp16") if fp16 else "data"
    hidden = brew.relu(model, brew.fc(model, data, "fc1", 8, 16, WeightInitializer=init, BiasInitializer=init), "h")
    pred = brew.fc(model, hidden, "pred", 16, 4, WeightInitializer=init, BiasInitializer=init)
    if fp16:
        pred = model.net.HalfToFloat([pred], "pred_fp32")
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    model.AddGradientOperators([model.net.Scale(loss, "scaled_loss", scale=LOSS_SCALE if fp16 else 1.0)])
    if fp16:
        optimizer.build_multi_precision_sgd(model, 0.1, momentum=0.9, loss_scale=LOSS_SCALE)
    else:
        optimizer.build_sgd(model, 0.1, momentum=0.9)
    return model


def _feed_batch(seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    workspace.FeedBlob("data", rng.standard_normal((32, 8)).astype(np.float32))
    workspace.FeedBlob("label", rng.integers(0, 4, 32).astype(np.int32))


def test_float16_training_with_float32_masters_tracks_float32() -> None:
    params = ["fc1_w", "fc1_b", "pred_w", "pred_b"]
    half = _model(True)
    _feed_batch()
    workspace.RunNetOnce(half.param_init_net)
    assert all(workspace.FetchTensor(p).dtype == torch.float16 for p in params)
    masters = {p: workspace.FetchBlob(f"{p}_fp32") for p in params}
    workspace.SwitchWorkspace("float32_reference", True)
    full = _model(False)
    _feed_batch()
    workspace.RunNetOnce(full.param_init_net)
    for p in params:  # the reference starts from the masters' values
        workspace.FeedBlob(p, masters[p])
    workspace.CreateNet(full.net)
    workspace.RunNet(full.net, 5)
    reference = {p: workspace.FetchBlob(p) for p in params}
    workspace.SwitchWorkspace("default")
    workspace.CreateNet(half.net)
    workspace.RunNet(half.net, 5)
    for p in params:
        master, param = workspace.FetchTensor(f"{p}_fp32"), workspace.FetchTensor(p)
        assert torch.equal(param, master.half())  # the float16 param is the cast master
        assert workspace.FetchTensor(f"{p}_grad").dtype == torch.float16
        assert not np.array_equal(master.numpy(), masters[p])  # it trained
        np.testing.assert_allclose(master.numpy(), reference[p], rtol=2e-2, atol=2e-3, err_msg=p)


def test_loss_scale_must_be_positive() -> None:
    with pytest.raises(ValueError, match="loss_scale"):
        optimizer.MultiPrecisionSgdOptimizer(0.1, loss_scale=0.0)


def _parallel_masters(devices: list[int]) -> dict[str, np.ndarray]:
    from graphpar import data_parallel_model as dpm
    from graphpar.data import feed_batch

    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name=f"fp16_dpm_{len(devices)}")

    def forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
        data = model.net.FloatToHalf(["data"], "data_fp16")
        hidden = brew.relu(model, brew.fc(model, data, "fc1", 8, 16, WeightInitializer=PseudoFP16Initializer,
                                          BiasInitializer=PseudoFP16Initializer), "h")
        pred = brew.fc(model, hidden, "pred", 16, 4, WeightInitializer=PseudoFP16Initializer,
                       BiasInitializer=PseudoFP16Initializer)
        _, loss = model.net.SoftmaxWithLoss([model.net.HalfToFloat([pred], "pred_fp32"), "label"],
                                            ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale * LOSS_SCALE)]

    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_multi_precision_sgd(
                        m, 0.1, momentum=0.9, loss_scale=LOSS_SCALE),
                    devices=devices, cpu_device=True)
    rng = np.random.default_rng(0)
    feed_batch(model, {"data": rng.standard_normal((16, 8)).astype(np.float32),
                       "label": rng.integers(0, 4, 16).astype(np.int32)})
    dpm.RunInitNet(model)
    dpm.RunNet(model, 5)
    assert workspace.FetchTensor(f"cpu_{devices[-1]}/fc1_w_grad").dtype == torch.float16
    return {p: workspace.FetchBlob(f"cpu_{devices[-1]}/{p}_fp32") for p in ("fc1_w", "pred_w")}


def test_parallel_float16_training_matches_one_device() -> None:
    """2 CPU devices (float16 gradients all-reduced) track 1 device on the whole batch; the only
    difference is float16 rounding of the per-device gradients."""
    two, one = _parallel_masters([0, 1]), _parallel_masters([0])
    for name in two:
        np.testing.assert_allclose(two[name], one[name], atol=5e-4, err_msg=name)
