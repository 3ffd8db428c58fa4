"""Caffe2's `Parallelize` arguments: `ideep` (MKL-DNN CPU devices) runs as CPU replicas here, and a
Caffe2-style CPU script trains with its imports changed."""

from __future__ import annotations

import numpy as np

from graphpar import brew, data_parallel_model, model_helper, optimizer, workspace


def _build(parallelize, **kwargs) -> model_helper.ModelHelper:  # noqa: ANN001
    model = model_helper.ModelHelper(name="c2_dpm")

    def add_input(model: model_helper.ModelHelper) -> None:
        pass  # data and label are fed per device

    def forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
        fc = brew.fc(model, "data", "fc", 4, 3)
        softmax, loss = model.net.SoftmaxWithLoss([fc, "label"], ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    parallelize(model, input_builder_fun=add_input, forward_pass_builder_fun=forward,
                optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], **kwargs)
    return model


def _train(model: model_helper.ModelHelper) -> np.ndarray:
    rng = np.random.default_rng(0)
    for device in (0, 1):
        workspace.FeedBlob(f"cpu_{device}/data", rng.standard_normal((4, 4)).astype(np.float32))
        workspace.FeedBlob(f"cpu_{device}/label", rng.integers(0, 3, 4).astype(np.int32))
    data_parallel_model.RunInitNet(model)
    data_parallel_model.RunNet(model, 3)
    return workspace.FetchBlob("cpu_0/fc_w")


def test_ideep_runs_as_cpu_replicas() -> None:
    reference = _train(_build(data_parallel_model.Parallelize, cpu_device=True))
    workspace.ResetWorkspace()
    model = _build(data_parallel_model.Parallelize_iDeep)
    assert data_parallel_model.GetDevices(model) == [0, 1]
    assert {"cpu_0/fc_w", "cpu_1/fc_w"} <= set(map(str, model.GetParams("")))
    np.testing.assert_array_equal(_train(model), reference)


def test_predictor_of_a_softmax_with_loss_model_needs_no_label() -> None:
    model = model_helper.ModelHelper(name="c2_predict")

    def forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
        _, loss = model.net.SoftmaxWithLoss([brew.fc(model, "data", "fc", 4, 3), "label"], ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    data_parallel_model.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0],
                                    cpu_device=True)
    predictor, export = data_parallel_model.ExtractPredictorNet(model, ["data"], ["softmax"])
    assert export == ["fc_w", "fc_b"]  # no "label": only the loss read it
    assert [op.type for op in predictor.Proto().op] == ["FC", "Softmax"]
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((5, 4), (3, 4), (3,)))
    for name, value in (("data", x), ("fc_w", w), ("fc_b", b)):
        workspace.FeedBlob(name, value)
    workspace.RunNetOnce(predictor)
    logits = x @ w.T + b
    expected = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(workspace.FetchBlob("softmax"), expected / expected.sum(1, keepdims=True),
                               rtol=1e-5)
