"""Caffe2's own float16 recipe, without the precision pass: FloatToHalf data, PseudoFP16Initializer params,
`brew.conv/fc(..., float16_compute=True)`, HalfToFloat before the loss, `build_multi_precision_sgd`."""

from __future__ import annotations

import numpy as np
import torch

from graphpar import brew, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm


def _forward(model, loss_scale):
    data = model.net.FloatToHalf("data", "data_fp16")
    with brew.arg_scope([brew.conv, brew.fc], WeightInitializer=model_helper.PseudoFP16Initializer,
                        BiasInitializer=model_helper.PseudoFP16Initializer, float16_compute=True):
        h = brew.conv(model, data, "conv", dim_in=1, dim_out=4, kernel=3, pad=1)
        h = brew.relu(model, h, h)
        pred = brew.fc(model, h, "pred", dim_in=4 * 8 * 8, dim_out=10)
    pred32 = model.net.HalfToFloat(pred, "pred_fp32")
    _, loss = model.net.SoftmaxWithLoss([pred32, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def test_caffe2_fp16_recipe_trains_fp16_params_through_fp32_masters():
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="c2fp16")
    dpm.Parallelize(model, lambda m: None, _forward, devices=[0, 1], cpu_device=True,
                    optimizer_builder_fun=lambda m: optimizer.build_multi_precision_sgd(m, 0.1, momentum=0.9))
    assert any(op.args.get("float16_compute") for op in model.net.Proto().ops if op.type == "Conv")
    rng = np.random.default_rng(0)
    for step in range(3):
        for d in (0, 1):
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((2, 1, 8, 8), dtype=np.float32))
            workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 10, 2).astype(np.int32))
        if step == 0:
            dpm.RunInitNet(model)
            start = workspace.FetchBlob("cpu_0/conv_w_fp32")
        dpm.RunNet(model, 1)
    assert workspace.FetchTensor("cpu_0/conv").dtype == torch.float16
    assert workspace.FetchTensor("cpu_1/conv_w").dtype == torch.float16
    master = workspace.FetchBlob("cpu_1/conv_w_fp32")
    assert master.dtype == np.float32 and not np.array_equal(master, start)
    np.testing.assert_array_equal(workspace.FetchTensor("cpu_1/conv_w").numpy(), master.astype(np.float16))
    assert np.isfinite(workspace.FetchBlob("cpu_0/loss"))


def test_a_static_multi_precision_loss_scale_that_overflows_skips_the_step_and_keeps_masters_finite(caplog):
    """Issue 23 item 11 on Caffe2's path: build_multi_precision_sgd(loss_scale=2**20) with the loss scaled
    by 2**20 and check_finite_loss: the loss is finite, the float16 gradients overflow; the step is skipped
    with a warning and every fp32 master keeps its value (before: they all became inf or NaN)."""
    import logging

    scale = 2.0 ** 20

    def forward(model, loss_scale):
        return _forward(model, loss_scale * scale)

    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="c2fp16_scaled")
    dpm.Parallelize(model, lambda m: None, forward, devices=[0, 1], cpu_device=True, check_finite_loss=True,
                    optimizer_builder_fun=lambda m: optimizer.build_multi_precision_sgd(m, 0.1, momentum=0.9,
                                                                                        loss_scale=scale))
    rng = np.random.default_rng(0)
    for d in (0, 1):
        workspace.FeedBlob(f"cpu_{d}/data", 100 * rng.standard_normal((2, 1, 8, 8), dtype=np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 10, 2).astype(np.int32))
    dpm.RunInitNet(model)
    masters = {b: workspace.FetchBlob(b) for b in workspace.Blobs() if b.endswith("_fp32") and "_grad" not in b}
    with caplog.at_level(logging.WARNING, logger="graphpar.data_parallel_model"):
        dpm.RunNet(model, 1)
    assert "step skipped" in caplog.text and "loss scale 1.04858e+06" in caplog.text
    assert len(masters) == 8
    for name, value in masters.items():
        np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)
    assert workspace.FetchBlob("optimizer_iteration") == 0
