"""Misuse a careful user could make: refused when recorded, or reported at the user's level (which blob,
which call to make), and a call that raises leaves the workspace and the model as they were."""

from __future__ import annotations

import functools
import logging
import re

import numpy as np
import pytest
import torch

from graphpar import brew, core, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.devices import cuda_on_cpu
from graphpar.errors import MissingBlobError, OperatorError
from graphpar.models import mlp

MLP = functools.partial(mlp, dim_in=6, hidden=(5,), num_classes=3)


def snapshot() -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in workspace.get_workspace().blobs.items()}


def assert_unchanged(before: dict[str, torch.Tensor]) -> None:
    """Every blob is as it was. A failed run may drop the previous run's transient values (the frame
    takes them to free memory early); params, optimizer state, counters and inputs are kept."""
    ws = workspace.get_workspace()
    after = ws.blobs
    transient = {name for plan in ws.nets.values() for name in plan.frame.names} - {
        name for plan in ws.nets.values() for name in plan.persistent}
    assert set(after) <= set(before) and set(before) - set(after) <= transient, set(before) ^ set(after)
    for name, value in after.items():
        old = before[name]
        assert value.dtype == old.dtype and value.shape == old.shape, name
        assert torch.equal(value, old) or (value.is_floating_point() and torch.allclose(
            value, old, rtol=0, atol=0, equal_nan=True)), name


def parallelize(devices=(0, 1), **options) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="misuse")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=list(devices), cpu_device=True, **options)
    return model


def feed(model, rows: int = 2, dtype=np.float32, skip: str = "") -> None:
    rng = np.random.default_rng(0)
    for d in model._devices:
        if f"cpu_{d}" != skip:
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((rows, 6)).astype(dtype))
            workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, rows).astype(np.int32))


# ---- item 8: refused when recorded --------------------------------------------------------------


def test_an_op_naming_one_blob_as_two_outputs_is_refused_when_recorded() -> None:
    net = core.Net("twice")
    with pytest.raises(ValueError, match="'s' as two of its outputs"):
        net.ChannelStats("x", ["s", "s"])
    assert net.Proto().ops == []
    with pytest.raises(ValueError, match="two of its outputs"):
        core.CreateOperator("ChannelStats", ["x"], ["s", "s"])


def test_bool_device_ids_are_refused() -> None:
    model = model_helper.ModelHelper(name="bools")
    with pytest.raises(TypeError, match="int device ids"):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP,
                        devices=[True, False], cpu_device=True)
    assert getattr(model, "_parallel", None) is None and model.net.Proto().ops == []


def test_a_float_iteration_counter_is_refused_before_the_net_runs() -> None:
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    workspace.FeedBlob("optimizer_iteration", np.array([5.0], dtype=np.float32))
    dpm.CreateNet(model, overwrite=True)  # as Caffe2: shapes and dtypes are checked when the net runs
    before = snapshot()
    with pytest.raises(ValueError, match="iteration counter 'optimizer_iteration' is float32"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)


# ---- item 10: errors at the user's level --------------------------------------------------------


def test_float64_input_names_the_blob_and_says_to_cast() -> None:
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    feed(model, dtype=np.float64)
    before = snapshot()
    with pytest.raises(OperatorError, match=r"'cpu_\d/data' is float64 while other inputs are float32: "
                                            r"cast to float32"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)


def test_running_before_run_init_net_says_to_call_run_init_net() -> None:
    model = parallelize()
    feed(model)
    before = snapshot()
    with pytest.raises(RuntimeError, match=r"call data_parallel_model.RunInitNet\(model\) first"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)


def test_a_misspelt_fed_blob_gets_did_you_mean() -> None:
    model = parallelize()
    feed(model, skip="cpu_1")
    workspace.FeedBlob("cpu_1/dta", np.zeros((2, 6), np.float32))
    workspace.FeedBlob("cpu_1/label", np.zeros(2, np.int32))
    before = snapshot()
    with pytest.raises(MissingBlobError, match=r"'cpu_1/data' does not exist(.|\n)*Did you mean 'cpu_1/dta'"):
        dpm.RunInitNet(model)
    assert_unchanged(before)


def test_running_a_parallelized_net_directly_before_run_init_net_names_run_init_net() -> None:
    model = parallelize()
    with pytest.raises(RuntimeError, match=r"has not been created(.|\n)*RunInitNet\(model\)"):
        workspace.RunNet(model.net)


# ---- item 8: a NaN or infinite loss stops the step before any update ----------------------------


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_check_finite_loss_stops_the_step_before_params_are_poisoned(net_type: str) -> None:
    model = parallelize(check_finite_loss=True, net_type=net_type)
    feed(model)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    feed(model)
    workspace.FeedBlob("cpu_1/data", np.full((2, 6), np.inf, np.float32))
    before = snapshot()
    with pytest.raises(OperatorError, match=r"CheckFinite(.|\n)*'cpu_1/scaled_loss' is nan \(not finite\): the step "
                                            r"stopped before any parameter update"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)
    feed(model)
    dpm.RunNet(model, 1)
    assert np.isfinite(workspace.FetchBlob("cpu_1/fc1_w")).all()


def test_check_finite_loss_runs_before_every_gradient_op() -> None:
    model = parallelize(check_finite_loss=True)
    ops = model.net.Proto().ops
    checks = [k for k, op in enumerate(ops) if op.type == "CheckFinite"]
    assert [ops[k].inputs for k in checks] == [["cpu_0/scaled_loss"], ["cpu_1/scaled_loss"]]
    assert max(checks) < min(k for k, op in enumerate(ops) if op.is_gradient_op)


def test_without_the_check_a_nan_loss_poisons_the_params() -> None:
    """What the check prevents (and why it is on by default on CPU replicas)."""
    model = parallelize(check_finite_loss=False)
    feed(model)
    dpm.RunInitNet(model)
    workspace.FeedBlob("cpu_1/data", np.full((2, 6), np.inf, np.float32))
    dpm.RunNet(model, 1)
    assert np.isnan(workspace.FetchBlob("cpu_0/fc1_w")).any()


def test_the_check_is_on_by_default_for_training_models_on_cpu_replicas_only() -> None:
    """Issue 23 item 16: a NaN batch poisoned every param by default."""
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    workspace.FeedBlob("cpu_1/data", np.full((2, 6), np.inf, np.float32))
    before = snapshot()
    with pytest.raises(OperatorError, match="CheckFinite"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)

    def checks(cpu_device: bool, training: bool = True) -> int:
        model = model_helper.ModelHelper(name="default_check", init_params=training)
        sgd = (lambda m: optimizer.build_sgd(m, 0.1)) if training else None
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP, devices=[0, 1],
                        optimizer_builder_fun=sgd, cpu_device=cpu_device)
        return sum(op.type == "CheckFinite" for op in model.net.Proto().ops)

    with cuda_on_cpu():
        assert checks(cpu_device=False) == 0  # a host sync per step on CUDA
    assert checks(cpu_device=True, training=False) == 0  # an evaluation model reports its NaN loss
    assert checks(cpu_device=True) == 2


# ---- item 10: logging of what Parallelize built and what each init/sync did ---------------------


def test_parallelize_init_and_syncs_log_what_they_did(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="graphpar"):
        model = parallelize(gradient_bucket_bytes=100, first_bucket_bytes=50)
        feed(model)
        dpm.RunInitNet(model)
        dpm.FinalizeAfterCheckpoint(model)
    by_logger = {}
    for record in caplog.records:
        by_logger.setdefault(record.name, []).append(record.getMessage())
    built = "\n".join(by_logger["graphpar.parallel.data_parallel_model"])  # one logger per module
    assert "Parallelize('misuse'): 2 replica(s) cpu_0/, cpu_1/ on CPU; training" in built
    assert "4 gradients all-reduced by TreeReducer (buckets closing at 100 bytes)" in built
    assert "then broadcasts 8 blobs from cpu_0/ to cpu_1/" in built
    assert re.search(r"RunInitNet\('misuse'\): ran \['misuse\w*'\] .* created \['misuse\w*'\]", built)
    assert "FinalizeAfterCheckpoint('misuse'): broadcast 8 blobs from cpu_0/ to cpu_1/" in built
    assert by_logger["graphpar.passes.bucketing"] == [
        "gradient buckets: 4 gradients in 2 buckets of [72, 140] bytes (limit 100, first 50)"]


# ---- also expected: feeding only some devices ---------------------------------------------------


def test_feeding_only_some_devices_is_refused_before_anything_runs() -> None:
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    feed(model, skip="cpu_1")  # cpu_1 would train on its previous batch again
    before = snapshot()
    with pytest.raises(RuntimeError, match=r"'cpu_0/data' was fed since the last run but 'cpu_1/data' was not"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)
    feed(model)
    dpm.RunNet(model, 1)


def test_rerunning_one_fixed_batch_on_every_device_is_allowed() -> None:
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    dpm.RunNet(model, 2)
    feed(model)
    dpm.RunNet(model, 1)


# ---- also expected: a loss not multiplied by loss_scale -----------------------------------------


@pytest.mark.parametrize(("scale", "warned"), [(None, "no op computing it has a `scale` argument"),
                                               (0.25, "it is scaled by [0.25]"), ("loss_scale", None)])
def test_a_loss_not_multiplied_by_loss_scale_is_warned_about(caplog: pytest.LogCaptureFixture, scale,
                                                             warned: str | None) -> None:
    def forward(model, loss_scale):
        if scale is None:
            pred = brew.fc(model, "data", "pred", dim_in=6, dim_out=3)
            return [model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])[1]]
        return MLP(model, loss_scale if scale == "loss_scale" else scale)

    model = model_helper.ModelHelper(name="scaled")
    with caplog.at_level(logging.WARNING, logger="graphpar"):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1],
                        cpu_device=True)
    messages = [r.getMessage() for r in caplog.records if "loss_scale" in r.getMessage()]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and "loss 'cpu_0/" in messages[0] and warned in messages[0], messages


@pytest.mark.parametrize("options", [{"combine_spatial_bn": True}, {"gradient_bucket_bytes": 64},
                                     {"dynamic_memory_management": True, "optimize_gradient_memory": True}],
                         ids=["combine_spatial_bn", "buckets", "memory"])
def test_check_finite_loss_with_batch_norm_and_other_options_stops_before_any_update(options) -> None:
    from tests.parallel.test_data_parallel_model import feed as feed_batch
    from tests.test_reliability import BN_DATA, trained

    model = trained(check_finite_loss=True, **options)
    x, y = BN_DATA[1]
    feed_batch(model, np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x).astype(np.float32), y)
    before = snapshot()
    with pytest.raises(OperatorError, match="is nan \\(not finite\\)"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)
