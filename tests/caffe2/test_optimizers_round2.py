"""Caffe2's build_storm, build_decay_adagrad, build_gftrl, build_yellowfin, build_adam(use_smart_decay)
and build_adagrad's counter_halflife / use_dedicated_lr_iteration_counter: each optimizer driven with
fed gradients for several steps against a NumPy reference of Caffe2's update (learning-rate sign,
iteration counter and state included), and each trained on a model as Caffe2's OptimizerTestBase does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graphpar import brew, core, model_helper, optimizer, workspace
from tests.ops.test_caffe2_optim_extra import _gftrl_ref, _storm_dense_ref, _YellowFinRef

RNG = np.random.default_rng(1)
STEPS = 4


def _drive(opt: optimizer.Optimizer, param: np.ndarray, grads: list[np.ndarray],
           indices: list[np.ndarray] | None = None) -> None:
    """Record `opt`'s update of the param `w` (= `param`) from a fed gradient (dense `g`, or the slice
    `gi`/`gv` when `indices` are given), then run one step per gradient."""
    workspace.ResetWorkspace()
    net, init = core.Net("update"), core.Net("update_init")
    init.GivenTensorFill([], "w", shape=list(param.shape), values=param.ravel().tolist())
    opt(net, init, "w", "g" if indices is None else core.GradientSlice("gi", "gv"))
    workspace.RunNetOnce(init)
    for step, grad in enumerate(grads):
        if indices is None:
            workspace.FeedBlob("g", grad.astype(np.float32))
        else:
            workspace.FeedBlob("gi", indices[step].astype(np.int64))
            workspace.FeedBlob("gv", grad.astype(np.float32))
        if step == 0:
            workspace.CreateNet(net)
        workspace.RunNet(net)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


def _grads(*shape: int) -> list[np.ndarray]:
    return [_f32(RNG.uniform(-1, 1, shape)) for _ in range(STEPS)]


def _fetch(name: str) -> np.ndarray:
    return workspace.FetchBlob(name).astype(np.float64)


# ---- fed gradients against NumPy references ----------------------------------------------------------


def test_storm_dense_steps() -> None:
    w0, grads = _f32(RNG.uniform(-1, 1, (3, 2))), _grads(3, 2)
    _drive(optimizer.StormOptimizer(lr=0.2, momentum=5.0, beta=0.5, grad_sq_init=0.3), w0, grads)
    w, m, gss = w0, np.zeros_like(w0), np.array([0.3])
    for g in grads:  # Caffe2's LearningRate holds -lr
        w, m, gss = _storm_dense_ref(w, m, gss, g, -0.2, 5.0, 0.5)
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5)
    np.testing.assert_allclose(_fetch("w_moment"), m, rtol=2e-5)
    np.testing.assert_allclose(_fetch("w_grad_sq_sum"), gss, rtol=2e-5)


def test_storm_sparse_steps_touch_only_their_rows() -> None:
    w0 = _f32(RNG.uniform(-1, 1, (6, 2)))
    indices = [np.array([0, 4]), np.array([4, 5]), np.array([2]), np.array([0, 1])]
    grads = [_f32(RNG.uniform(-1, 1, (len(i), 2))) for i in indices]
    _drive(optimizer.StormOptimizer(lr=0.1), w0, grads, indices)
    w, m, gss = w0.copy(), np.zeros_like(w0), np.array([0.01])
    for idx, g in zip(indices, grads):
        new_w, new_m, gss = _storm_dense_ref(w[idx], m[idx], gss, g, -0.1, 10.0, 0.1)
        w[idx], m[idx] = new_w, new_m
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5)
    assert _fetch("w")[3].tolist() == w0[3].tolist()  # never in a slice


def test_decay_adagrad_dense_steps() -> None:
    w0, grads = _f32(RNG.uniform(-1, 1, (3, 2))), _grads(3, 2)
    _drive(optimizer.DecayAdagradOptimizer(alpha=0.1, beta1=0.5, epsilon=0.1, weight_decay=0.01), w0, grads)
    w, m1, m2 = w0, np.zeros_like(w0), np.zeros_like(w0)
    for it, g in enumerate(grads, start=1):  # the counter reads it at step it; Caffe2's t = it + 1
        m1 = 0.5 * m1 + 0.5 * g
        m2 = m2 + g * g
        w = w - 0.1 * (m1 / (1 - 0.5 ** (it + 1)) / (np.sqrt(m2) + 0.1) + 0.01 * w)
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5)
    np.testing.assert_allclose(_fetch("w_first_mo1ment"), m1, rtol=2e-5)


def test_decay_adagrad_sparse_steps_are_sparse_adagrad() -> None:
    w0 = _f32(RNG.uniform(-1, 1, (5, 2)))
    indices = [np.array([1, 3]), np.array([3]), np.array([0, 1]), np.array([4])]
    grads = [_f32(RNG.uniform(-1, 1, (len(i), 2))) for i in indices]
    _drive(optimizer.DecayAdagradOptimizer(alpha=0.2, epsilon=0.1), w0, grads, indices)
    w, h = w0.copy(), np.zeros_like(w0)
    for idx, g in zip(indices, grads):
        h[idx] += g * g
        w[idx] -= 0.2 * g / (np.sqrt(h[idx]) + 0.1)
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5)


def test_gftrl_steps() -> None:
    w0, grads = _f32(RNG.uniform(-1, 1, (4, 3))), _grads(4, 3)
    args = {"alpha": 0.5, "beta": 0.2, "lambda1": 0.3, "lambda2": 0.1}
    _drive(optimizer.GFtrlOptimizer(**args), w0, grads)
    w, nz = w0, np.zeros((4, 3, 2))
    for g in grads:
        w, nz = _gftrl_ref(w, nz, g, **args)
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(_fetch("w_gftrl_nz"), nz, rtol=2e-5, atol=1e-7)


def test_yellowfin_steps() -> None:
    w0 = _f32(RNG.uniform(-1, 1, (4,)))
    grads = [_f32(RNG.uniform(-1, 1, (4,)) * k) for k in range(1, 7)]
    _drive(optimizer.YellowFinOptimizer(alpha=0.1, mu=0.1, beta=0.9, curv_win_width=3), w0, grads)
    ref = _YellowFinRef(w0, 3, alpha=0.1, mu=0.1, beta=0.9)
    for it, g in enumerate(grads, start=1):
        ref.step(g, it)
    np.testing.assert_allclose(_fetch("w"), ref.param, rtol=1e-4)
    np.testing.assert_allclose(_fetch("w_lr_avg"), [ref.lr_avg], rtol=1e-4)
    np.testing.assert_allclose(_fetch("w_mu_avg"), [ref.mu_avg], rtol=1e-4)


def test_adam_smart_decay_sparse_steps() -> None:
    w0 = _f32(RNG.uniform(-1, 1, (5, 2)))
    indices = [np.array([0, 2]), np.array([2]), np.array([4]), np.array([0, 4])]
    grads = [_f32(RNG.uniform(-1, 1, (len(i), 2))) for i in indices]
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 0.05
    _drive(optimizer.AdamOptimizer(lr, b1, b2, eps, use_smart_decay=True), w0, grads, indices)
    w, m, v, seen = w0.copy(), np.zeros_like(w0), np.zeros_like(w0), np.zeros(5)
    for it, (idx, g) in enumerate(zip(indices, grads), start=1):
        t = it + 1
        for row, gi in zip(idx, g):
            k = t - seen[row]
            catchup = m[row] * b1 * (1 - b1 ** (k - 1)) / (1 - b1) if k > 1 else 0.0
            m[row] = m[row] * b1 ** k + gi * (1 - b1)
            v[row] = v[row] * b2 ** k + gi * gi * (1 - b2)
            w[row] = w[row] - lr * (m[row] + catchup) / (np.sqrt(v[row]) + eps)
            seen[row] = t
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5)
    assert workspace.FetchBlob("w_last_seen").tolist() == seen.tolist()


def test_adagrad_counter_halflife_counts_row_updates() -> None:
    w0 = _f32(RNG.uniform(-1, 1, (4, 2)))
    indices = [np.array([0, 2]), np.array([2]), np.array([2, 3]), np.array([0])]
    grads = [_f32(RNG.uniform(-1, 1, (len(i), 2))) for i in indices]
    _drive(optimizer.AdagradOptimizer(0.5, counter_halflife=2), w0, grads, indices)
    counter, prev = np.zeros(4), np.zeros(4)
    w, h = w0.copy(), np.zeros_like(w0)
    for it, (idx, g) in enumerate(zip(indices, grads), start=1):
        h[idx] += g * g
        w[idx] -= 0.5 * g / (np.sqrt(h[idx]) + 1e-4)  # the update itself is plain Adagrad
        for row in idx:
            counter[row] = 1 + math.exp(-(it - prev[row]) * math.log(2) / 2) * counter[row]
            prev[row] = it
    np.testing.assert_allclose(workspace.FetchBlob("w_update_counter"), counter, rtol=1e-12)
    assert workspace.FetchBlob("w_prev_update_iter").tolist() == prev.tolist()
    np.testing.assert_allclose(_fetch("w"), w, rtol=2e-5)


# ---- on a model, as Caffe2's OptimizerTestBase -----------------------------------------------------------


def _model() -> model_helper.ModelHelper:
    model = model_helper.ModelHelper("opt_model")
    fc = brew.fc(model, "data", "fc", 4, 2)
    loss = model.net.AveragedLoss(model.net.SquaredL2Distance([fc, "target"], "dist"), "loss")
    model.AddGradientOperators([loss])
    return model


@pytest.mark.parametrize("build, local, shared", [
    (lambda m: optimizer.build_storm(m, 0.3), ["fc_b_grad_sq_sum", "fc_b_moment", "fc_w_grad_sq_sum", "fc_w_moment"],
     []),
    (lambda m: optimizer.build_decay_adagrad(m, 0.1),
     ["fc_b_first_mo1ment", "fc_b_second_moment", "fc_w_first_mo1ment", "fc_w_second_moment"],
     ["optimizer_iteration"]),
    (lambda m: optimizer.build_gftrl(m, engine=None, alpha=1.0, beta=0.1, lambda1=0.0, lambda2=0.0),
     ["fc_b_gftrl_nz", "fc_w_gftrl_nz"], []),
    (lambda m: optimizer.build_yellowfin(m, base_learning_rate=0.1),
     sorted(f"fc_{p}_{s}" for p in "bw" for s in ("moment", "lr_avg", "mu_avg", "curv_win", "g_avg", "g2_avg",
                                                   "scalars_memory")), ["optimizer_iteration"]),
    (lambda m: optimizer.build_adam(m, 0.1, use_smart_decay=True),
     sorted(f"fc_{p}_{s}" for p in "bw" for s in ("first_moment", "second_moment", "last_seen")),
     ["optimizer_iteration"]),
    (lambda m: optimizer.build_adagrad(m, 0.5, counter_halflife=5),
     sorted(f"fc_{p}_{s}" for p in "bw" for s in ("squared_sum", "update_counter", "prev_update_iter")),
     ["optimizer_iteration"]),
], ids=["storm", "decay_adagrad", "gftrl", "yellowfin", "adam-smart-decay", "adagrad-counter-halflife"])
def test_round2_optimizers_train_and_list_their_state(build, local, shared) -> None:  # noqa: ANN001
    workspace.ResetWorkspace()
    model = _model()
    aux = build(model).get_auxiliary_parameters()
    assert (sorted(aux.local), aux.shared) == (local, shared)  # Caffe2's split
    rng = np.random.default_rng(0)
    workspace.FeedBlob("data", rng.standard_normal((16, 4)).astype(np.float32))
    workspace.FeedBlob("target", rng.standard_normal((16, 2)).astype(np.float32))
    workspace.RunNetOnce(model.param_init_net)
    workspace.CreateNet(model.net)
    workspace.RunNet(model.net)
    first = float(workspace.FetchBlob("loss"))
    workspace.RunNet(model.net, 30)
    assert float(workspace.FetchBlob("loss")) < first


def test_dedicated_lr_iteration_counter_drives_the_learning_rate() -> None:
    workspace.ResetWorkspace()
    model = _model()
    optimizer.build_adagrad(model, 0.5, use_dedicated_lr_iteration_counter=True, policy="step", stepsize=1,
                            gamma=0.5)
    lr_op = next(op for op in model.net.Proto().op if op.type == "LearningRate")
    assert lr_op.input == ["optimizer_iteration_lr"]
    assert not model.net.BlobIsDefined("optimizer_iteration")
    workspace.FeedBlob("data", np.ones((2, 4), np.float32))
    workspace.FeedBlob("target", np.zeros((2, 2), np.float32))
    workspace.RunNetOnce(model.param_init_net)
    workspace.FeedBlob("optimizer_iteration_lr", np.array([3], np.int64))  # the LR schedule's own clock
    workspace.CreateNet(model.net)
    workspace.RunNet(model.net)
    np.testing.assert_allclose(workspace.FetchBlob(lr_op.output[0]), [-0.5 * 0.5 ** 4], rtol=1e-6)


@pytest.mark.parametrize("build, message", [
    (lambda m: optimizer.build_adagrad(m, 0.5, counter_halflife=1.5), "counter_halflife must be an int"),
    (lambda m: optimizer.build_adam(m, 0.1, use_smart_decay=True, enableRAdam=True), "Smart decay is not"),
    (lambda m: optimizer.build_yellowfin(m, 0.1, policy="step"), "tunes its own learning rate"),
    (lambda m: optimizer.build_storm(m, 0.1, beta=-1.0), "beta must be"),
])
def test_bad_options_name_themselves_before_anything_is_recorded(build, message) -> None:  # noqa: ANN001
    model = _model()
    ops_before = len(model.net.Proto().op)
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        build(model)
    assert len(model.net.Proto().op) == ops_before


def test_gftrl_and_yellowfin_refuse_sparse_gradients() -> None:
    for opt in (optimizer.GFtrlOptimizer(), optimizer.YellowFinOptimizer()):
        with pytest.raises(NotImplementedError, match="no sparse update"):
            opt.check(core.Net("init"), "w", core.GradientSlice("i", "v"))


@pytest.mark.parametrize("options, error, message", [
    ({"weight_decay": 0.1}, NotImplementedError, "Caffe2's weight_decay is not implemented"),
    ({"ema_options": {"ema_alpha": 0.5}}, NotImplementedError, "Caffe2's ema_options is not implemented"),
    ({"bogus": 1}, TypeError, r"unknown option\(s\) \['bogus'\]: neither an option of this optimizer nor"),
])
def test_adagrad_errors_name_the_option_not_the_policy(options, error, message) -> None:  # noqa: ANN001
    with pytest.raises(error, match=message) as caught:
        optimizer.build_adagrad(_model(), 0.1, **options)
    assert "sub_policy" not in str(caught.value)  # not the learning-rate policy's argument list


def test_caffe2s_off_values_of_unimplemented_adagrad_options_are_accepted() -> None:
    opt = optimizer.build_adagrad(_model(), 0.1, weight_decay=0.0, sparse_dedup_aggregator=None, engine="SIMD")
    assert opt.engine == "SIMD"
