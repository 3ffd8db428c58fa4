"""Optimizer builders: the exact ops and blobs they record, and learning-rate schedules run through a net."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from graphpar import brew, optimizer, workspace
from graphpar.core import CPU, CUDA, DeviceOption, DeviceScope, GradientSlice, NameScope, Net
from graphpar.devices import cuda_on_cpu
from graphpar.model_helper import ModelHelper

CPU0 = DeviceOption(CPU, 0)
PARAMS = ["fc1_w", "fc1_b", "pred_w", "pred_b"]


@pytest.fixture(autouse=True)
def _fresh_instance_numbers():
    optimizer.reset_optimizer_instance_count()


def _forward(model: ModelHelper) -> str:
    h = brew.fc(model, "data", "fc1", dim_in=4, dim_out=3)
    h = brew.relu(model, h, h)
    pred = brew.fc(model, h, "pred", dim_in=3, dim_out=2)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return loss


def _model(gpus: tuple[int, ...] = (), device_type: int = CUDA) -> ModelHelper:
    """An MLP with gradients, unscoped, or replicated on devices `gpus` (scopes gpu_<id>/ or cpu_<id>/)."""
    model = ModelHelper(name="opt")
    if not gpus:
        model.AddGradientOperators([_forward(model)])
        return model
    losses = []
    prefix = "gpu" if device_type == CUDA else "cpu"
    for gpu in gpus:
        with DeviceScope(DeviceOption(device_type, gpu)), NameScope(f"{prefix}_{gpu}"):
            losses.append(_forward(model))
    model.AddGradientOperators(losses)
    return model


def _new_ops(model: ModelHelper, build) -> tuple[list, list, object]:
    """Build the optimizer; return the ops it added to (param_init_net, net) and its return value."""
    init_before, net_before = len(model.param_init_net.Proto().ops), len(model.net.Proto().ops)
    result = build(model)
    return (model.param_init_net.Proto().ops[init_before:], model.net.Proto().ops[net_before:], result)


def _io(ops) -> list[tuple]:
    return [(op.type, list(op.inputs), list(op.outputs)) for op in ops]


def _fill(name: str, like: str | None = None) -> tuple:
    return ("ConstantFill", [like] if like else [], [name])


def test_plain_sgd_uses_weighted_sum_with_a_negative_lr():
    model = _model()
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1))
    lr = opt.get_cpu_blob_name("lr")
    assert lr == "SgdOptimizer_0_lr_cpu"
    assert _io(init) == [_fill("ONE_0_0"), _fill("optimizer_iteration")]
    assert init[1].args["dtype"] == "int64" and init[1].args["value"] == 0
    assert _io(net) == [("Iter", ["optimizer_iteration"], ["optimizer_iteration"]),
                        ("LearningRate", ["optimizer_iteration"], [lr]),
                        *[("WeightedSum", [p, "ONE_0_0", f"{p}_grad", lr], [p]) for p in PARAMS]]
    assert net[1].args == {"base_lr": -0.1, "policy": "fixed"}
    assert all(op.device_option == CPU0 for op in [*init, *net])


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_sgd_keeps_a_momentum_blob_per_param_and_a_positive_lr(nesterov):
    model = _model()
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9, nesterov=nesterov))
    lr = opt.get_cpu_blob_name("lr")
    assert _io(init) == [_fill("ONE_0_0"), _fill("optimizer_iteration"), _fill("fc1_w_momentum", "fc1_w"),
                         *[_fill(f"{p}_momentum", p) for p in PARAMS[1:]]]
    assert _io(net[2:]) == [("MomentumSGDUpdate", [f"{p}_grad", f"{p}_momentum", lr, p],
                             [f"{p}_grad", f"{p}_momentum", p]) for p in PARAMS]
    assert net[1].args["base_lr"] == 0.1
    assert all(op.args == {"momentum": 0.9, "nesterov": nesterov} for op in net[2:])
    assert all(op.args == {"value": 0.0} for op in init[2:])


def test_weight_decay_adds_wd_times_param_to_every_gradient_before_the_update():
    model = _model()
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9, weight_decay=1e-3))
    wd = opt.get_cpu_blob_name("weight_decay")
    assert _fill(wd) in _io(init)
    assert next(op for op in init if op.outputs == [wd]).args["value"] == 1e-3
    decays = [op for op in net if op.type == "WeightedSum"]
    assert _io(decays) == [("WeightedSum", [f"{p}_grad", "ONE_0_0", p, wd], [f"{p}_grad"]) for p in PARAMS]
    for param in PARAMS:
        decay = next(i for i, op in enumerate(net) if op.type == "WeightedSum" and op.inputs[2] == param)
        update = next(i for i, op in enumerate(net) if op.type == "MomentumSGDUpdate" and op.inputs[3] == param)
        assert decay < update


def test_add_weight_decay_touches_weights_only():
    model = _model()
    init, net, helper = _new_ops(model, lambda m: optimizer.add_weight_decay(m, 1e-4))
    wd = "wd_0_0"  # Caffe2's name: wd_<device type>_<device id>
    assert _io(init) == [_fill(wd), _fill("ONE_0_0")]
    assert _io(net) == [("WeightedSum", [f"{p}_grad", "ONE_0_0", p, wd], [f"{p}_grad"])
                        for p in ("fc1_w", "pred_w")]
    assert optimizer.add_weight_decay(model, 0.0) is None


def test_adam_keeps_two_moments_and_reads_the_iteration():
    model = _model()
    init, net, opt = _new_ops(model, lambda m: optimizer.build_adam(m, 0.01, beta1=0.8, beta2=0.99,
                                                                     epsilon=1e-6))
    lr = opt.get_cpu_blob_name("lr")
    assert lr == "AdamOptimizer_0_lr_cpu"
    assert _io(init) == [_fill("optimizer_iteration"),
                         *[f for p in PARAMS for f in (_fill(f"{p}_first_moment", p),
                                                        _fill(f"{p}_second_moment", p))]]
    assert _io(net) == [("Iter", ["optimizer_iteration"], ["optimizer_iteration"]),
                        ("LearningRate", ["optimizer_iteration"], [lr]),
                        *[("Adam", [p, f"{p}_first_moment", f"{p}_second_moment", f"{p}_grad", lr,
                                    "optimizer_iteration"], [p, f"{p}_first_moment", f"{p}_second_moment"])
                          for p in PARAMS]]
    assert net[1].args["base_lr"] == -0.01
    assert net[2].args == {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6}


def test_several_devices_share_one_cpu_iteration_counter():
    model = _model(gpus=(0, 1))
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9))
    counters = [op for op in [*init, *net] if "optimizer_iteration" in op.outputs]
    assert _io(counters) == [_fill("optimizer_iteration"),
                             ("Iter", ["optimizer_iteration"], ["optimizer_iteration"])]
    assert all(op.device_option == CPU0 for op in counters)
    assert net[0].type == "Iter"
    lrs = [op for op in net if op.type == "LearningRate"]
    assert [(op.outputs[0], op.device_option) for op in lrs] == [
        (opt.get_gpu_blob_name("lr", gpu), DeviceOption(CUDA, gpu)) for gpu in (0, 1)]
    assert opt.get_gpu_blob_name("lr", 1) == "SgdOptimizer_0_lr_gpu1"
    for gpu in (0, 1):
        device = DeviceOption(CUDA, gpu)
        ones = [op for op in init if op.outputs == [f"ONE_1_{gpu}"]]
        assert len(ones) == 1 and ones[0].device_option == device
        for param in PARAMS:
            name = f"gpu_{gpu}/{param}"
            fill = next(op for op in init if op.outputs == [f"{name}_momentum"])
            update = next(op for op in net if op.type == "MomentumSGDUpdate" and op.inputs[3] == name)
            assert fill.device_option == device and update.device_option == device
            assert update.inputs[2] == opt.get_gpu_blob_name("lr", gpu)


def test_building_rescans_each_net_a_fixed_number_of_times(monkeypatch: pytest.MonkeyPatch):
    """Per-device LRs do not rescan the train net (that made GPU builds quadratic in the devices)."""
    rebuilds = []
    original = Net._rebuild_tables
    monkeypatch.setattr(Net, "_rebuild_tables", lambda self: (rebuilds.append(self.Name()), original(self)))
    counts = []
    for gpus in ((0, 1), (0, 1, 2, 3)):
        model = _model(gpus=gpus)
        rebuilds.clear()
        optimizer.build_sgd(model, 0.1, momentum=0.9)
        counts.append(len(rebuilds))
        assert len([op for op in model.net.Proto().ops if op.type == "LearningRate"]) == len(gpus)
    assert counts[0] == counts[1] <= 2


def test_a_net_that_reads_the_counter_still_gets_it_advanced():
    """The counter is advanced unless the net already *writes* it; reading it does not count."""
    model = _model()
    model.net.Scale(["optimizer_iteration"], "iteration_copy")  # an external input of the net
    _, net, _ = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1))
    assert [op.type for op in net if "optimizer_iteration" in op.outputs] == ["Iter"]


def test_params_the_init_net_does_not_create_are_placed_by_the_train_net():
    model = ModelHelper(name="opt_external", init_params=False)
    with DeviceScope(DeviceOption(CUDA, 1)):
        model.AddGradientOperators([_forward(model)])
    _, net, _ = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1))
    updates = [op for op in net if op.type == "WeightedSum"]
    assert [op.outputs[0] for op in updates] == PARAMS
    assert all(op.device_option == DeviceOption(CUDA, 1) for op in updates)


def test_cpu_devices_share_one_lr_blob_but_keep_their_own_state():
    model = _model(gpus=(0, 1), device_type=CPU)
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9))
    lrs = [op for op in net if op.type == "LearningRate"]
    assert [(op.outputs, op.device_option) for op in lrs] == [([opt.get_cpu_blob_name("lr")], CPU0)]
    assert [op.outputs[0] for op in init if op.outputs[0].startswith("ONE")] == ["ONE_0_0", "ONE_0_1"]
    for cpu in (0, 1):
        update = next(op for op in net if op.type == "MomentumSGDUpdate" and op.inputs[3] == f"cpu_{cpu}/fc1_w")
        assert update.inputs[1] == f"cpu_{cpu}/fc1_w_momentum"
        assert update.device_option == DeviceOption(CPU, cpu)


def test_a_second_optimizer_reuses_the_counter_and_gets_its_own_lr():
    model = _model()
    first = optimizer.build_sgd(model, 0.1)
    second = optimizer.build_sgd(model, 0.2)
    all_ops = [*model.param_init_net.Proto().ops, *model.net.Proto().ops]
    assert [op.type for op in all_ops if "optimizer_iteration" in op.outputs] == ["ConstantFill", "Iter"]
    assert first.get_cpu_blob_name("lr") == "SgdOptimizer_0_lr_cpu"
    assert second.get_cpu_blob_name("lr") == "SgdOptimizer_1_lr_cpu"


def test_blobs_stay_unscoped_inside_a_name_scope():
    model = _model()
    with NameScope("outer"):
        init, net, _ = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, momentum=0.5))
    blobs = {b for op in [*init, *net] for b in (*op.inputs, *op.outputs)}
    assert not any(b.startswith("outer/") for b in blobs)
    assert "fc1_w_momentum" in blobs


def test_gradient_clipping_ops():
    """Caffe2's mechanism and names: the LR is multiplied by clip_norm / max(global norm, clip_norm)."""
    model = _model()
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, max_gradient_norm=2.0))
    scoped = [f"norm_clipped_grad_update/{b}" for b in ("grad_squared_full_sum", "global_norm", "clip_norm",
                                                         "max_norm", "norm_ratio")]
    total, norm, clip, max_norm, ratio = scoped
    squares = [f"norm_clipped_grad_update/grad_{i}_squared_sum" for i in range(len(PARAMS))]
    assert _io(net[:8]) == [*[("SumSqrElements", [f"{p}_grad"], [s]) for p, s in zip(PARAMS, squares)],
                            ("Sum", squares, [total]), ("Sqrt", [total], [norm]),
                            ("Max", [norm, clip], [max_norm]), ("Div", [clip, max_norm], [ratio])]
    clip_fill = next(op for op in init if op.outputs == [clip])
    assert clip_fill.args == {"shape": [], "value": 2.0}
    lr, scaled = opt.get_cpu_blob_name("lr"), opt.get_cpu_blob_name("scaled_lr")
    assert ("Mul", [lr, ratio], [scaled]) in _io(net)
    assert all(op.inputs[3] == scaled for op in net if op.type == "WeightedSum")


def test_lr_injection_multiplies_every_lr():
    model = _model(gpus=(0,))
    init, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, allow_lr_injection=True))
    assert _fill("lr_injection") in _io(init)
    injection_fill = next(op for op in init if op.outputs == ["lr_injection"])
    assert injection_fill.device_option == CPU0 and injection_fill.args["value"] == 1.0
    scaled = opt.get_gpu_blob_name("scaled_lr", 0)
    assert ("CopyCPUToGPU", ["lr_injection"], ["gpu_0/lr_injection_gpu0"]) in _io(net)
    assert ("Mul", [opt.get_gpu_blob_name("lr", 0), "gpu_0/lr_injection_gpu0"], [scaled]) in _io(net)
    assert all(op.inputs[3] == scaled for op in net if op.type == "WeightedSum")


def test_lr_injection_and_clipping_multiply_into_lr_multiplier():
    model = _model()
    _, net, opt = _new_ops(model, lambda m: optimizer.build_sgd(m, 0.1, max_gradient_norm=1.0,
                                                                  allow_lr_injection=True))
    assert ("Mul", ["lr_injection", "norm_clipped_grad_update/norm_ratio"], ["lr_multiplier"]) in _io(net)
    assert ("Mul", [opt.get_cpu_blob_name("lr"), "lr_multiplier"], [opt.get_cpu_blob_name("scaled_lr")]) in _io(net)


@pytest.mark.parametrize("kwargs, error", [
    ({"nesterov": True}, ValueError),
    ({"momentum": -0.1}, ValueError),
    ({"weight_decay": float("nan")}, TypeError),
    ({"max_gradient_norm": 0.0}, ValueError),
    ({"base_learning_rate": -1.0}, ValueError),
    ({"base_learning_rate": "0.1"}, TypeError),
    ({"policy": "step", "step_size": 3}, TypeError),  # a typo of `stepsize`
    ({"policy": "step", "gamma": 0.5}, ValueError),  # no stepsize: refused now, not at CreateNet
    ({"policy": "cosine"}, ValueError),
    ({"policy": "multistep", "gamma": 0.5}, ValueError),
    ({"policy": "composite"}, ValueError),
])
def test_bad_sgd_arguments_raise_before_recording(kwargs, error):
    model = _model()
    before = (len(model.param_init_net.Proto().ops), len(model.net.Proto().ops))
    kwargs = {"base_learning_rate": 0.1, **kwargs}
    with pytest.raises(error):
        optimizer.build_sgd(model, **kwargs)
    assert (len(model.param_init_net.Proto().ops), len(model.net.Proto().ops)) == before


def test_bad_adam_arguments_and_models_without_gradients_raise():
    with pytest.raises(ValueError, match="beta2"):
        optimizer.build_adam(_model(), 0.1, beta2=1.0)
    model = _model()
    before = len(model.net.Proto().ops)
    with pytest.raises(ValueError, match="AdamOptimizer: learning-rate policy 'poly'.*max_iter"):
        optimizer.build_adam(model, 0.1, policy="poly", power=1.0)
    assert len(model.net.Proto().ops) == before
    model = ModelHelper(name="nograd")
    _forward(model)
    with pytest.raises(ValueError, match="AddGradientOperators"):
        optimizer.build_sgd(model, 0.1)


@pytest.mark.parametrize(("build", "match"), [
    (lambda m: optimizer.build_sgd(m, 0.1, weight_decay=0.1), "weight_decay with the sparse gradient"),
    (lambda m: optimizer.add_weight_decay(m, 0.1), "WeightDecayBuilder has no sparse update"),
    (lambda m: optimizer.build_adagrad(m, 0.1, rowWise=True), "rowWise Adagrad is for sparse gradients"),
])
def test_unsupported_sparse_combinations_are_refused_before_recording(build, match):
    model = _model()
    model.param_to_grad[model.params[0]] = GradientSlice("idx", "vals")
    before = len(model.param_init_net.Proto().ops), len(model.net.Proto().ops)
    with pytest.raises(NotImplementedError, match=match):
        build(model)
    assert (len(model.param_init_net.Proto().ops), len(model.net.Proto().ops)) == before


@pytest.mark.parametrize(("build", "update"), [
    (lambda m: optimizer.build_sgd(m, 0.1), ("ScatterWeightedSum", ["fc1_w", "ONE_0_0", "idx", "vals",
                                                                    "SgdOptimizer_0_lr_cpu"], ["fc1_w"])),
    (lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
     ("SparseMomentumSGDUpdate", ["vals", "fc1_w_momentum", "SgdOptimizer_0_lr_cpu", "fc1_w", "idx"],
      ["vals", "fc1_w_momentum", "fc1_w"])),
    (lambda m: optimizer.build_adam(m, 0.1),
     ("SparseAdam", ["fc1_w", "fc1_w_first_moment", "fc1_w_second_moment", "idx", "vals",
                     "AdamOptimizer_0_lr_cpu", "optimizer_iteration"],
      ["fc1_w", "fc1_w_first_moment", "fc1_w_second_moment"])),
    (lambda m: optimizer.build_adagrad(m, 0.1),
     ("SparseAdagrad", ["fc1_w", "fc1_w_squared_sum", "idx", "vals", "AdagradOptimizer_0_lr_cpu"],
      ["fc1_w", "fc1_w_squared_sum"])),
])
def test_sparse_gradients_take_the_sparse_update(build, update):
    model = _model()
    model.param_to_grad[model.params[0]] = GradientSlice("idx", "vals")
    _, net_ops, _ = _new_ops(model, build)
    assert update in _io(net_ops)


def test_row_wise_adagrad_keeps_one_moment_per_row():
    model = _model()
    for p in model.params:
        model.param_to_grad[p] = GradientSlice("idx", f"{p}_vals")
    init_ops, net_ops, _ = _new_ops(model, lambda m: optimizer.build_adagrad(m, 0.1, rowWise=True))
    fills = {op.outputs[0]: op.args["shape"] for op in init_ops if op.outputs[0].endswith("_avg_squared_sum")}
    assert fills == {"fc1_w_avg_squared_sum": [3], "fc1_b_avg_squared_sum": [3], "pred_w_avg_squared_sum": [2],
                     "pred_b_avg_squared_sum": [2]}
    assert [op.type for op in net_ops].count("RowWiseSparseAdagrad") == 4


# ------------------------------------------------------------------------------------------------
# Running the recorded updates
# ------------------------------------------------------------------------------------------------

def _feed_batch(prefix: str = "", seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    workspace.FeedBlob(prefix + "data", rng.standard_normal((5, 4)).astype(np.float32))
    workspace.FeedBlob(prefix + "label", rng.integers(0, 2, 5).astype(np.int32))


def _lr_trace(policy: str, steps: int, base_lr: float = 0.5, **policy_args) -> list[float]:
    model = _model()
    opt = optimizer.build_sgd(model, base_lr, policy=policy, **policy_args)
    workspace.RunNetOnce(model.param_init_net)
    _feed_batch()
    workspace.CreateNet(model.net)
    trace = []
    for _ in range(steps):
        workspace.RunNet(model.net)
        trace.append(float(workspace.FetchBlob(opt.get_cpu_blob_name("lr"))[0]))
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [steps]
    return trace


@pytest.mark.parametrize("policy, args, factor", [
    ("fixed", {}, lambda t: 1.0),
    ("step", {"stepsize": 3, "gamma": 0.5}, lambda t: 0.5 ** (t // 3)),
    ("exp", {"gamma": 0.9}, lambda t: 0.9 ** t),
    ("inv", {"gamma": 0.1, "power": 0.75}, lambda t: (1 + 0.1 * t) ** -0.75),
    ("poly", {"power": 2.0, "max_iter": 10}, lambda t: (1 - t / 10) ** 2),
    ("multistep", {"stepsizes": [2, 5], "gamma": 0.1}, lambda t: 0.1 ** sum(t >= s for s in (2, 5))),
])
def test_lr_policies_through_the_net(policy, args, factor):
    trace = _lr_trace(policy, 7, **args)
    expected = [-0.5 * factor(t) for t in range(1, 8)]  # step 1 sees iter = 1
    np.testing.assert_allclose(trace, expected, rtol=1e-6)


def test_the_iteration_counter_advances_once_per_step_on_several_devices():
    with cuda_on_cpu():
        model = _model(gpus=(0, 1))
        opt = optimizer.build_sgd(model, 0.25, policy="step", stepsize=2, gamma=0.5)
        workspace.RunNetOnce(model.param_init_net)
        for gpu in (0, 1):
            _feed_batch(f"gpu_{gpu}/", seed=gpu)
        workspace.CreateNet(model.net)
        for step in range(1, 4):
            workspace.RunNet(model.net)
            assert workspace.FetchBlob("optimizer_iteration").tolist() == [step]
            for gpu in (0, 1):
                lr = workspace.FetchBlob(opt.get_gpu_blob_name("lr", gpu))
                assert lr.tolist() == [-0.25 * 0.5 ** (step // 2)]


def test_lr_injection_scales_the_step():
    def step_size(injection: float | None) -> np.ndarray:
        workspace.ResetWorkspace()
        model = _model()
        optimizer.build_sgd(model, 0.5, allow_lr_injection=True)
        workspace.RunNetOnce(model.param_init_net)
        if injection is not None:
            workspace.FeedBlob("lr_injection", np.array([injection], np.float32))
        _feed_batch()
        before = workspace.FetchBlob("fc1_w")
        workspace.RunNetOnce(model.net)
        return workspace.FetchBlob("fc1_w") - before

    full, quarter = step_size(None), step_size(0.25)
    assert np.abs(full).max() > 0
    np.testing.assert_allclose(quarter, 0.25 * full, rtol=1e-5, atol=1e-7)


def test_gradient_clipping_scales_the_step_to_the_max_norm():
    model = _model()
    optimizer.build_sgd(model, 1.0, max_gradient_norm=0.05)
    workspace.RunNetOnce(model.param_init_net)
    _feed_batch()
    before = {p: workspace.FetchTensor(p).clone() for p in PARAMS}
    workspace.RunNetOnce(model.net)
    grads = [workspace.FetchTensor(f"{p}_grad") for p in PARAMS]  # left as they are
    steps = [(before[p] - workspace.FetchTensor(p)) for p in PARAMS]  # lr = 1: the step is ratio * grad
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert norm > 0.05
    assert workspace.FetchBlob("norm_clipped_grad_update/norm_ratio") == pytest.approx(0.05 / norm, rel=1e-5)
    for step, grad in zip(steps, grads):
        torch.testing.assert_close(step, grad * (0.05 / norm), rtol=1e-5, atol=1e-7)
