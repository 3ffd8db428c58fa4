"""Gradient accumulation (`Parallelize(accumulate_gradients=k)`): k micro-batches per update with one
all-reduce per update equal one step on the k-times batch (one device and N devices as references)."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import optimizer, workspace
from graphpar.data import feed
from graphpar.engine import Trainer
from graphpar.errors import ParallelizeError
from graphpar.model_helper import ModelHelper
from graphpar.passes.analyze import is_cross_device_op
from tests.training.test_trainer import _mlp

_names = iter(range(10**6))
K, MICRO = 3, 8


def _model(devices, k: int = 1, **options) -> ModelHelper:
    model = ModelHelper(name=f"accumulate_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.2, momentum=0.9),
                    devices=list(devices), cpu_device=True, accumulate_gradients=k, **options)
    return model


def _micro_batches(count: int) -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"data": rng.standard_normal((MICRO, 4)).astype(np.float32),
             "label": rng.integers(0, 3, MICRO).astype(np.int32)} for _ in range(count)]


def _run(devices, k: int, updates: int = 2) -> dict[str, np.ndarray]:
    workspace.ResetWorkspace()
    workspace.SetSeed(2)
    micro = _micro_batches(K * updates)
    whole = [{name: np.concatenate([b[name] for b in micro[i:i + K]]) for name in micro[0]}
             for i in range(0, len(micro), K)]
    model = _model(devices, k)
    trainer = Trainer(model, micro if k > 1 else whole, max_iter=updates)
    trainer.train()
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == updates
    return {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(model))
            if name.startswith(f"cpu_{devices[0]}/") and not name.endswith("_accumulated")}


def _unscoped(params: dict) -> dict:
    return {name.split("/", 1)[1]: value for name, value in params.items()}


@pytest.mark.parametrize("devices", [[0], [0, 1]])
def test_k_micro_batches_equal_one_step_on_the_k_times_batch(devices):
    expected = _unscoped(_run([0], 1))  # one device, batches of K * MICRO
    got = _unscoped(_run(devices, K))
    assert sorted(got) == sorted(expected) and len(got) >= 6
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_one_all_reduce_per_update():
    workspace.ResetWorkspace()
    plain, accumulating = _model([0, 1]), _model([0, 1], K)
    micro = accumulating._accumulate_net.Proto()
    assert not any(is_cross_device_op(op) for op in micro.ops)
    assert [op.type for op in micro.ops[-4:]] == ["Sum"] * 4  # the running sums, one per gradient copy
    count = lambda net: sum(is_cross_device_op(op) for op in net.Proto().ops)  # noqa: E731
    assert count(accumulating.net) == count(plain.net) > 0


def test_the_accumulated_sums_are_zero_after_each_update():
    workspace.ResetWorkspace()
    model = _model([0, 1], K)
    batches = _micro_batches(K)
    feed(model, batches[0])
    dpm.RunInitNet(model)
    workspace.CreateNet(model._accumulate_net)
    for batch in batches[:-1]:
        feed(model, batch)
        workspace.RunNet(model._accumulate_net)
    assert workspace.FetchBlob("cpu_1/fc1_w_grad_accumulated").any()
    feed(model, batches[-1])
    dpm.RunNet(model, 1)
    assert not workspace.FetchBlob("cpu_1/fc1_w_grad_accumulated").any()


@pytest.mark.parametrize("k, options, message", [
    (0, {}, "accumulate_gradients must be an int >= 1"),
    (True, {}, "accumulate_gradients must be an int >= 1"),
    (2, {"shared_model": True}, "not supported with shared_model"),
])
def test_bad_accumulation_options_are_refused(k, options, message):
    with pytest.raises(ParallelizeError, match=message):
        _model([0, 1], k, **options)


def _fp16_run(batches: list[dict], init_scale: float, iterations: int) -> tuple[Trainer, dict[str, np.ndarray]]:
    workspace.ResetWorkspace()
    workspace.SetSeed(2)
    model = _model([0, 1], 2, compute_dtype="float16", loss_scale={"init_scale": init_scale})
    trainer = Trainer(model, batches, max_iter=iterations)
    trainer.train()
    return trainer, {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(model))}


def test_a_skipped_step_drops_its_micro_batches_and_training_goes_on():
    """Issue 32 item 2: an overflowing micro-batch put an inf into `<grad>_accumulated`; the skipped
    step wrote nothing back, so the sums were never zeroed and every later step overflowed (20 of 20
    skipped, the scale backed off to 16). A skipped step now drops its micro-batches: the run equals
    one that started at the backed-off scale on the batches after the skipped step."""
    micro = _micro_batches(16)
    micro[0] = {"data": micro[0]["data"] * np.float32(3000), "label": micro[0]["label"]}  # scaled grads overflow
    trainer, got = _fp16_run(micro, 2.0 ** 10, 8)
    assert dpm.skipped_steps(trainer.model) == 1 and int(got["optimizer_iteration"][0]) == 7
    assert [at for at, _ in trainer.storage.history["scaled_loss"]] == list(range(1, 8))
    _, expected = _fp16_run(micro[2:], 2.0 ** 9, 7)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_step_that_raises_drops_the_micro_batches_it_accumulated():
    """A NaN loss in the k-th micro-batch stopped the step after k - 1 micro-batches were added: the
    next step added its own to them (k + k - 1 micro-batches scaled by 1/k). The Trainer now drops them."""
    micro = _micro_batches(8)
    bad = [dict(b) for b in micro[:3]]
    bad[2]["data"] = bad[2]["data"].copy()
    bad[2]["data"][0, 0] = np.nan  # the third micro-batch: the train net's, after the accumulate net's
    workspace.ResetWorkspace()
    workspace.SetSeed(2)
    model = _model([0, 1], K)
    trainer = Trainer(model, [*bad, *micro[3:6]], max_iter=1)
    with pytest.raises(Exception, match="CheckFinite"):
        trainer.train()
    trainer.train()  # the next K micro-batches
    got = {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(model))}
    workspace.ResetWorkspace()
    workspace.SetSeed(2)
    reference = _model([0, 1], K)
    Trainer(reference, micro[3:6], max_iter=1).train()
    for name, value in got.items():
        np.testing.assert_array_equal(value, workspace.FetchBlob(name.replace(model.name, reference.name)),
                                      err_msg=name)
