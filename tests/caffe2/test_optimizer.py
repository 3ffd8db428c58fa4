"""Caffe2's optimizer names: weight-decay blobs, auxiliary parameters, LR injection, option checks,
and `optimizer_context.UseOptimizer`."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import brew, model_helper, optimizer, workspace
from graphpar.optimizer_context import UseOptimizer


def _model() -> model_helper.ModelHelper:
    model = model_helper.ModelHelper("opt_model")
    fc = brew.fc(model, "data", "fc", 4, 2)
    loss = model.net.AveragedLoss(model.net.SquaredL2Distance([fc, "target"], "dist"), "loss")
    model.AddGradientOperators([loss])
    return model


def _train(model: model_helper.ModelHelper, steps: int = 2) -> None:
    rng = np.random.default_rng(0)
    workspace.FeedBlob("data", rng.standard_normal((8, 4)).astype(np.float32))
    workspace.FeedBlob("target", rng.standard_normal((8, 2)).astype(np.float32))
    workspace.RunNetOnce(model.param_init_net)
    workspace.CreateNet(model.net)
    workspace.RunNet(model.net, steps)


def test_weight_decay_uses_caffe2_blob_names() -> None:
    model = _model()
    optimizer.add_weight_decay(model, 1e-4)
    init = {b for op in model.param_init_net.Proto().op for b in op.output}
    assert {"wd_0_0", "ONE_0_0"} <= init
    decay = [op for op in model.net.Proto().op if op.type == "WeightedSum"]
    assert [op.input for op in decay] == [["fc_w_grad", "ONE_0_0", "fc_w", "wd_0_0"]]  # weights only


def test_auxiliary_parameters_split_local_and_shared() -> None:
    model = _model()
    opt = optimizer.build_sgd(model, 0.1, momentum=0.9)
    aux = opt.get_auxiliary_parameters()
    assert sorted(aux.local) == ["fc_b_momentum", "fc_w_momentum"]
    assert aux.shared == ["ONE_0_0"]  # as Caffe2: the step counter is not SGD's state
    adam = optimizer.build_adam(_model(), 0.1).get_auxiliary_parameters()
    assert "optimizer_iteration" in adam.shared and "fc_w_first_moment" in adam.local


def test_lr_injection_get_and_set() -> None:
    model = _model()
    optimizer.build_sgd(model, 0.1, allow_lr_injection=True)
    _train(model, 1)
    assert optimizer.get_lr_injection().tolist() == [1.0]
    before = workspace.FetchBlob("fc_w")
    optimizer.set_lr_injection(0.0)
    workspace.RunNet(model.net)
    np.testing.assert_array_equal(workspace.FetchBlob("fc_w"), before)  # a zero multiplier freezes training


def test_adam_accepts_caffe2_options() -> None:
    model = _model()
    optimizer.build_adam(model, 0.01, max_gradient_norm=1.0, allow_lr_injection=True)
    _train(model)
    assert workspace.HasBlob("fc_w_first_moment")
    with pytest.raises(NotImplementedError, match="use_smart_decay"):
        optimizer.build_adam(_model(), 0.01, use_smart_decay=True, enableRAdam=True)  # as Caffe2


@pytest.mark.parametrize("build, local, shared", [
    (lambda m: optimizer.build_sgd(m, 0.1, lars=0.5), [], ["ONE_0_0"]),
    (lambda m: optimizer.build_adagrad(m, 0.5, lars=0.5), ["fc_b_squared_sum", "fc_w_squared_sum"], []),
    (lambda m: optimizer.build_rms_prop(m, 0.01, epsilon=0.1),
     ["fc_b_mean_squares", "fc_b_momentum", "fc_w_mean_squares", "fc_w_momentum"], []),
    (lambda m: optimizer.build_adadelta(m, 1.0, decay=0.995),
     ["fc_b_squared_moment", "fc_b_squared_moment_update", "fc_w_squared_moment", "fc_w_squared_moment_update"],
     []),
    (lambda m: optimizer.build_wngrad(m, 2.0), ["fc_b_moment", "fc_w_moment"], []),
    (lambda m: optimizer.build_ftrl(m, engine=None, alpha=0.5, beta=0.1), ["fc_b_ftrl_nz", "fc_w_ftrl_nz"], []),
    (lambda m: optimizer.build_adam(m, 0.05, enableRAdam=True),
     ["fc_b_first_moment", "fc_b_second_moment", "fc_w_first_moment", "fc_w_second_moment"],
     ["optimizer_iteration"]),
], ids=["sgd-lars", "adagrad-lars", "rms_prop", "adadelta", "wngrad", "ftrl", "radam"])
def test_more_caffe2_optimizers_train_and_list_their_state(build, local, shared) -> None:  # noqa: ANN001
    model = _model()
    opt = build(model)
    aux = opt.get_auxiliary_parameters()
    assert (sorted(aux.local), aux.shared) == (local, shared)  # Caffe2's split
    _train(model, 1)
    first = float(workspace.FetchBlob("loss"))
    workspace.RunNet(model.net, 30)
    assert float(workspace.FetchBlob("loss")) < first


def test_multi_precision_sgd_on_float32_params_is_sgd() -> None:
    results = []
    for build in (optimizer.build_sgd, optimizer.build_multi_precision_sgd, optimizer.build_fp16_sgd):
        workspace.ResetWorkspace()
        model = _model()
        build(model, 0.1, momentum=0.9)
        _train(model)
        results.append(workspace.FetchBlob("fc_w"))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_use_optimizer_records_each_params_optimizer() -> None:
    model = model_helper.ModelHelper("ctx")
    sgd, adam = object(), object()
    with UseOptimizer({"WEIGHT": sgd}):
        brew.fc(model, "x", "a", 3, 2)
    with UseOptimizer(adam):
        brew.fc(model, "a", "b", 2, 2)
    brew.fc(model, "b", "c", 2, 2)
    info = {name: model.get_param_info(name).optimizer for name in ("a_w", "a_b", "b_w", "b_b", "c_w")}
    assert info == {"a_w": sgd, "a_b": None, "b_w": adam, "b_b": adam, "c_w": None}
