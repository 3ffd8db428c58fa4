"""Loss scaling (`Parallelize(loss_scale=...)`): exact for powers of two, a skipped step changes nothing
on any replica, the dynamic scale halves on overflow and grows after good steps, and checkpoints carry it."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch

from graphpar import checkpoint, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.errors import ParallelizeError
from graphpar.models import lenet
from graphpar.passes.loss_scale import LossScale, check_loss_scale

FORWARD = functools.partial(lenet, image_size=16, channels=(2, 3), hidden=8)


def _build(devices=(0, 1), **kwargs) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="ls")
    dpm.Parallelize(model, lambda m: None, FORWARD,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9, policy="step",
                                                                        stepsize=1, gamma=0.5),
                    devices=list(devices), cpu_device=True, **kwargs)
    return model


def _feed(devices, step: int, big_on: int | None = None) -> None:
    rng = np.random.default_rng(step)
    for d in devices:
        data = rng.standard_normal((2, 1, 16, 16), dtype=np.float32)
        if d == big_on:
            data *= np.float32(1e10)  # the forward stays finite; the gradients, times a 2**100 scale, do not
        workspace.FeedBlob(f"cpu_{d}/data", data)
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 10, 2).astype(np.int32))


def _state(model, devices) -> dict[str, np.ndarray]:
    names = [b for d in devices for b in model.GetParams(f"cpu_{d}/")]
    names += [f"cpu_{d}/{p}_momentum" for d in devices for p in ("conv1_w", "pred_b")]
    return {n: workspace.FetchBlob(n) for n in [*names, "optimizer_iteration"]}


def _train(steps: int, devices=(0, 1), **kwargs) -> dict[str, np.ndarray]:
    workspace.ResetWorkspace()
    model = _build(devices, **kwargs)
    for step in range(steps):
        _feed(devices, step)
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
    return _state(model, devices)


def test_a_power_of_two_static_scale_gives_the_unscaled_training_bit_for_bit():
    plain, scaled = _train(3), _train(3, loss_scale=1024.0)
    assert workspace.FetchBlob("cpu_1/_loss_scale") == np.float32(1024.0)
    for name, value in plain.items():
        np.testing.assert_array_equal(scaled[name], value, err_msg=name)


def test_an_overflow_in_one_replica_skips_the_step_everywhere_and_halves_the_scale(caplog):
    devices = (0, 1)
    workspace.ResetWorkspace()
    model = _build(devices, loss_scale={"init_scale": 2.0 ** 100, "growth_interval": 3})
    _feed(devices, 0)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)  # a good step
    before = _state(model, devices)
    _feed(devices, 1, big_on=1)
    with caplog.at_level(logging.WARNING, logger="graphpar.data_parallel_model"):
        dpm.RunNet(model, 1)
    assert "step skipped" in caplog.text and f"loss scale {2.0 ** 100:g}" in caplog.text
    after = _state(model, devices)
    for name, value in before.items():  # params, momentum and the iteration counter (so the LR) unchanged
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    for d in devices:
        assert workspace.FetchBlob(f"cpu_{d}/_loss_scale") == np.float32(2.0 ** 99)
        assert workspace.FetchBlob(f"cpu_{d}/_loss_scale_good_steps") == 0
    _feed(devices, 2)
    dpm.RunNet(model, 1)  # trains on
    assert not np.array_equal(workspace.FetchBlob("cpu_0/conv1_w"), after["cpu_0/conv1_w"])
    assert workspace.FetchBlob("optimizer_iteration") == before["optimizer_iteration"] + 1


def test_the_dynamic_scale_grows_after_growth_interval_good_steps():
    devices = (0,)
    workspace.ResetWorkspace()
    model = _build(devices, loss_scale={"init_scale": 8.0, "growth_interval": 2, "growth_factor": 4.0})
    seen = []
    for step in range(5):
        _feed(devices, step)
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
        seen.append((float(workspace.FetchBlob("cpu_0/_loss_scale")), int(workspace.FetchBlob("cpu_0/_loss_scale_good_steps"))))
    assert seen == [(8.0, 1), (32.0, 0), (32.0, 1), (128.0, 0), (128.0, 1)]


@pytest.mark.parametrize("compute_dtype", ["float16", "bfloat16"])
def test_a_static_scale_that_overflows_fp16_gradients_skips_steps_and_keeps_masters_finite(compute_dtype, caplog):
    """Issue 23 item 11: static loss_scale=2**20 with check_finite_loss: the loss is finite, the float16
    gradients overflow; every step is skipped (said in a warning) and the fp32 masters stay as they were.
    bfloat16 has float32's range: the same scale trains."""
    devices = (0, 1)
    workspace.ResetWorkspace()
    model = _build(devices, compute_dtype=compute_dtype, loss_scale=2.0 ** 20, check_finite_loss=True)
    _feed(devices, 0)
    dpm.RunInitNet(model)
    before = _state(model, devices)
    with caplog.at_level(logging.WARNING, logger="graphpar.data_parallel_model"):
        dpm.RunNet(model, 1)
    after = _state(model, devices)
    assert all(np.isfinite(v).all() for v in after.values())
    if compute_dtype == "float16":
        assert "step skipped" in caplog.text
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value, err_msg=name)
    else:
        assert "step skipped" not in caplog.text
        assert after["optimizer_iteration"] == before["optimizer_iteration"] + 1


def test_fp16_with_a_dynamic_scale_backs_off_until_it_trains():
    devices = (0, 1)
    workspace.ResetWorkspace()
    model = _build(devices, compute_dtype="float16", loss_scale={"init_scale": 2.0 ** 24, "growth_interval": 100})
    for step in range(12):
        _feed(devices, step % 2)
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)  # a skipped step writes nothing back, not even the loss
    scale = float(workspace.FetchBlob("cpu_0/_loss_scale"))
    assert scale < 2.0 ** 24 and workspace.FetchBlob("optimizer_iteration") > 0
    assert all(np.isfinite(workspace.FetchBlob(p)).all() for p in model.GetParams())
    assert np.isfinite(workspace.FetchBlob("cpu_0/loss"))
    assert workspace.FetchTensor("cpu_0/conv1").dtype == torch.float16


def test_the_scale_round_trips_through_a_checkpoint_with_the_masters(tmp_path):
    devices, scale, path = (0, 1), {"init_scale": 64.0, "growth_interval": 1}, tmp_path / "ckpt.safetensors"
    workspace.ResetWorkspace()
    first = _build(devices, loss_scale=scale)
    for step in range(2):
        _feed(devices, step)
        if step == 0:
            dpm.RunInitNet(first)
        dpm.RunNet(first, 1)
    assert workspace.FetchBlob("cpu_0/_loss_scale") == np.float32(256.0)  # doubled after each good step
    saved = _state(first, devices)
    dpm.save_checkpoint(first, path)
    assert {"cpu_0/_loss_scale", "cpu_0/_loss_scale_good_steps"} <= dpm.GetCheckpointParams(first)
    workspace.ResetWorkspace()
    second = _build(devices, loss_scale=scale)
    _feed(devices, 0)
    dpm.RunInitNet(second)
    checkpoint.load(path, model=second)
    dpm.FinalizeAfterCheckpoint(second)
    for d in devices:
        assert workspace.FetchBlob(f"cpu_{d}/_loss_scale") == np.float32(256.0)
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{d}/conv1_w"), saved["cpu_0/conv1_w"])


def test_the_scale_grows_only_while_it_stays_finite():
    """Issue 32 item 10: a scale that growth makes non-finite (growth_factor=inf was accepted) skipped
    every later step. As torch._amp_update_scale_, a growth that would leave float32's range is not
    applied (the good-step count restarts), so the scale stays finite and training goes on."""
    from tests.ops.helpers import run_kernel

    scale, good = torch.tensor(2.0 ** 120), torch.tensor(1, dtype=torch.int64)
    grown, count = run_kernel("UpdateLossScale", [scale, good], growth_factor=2.0 ** 10, growth_interval=2)
    assert grown.item() == 2.0 ** 120 and count.item() == 0
    grown, count = run_kernel("UpdateLossScale", [torch.tensor(8.0), good], growth_factor=4.0, growth_interval=2)
    assert grown.item() == 32.0 and count.item() == 0
    reference, tracker = torch.tensor([2.0 ** 120]), torch.tensor([1], dtype=torch.int32)  # GradScaler's update
    torch._amp_update_scale_(reference, tracker, torch.zeros(1), 2.0 ** 10, 0.5, 2)
    assert reference.item() == 2.0 ** 120 and tracker.item() == 0


@pytest.mark.parametrize("value, expected", [
    (None, None), (2.0 ** 10, LossScale(1024.0, dynamic=False)), ("dynamic", LossScale()),
    ({"init_scale": 4.0}, LossScale(4.0))])
def test_loss_scale_values(value, expected):
    assert check_loss_scale(value) == expected


@pytest.mark.parametrize("value, error", [(0.0, ValueError), ({"init": 2.0}, TypeError), ("auto", TypeError),
                                          ({"backoff_factor": 2.0}, ValueError), (True, TypeError),
                                          ({"growth_factor": float("inf")}, ValueError),
                                          ({"growth_factor": float("nan")}, ValueError)])
def test_bad_loss_scales_raise_before_the_model_changes(value, error):
    model = model_helper.ModelHelper(name="bad_loss_scale")
    with pytest.raises((error, ParallelizeError)):
        dpm.Parallelize(model, lambda m: None, FORWARD, optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                        devices=[0], cpu_device=True, loss_scale=value)
    assert not model.net.Proto().ops


def test_sparse_embedding_gradients_are_unscaled_through_their_values():
    """DLRM (SparseLengthsSum tables: GradientSlice gradients) with a power-of-two scale trains bit for bit
    like the unscaled model, dense and sparse params alike."""
    from graphpar.models.dlrm import dlrm, split_clicks, synthetic_clicks

    def train(**kwargs):
        workspace.ResetWorkspace()
        model = model_helper.ModelHelper(name="dlrm_ls")
        dpm.Parallelize(model, lambda m: None, dlrm, devices=[0, 1], cpu_device=True,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9), **kwargs)
        for step in range(2):
            for d, part in enumerate(split_clicks(synthetic_clicks(8, seed=step), 2)):
                for name, value in part.items():
                    workspace.FeedBlob(f"cpu_{d}/{name}", value)
            if step == 0:
                dpm.RunInitNet(model)
            dpm.RunNet(model, 1)
        assert any(op.type == "UnscaleGradients" for op in model.net.Proto().ops) == bool(kwargs)
        return {p: workspace.FetchBlob(p) for p in model.GetParams()}

    plain, scaled = train(), train(loss_scale=256.0)
    assert any(name.endswith("emb_0") for name in plain)
    for name, value in plain.items():
        np.testing.assert_array_equal(scaled[name], value, err_msg=name)


def test_the_trainer_records_nothing_for_a_skipped_step():
    """engine.Trainer over a loss-scaled model: the first step overflows (scale 3e38) and is skipped, so
    no loss or LR is recorded for it; the scale backs off and the next steps train."""
    from graphpar.engine import LRScheduler, Trainer

    workspace.ResetWorkspace()
    model = _build((0, 1), loss_scale={"init_scale": 3e38, "backoff_factor": 1e-20})
    rng = np.random.default_rng(0)
    data = [{"data": rng.standard_normal((4, 1, 16, 16), dtype=np.float32),
             "label": rng.integers(0, 10, 4).astype(np.int32)} for _ in range(4)]
    data[0]["data"] *= np.float32(1e4)  # its gradients, times 3e38, overflow
    trainer = Trainer(model, data, [LRScheduler()], max_iter=4)
    trainer.train()
    assert dpm.skipped_steps(model) == 1
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 3
    assert [it for it, _ in trainer.storage.history["scaled_loss"]] == [1, 2, 3]
    assert len(trainer.storage.history["lr"]) == 3


def test_a_float16_all_reduce_that_overflows_stops_the_step_or_skips_it_with_a_loss_scale(caplog):
    """Issue 32 item 4: allreduce_dtype="float16" cast finite fp32 gradients above 65504 to inf and the
    update turned the params into inf, silently. Without a loss scale the step now stops (nothing
    changed, the error says what to use instead); with a dynamic loss scale it is skipped and the scale
    backs off. fp32 all-reduce: the same batch gives finite params (the gradients were finite)."""
    from graphpar.errors import OperatorError

    devices = (0, 1)
    for options in ({}, {"allreduce_dtype": "float16"}, {"allreduce_dtype": "float16", "loss_scale": "dynamic"}):
        workspace.ResetWorkspace()
        model = _build(devices, **options)
        _feed(devices, 0)
        dpm.RunInitNet(model)
        dpm.RunNet(model, 1)  # a good step
        before = _state(model, devices)
        rng = np.random.default_rng(1)
        for d in devices:  # finite fp32 gradients far beyond float16's 65504
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((2, 1, 16, 16), dtype=np.float32) * 1e7)
            workspace.FeedBlob(f"cpu_{d}/label", np.array([1, 2], dtype=np.int32))
        grads = None
        if "allreduce_dtype" not in options:
            dpm.RunNet(model, 1)
            grads = [workspace.FetchBlob(f"cpu_0/{p}_grad") for p in ("conv1_w", "pred_w")]
            assert all(np.isfinite(g).all() for g in grads) and max(np.abs(g).max() for g in grads) > 65504
            assert all(np.isfinite(v).all() for v in _state(model, devices).values())
            continue
        if "loss_scale" in options:
            with caplog.at_level(logging.WARNING, logger="graphpar.data_parallel_model"):
                dpm.RunNet(model, 1)
            assert "step skipped" in caplog.text and workspace.FetchBlob("cpu_0/_loss_scale") == np.float32(2.0 ** 15)
        else:
            with pytest.raises(OperatorError, match=r"\(CheckFinite\).*not finite.*float16 all-reduce .*bfloat16"):
                dpm.RunNet(model, 1)
        for name, value in _state(model, devices).items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_the_start_up_back_off_is_logged_once_and_a_scale_that_never_fits_is_warned_about(caplog, monkeypatch):
    """Issue 32 item 16: every step of the dynamic scale's start-up back-off logged a warning (GradScaler
    skips them silently). Now one INFO line when it starts and one when the scale settles; a warning
    only when STARTUP_SKIPS_WARNED steps were skipped and none trained."""
    devices = (0, 1)

    def run(init_scale: float, steps: int) -> list[logging.LogRecord]:
        workspace.ResetWorkspace()
        model = _build(devices, compute_dtype="float16", loss_scale={"init_scale": init_scale})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=dpm.__name__):
            for step in range(steps):
                _feed(devices, step)
                if step == 0:
                    dpm.RunInitNet(model)
                dpm.RunNet(model, 1)
        assert 0 < dpm.skipped_steps(model) < steps or init_scale > 2.0 ** 60
        return [r for r in caplog.records if r.name == dpm.__name__ and "RunInitNet" not in r.message]

    records = run(2.0 ** 24, 12)
    assert [r.levelname for r in records] == ["INFO", "INFO"], [r.message for r in records]
    assert "backs off" in records[0].message and "settled after" in records[1].message
    monkeypatch.setattr(dpm, "STARTUP_SKIPS_WARNED", 4)  # 32 by default
    records = run(2.0 ** 120, dpm.STARTUP_SKIPS_WARNED + 1)  # far beyond fp16: every step overflows
    assert [r.levelname for r in records] == ["INFO", "WARNING"]
    assert f"{dpm.STARTUP_SKIPS_WARNED} steps in a row skipped and none trained yet" in records[1].message
