"""Inter-device batch norm end to end: `Parallelize(combine_spatial_bn=True)` on CPU and logical CUDA.

Ports of Caffe2's `test_multi_device_bn_op_level_*` and `test_multi_device_bn_net_lvl_*` (hypothesis
over seed and per-device batch, 2 devices, Caffe2's tolerances), then a float64 training equivalence:
a conv + batch-norm network on N = 2, 3, 4 devices equals one device on the concatenated batch after
several momentum-SGD steps (params, running statistics, outputs and every gradient), and differs
without the option.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.ir import CPU, DeviceOption
from graphpar.core.scope import CurrentNameScope, DeviceScope
from graphpar.devices import cuda_on_cpu
from graphpar.errors import ParallelizeError
from graphpar.model_helper import ModelHelper

EPS = 1e-3  # Caffe2's test settings
TOL = 1e-3


def _parallelize(forward: Callable, devices: list[int], gpu: bool, combine: bool, momentum: float = 0.0,
                 model: ModelHelper | None = None, **options) -> ModelHelper:
    model = model or ModelHelper(name="sync_bn")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=momentum),
                    devices=devices, cpu_device=not gpu, combine_spatial_bn=combine, **options)
    return model


# ---- ports of Caffe2's multi-device BN tests ------------------------------------------------------


def _tanh_bn_sqr(model: ModelHelper, loss_scale: float) -> list:
    """Tanh -> SpatialBN -> Sqr -> SumElements; the loss is not scaled (as in Caffe2's test)."""
    tanh = model.net.Tanh("data", "tanh")
    bn = brew.spatial_bn(model, tanh, "bn_out", 1, epsilon=EPS, is_test=False)
    return [model.net.SumElements(model.net.Sqr(bn, "sqr"), "loss")]


def _relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """‖actual - expected‖ / ‖expected‖ (Caffe2's measure), with a floor for a near-zero expectation."""
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-3))


def _run_tanh_bn(devices: list[int], gpu: bool, combine: bool, data: list[np.ndarray]) -> Callable:
    """Parallelize the Tanh/BN model, feed one batch per device, run init and one step.

    Returns `fetch(position, name)`; position -1 gives the scale before the SGD step changed it.
    """
    prefix = "gpu" if gpu else "cpu"
    workspace.ResetWorkspace()
    with cuda_on_cpu(gpu):
        model = _parallelize(_tanh_bn_sqr, devices, gpu, combine)
        for d, x in zip(devices, data):
            workspace.FeedBlob(f"{prefix}_{d}/data", x)
        dpm.RunInitNet(model)
        scale = workspace.FetchBlob(f"{prefix}_{devices[0]}/bn_out_s")
        dpm.RunNet(model, 1)
    return lambda k, name: scale if k < 0 else workspace.FetchBlob(f"{prefix}_{devices[k]}/{name}")


@pytest.mark.parametrize("gpu", [False, True])
@given(seed=st.integers(0, 65535), batch=st.integers(1, 20))
def test_multi_device_bn_op_level(gpu, seed, batch):
    rng = np.random.default_rng(seed)
    data = [rng.random((batch, 1, 1, 1), dtype=np.float32) for _ in range(2)]
    fetch = _run_tanh_bn([0, 1], gpu, True, data)
    scale, xs = fetch(-1, "bn_out_s"), [fetch(k, "tanh") for k in (0, 1)]
    x = np.concatenate(xs)
    mean, var = x.mean(), x.var()
    for k in (0, 1):  # forward: every device normalises with the statistics of both devices' batches
        expected = scale * (xs[k] - mean) / np.sqrt(var + EPS)
        assert _relative_error(fetch(k, "bn_out"), expected) < 0.005

    mu, inv_std = fetch(0, "bn_out_sm"), fetch(0, "bn_out_siv")
    dys = [2 * fetch(k, "bn_out") for k in (0, 1)]  # d(sum y^2)/dy
    d_bias = sum(dy.sum() for dy in dys)
    d_gamma = sum(((xs[k] - mu) * inv_std * dys[k]).sum() for k in (0, 1))
    for k in (0, 1):
        np.testing.assert_allclose(fetch(k, "bn_out_b_grad"), [d_bias], atol=TOL, rtol=TOL)
        np.testing.assert_allclose(fetch(k, "bn_out_s_grad"), [d_gamma], atol=TOL, rtol=TOL)
        xmu = xs[k] - mu
        tanh_grad = scale * inv_std / batch * (batch * dys[k] - d_bias / 2 - xmu * d_gamma / 2 * inv_std)
        np.testing.assert_allclose(fetch(k, "tanh_grad"), tanh_grad, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("gpu", [False, True])
@given(seed=st.integers(0, 65535), batch=st.integers(1, 20))
def test_multi_device_bn_net_lvl(gpu, seed, batch):
    batch += batch % 2  # an even global batch, halved over the two devices
    data = np.random.default_rng(seed).random((batch, 1, 1, 1), dtype=np.float32)
    ref = _run_tanh_bn([0], gpu, False, [data])
    expected = {n: ref(0, n) for n in ("bn_out", "bn_out_s_grad", "bn_out_b_grad", "tanh_grad")}
    got = _run_tanh_bn([0, 1], gpu, True, [data[: batch // 2], data[batch // 2:]])
    bn_out = np.concatenate([got(k, "bn_out") for k in (0, 1)])
    np.testing.assert_allclose(bn_out, expected["bn_out"], atol=TOL)
    for k in (0, 1):
        for name in ("bn_out_s_grad", "bn_out_b_grad"):
            np.testing.assert_allclose(got(k, name), expected[name], atol=TOL)
    tanh_grad = np.concatenate([got(k, "tanh_grad") for k in (0, 1)])
    assert _relative_error(tanh_grad, expected["tanh_grad"]) < TOL


# ---- training equivalence: N devices with combine_spatial_bn == one device on the whole batch ----------

BATCH, STEPS, CLASSES = 12, 3, 5  # 12 splits evenly over 2, 3 and 4 devices
LOSS_BLOBS = ("loss", "scaled_loss")  # per-device losses are means over the device's own slice
LOSS_SEEDS = ("loss_grad", "scaled_loss_grad")  # they carry the 1/N loss scale by design


def _conv_bn_net(model: ModelHelper, loss_scale: float) -> list:
    """conv-BN-relu, then a residual block whose two branches end in BN (two BN groups side by side)."""
    def conv_bn(blob: str, name: str, dim_in: int, kernel: int) -> str:
        conv = brew.conv(model, blob, name, dim_in=dim_in, dim_out=4, kernel=kernel, pad=kernel // 2)
        return brew.spatial_bn(model, conv, f"{name}_bn", dim_in=4, epsilon=1e-5, momentum=0.8)

    h = brew.relu(model, conv_bn("data", "conv1", 3, 3), "relu1")
    h = brew.sum(model, [conv_bn(h, "branch2a", 4, 3), conv_bn(h, "branch1", 4, 1)], "block_sum")
    h = brew.relu(model, h, "relu2")
    pred = brew.fc(model, brew.average_pool(model, h, "pool", global_pooling=True), "pred", dim_in=4,
                   dim_out=CLASSES)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _train(devices: list[int], gpu: bool, combine: bool, **options) -> list[dict[str, list[np.ndarray]]]:
    """Train STEPS momentum-SGD steps in float64 from fixed params; per step {unscoped blob: copies}."""
    prefix = "gpu" if gpu else "cpu"
    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal((BATCH, 3, 5, 5)), rng.integers(0, CLASSES, BATCH).astype(np.int32))
               for _ in range(STEPS)]
    workspace.ResetWorkspace()
    snapshots = []
    with cuda_on_cpu(gpu):
        model = _parallelize(_conv_bn_net, devices, gpu, combine, momentum=0.9, **options)
        for step, (x, y) in enumerate(batches):
            for position, d in enumerate(devices):
                part = slice(position * BATCH // len(devices), (position + 1) * BATCH // len(devices))
                workspace.FeedBlob(f"{prefix}_{d}/data", x[part])
                workspace.FeedBlob(f"{prefix}_{d}/label", y[part])
            if step == 0:  # the nets are created for the float64 blobs they run on
                workspace.RunNetOnce(model.param_init_net)
                _set_float64_params(model, prefix, devices)
                dpm.CreateNet(model)
            dpm.RunNet(model, 1)
            snapshots.append(_replica_blobs(prefix, devices))
    return snapshots


def _set_float64_params(model: ModelHelper, prefix: str, devices: list[int]) -> None:
    """The same float64 values for every replica's copy of each param (every float blob in float64)."""
    rng = np.random.default_rng(3)
    values = {str(p).split("/", 1)[1]: None for p in model.GetParams(f"{prefix}_{devices[0]}/")}
    for name in values:
        shape = workspace.FetchBlob(f"{prefix}_{devices[0]}/{name}").shape
        values[name] = rng.uniform(0.5, 1.5, shape) if name.endswith("_bn_s") else rng.normal(0, 0.5, shape)
    for blob in workspace.Blobs():
        tensor = workspace.FetchTensor(blob)
        if tensor.is_floating_point():
            workspace.FeedBlob(blob, tensor.double())
    for d in devices:
        for name, value in values.items():
            workspace.FeedBlob(f"{prefix}_{d}/{name}", value)


def _replica_blobs(prefix: str, devices: list[int]) -> dict[str, list[np.ndarray]]:
    scopes = [f"{prefix}_{d}/" for d in devices]
    names = {b[len(scopes[0]):] for b in workspace.Blobs() if b.startswith(scopes[0])}
    return {n: [workspace.FetchBlob(s + n) for s in scopes] for n in names}


def _compare(got: dict[str, list[np.ndarray]], expected: dict[str, list[np.ndarray]], step: int) -> int:
    """Check every blob of the one-device run against the N copies; return how many were compared."""
    for name, (ref,) in expected.items():
        copies, where = got[name], f"{name} after step {step}"
        if name in LOSS_SEEDS:
            continue
        if name in LOSS_BLOBS:  # scaled_loss is loss / N per device: compare through the mean of losses
            np.testing.assert_allclose(np.mean([c * (len(copies) if name == "scaled_loss" else 1)
                                                for c in copies]), ref, rtol=1e-10, err_msg=where)
        elif all(c.shape == ref.shape for c in copies):  # replicated: params, stats, gradients of params
            for copy in copies:
                np.testing.assert_allclose(copy, ref, rtol=1e-9, atol=1e-12, err_msg=where)
        else:  # per-example: data, activations and their gradients
            np.testing.assert_allclose(np.concatenate(copies), ref, rtol=1e-9, atol=1e-12, err_msg=where)
    return len(expected)


@pytest.fixture(scope="module")
def one_device_run() -> list[dict[str, list[np.ndarray]]]:
    return _train([0], gpu=False, combine=False)


@pytest.mark.parametrize(("devices", "gpu", "options"), [
    ([0, 1], False, {}), ([1, 2, 3], False, {}), ([6, 2, 5, 4], False, {}),
    ([1, 0], True, {"use_nccl": True}), ([3, 2, 1, 0], True, {})])
def test_combined_bn_trains_like_one_device_on_the_whole_batch(one_device_run, devices, gpu, options):
    runs = _train(devices, gpu, combine=True, **options)
    for step, (got, expected) in enumerate(zip(runs, one_device_run), start=1):
        assert _compare(got, expected, step) > 60
    added = {f"{conv}_{stat}" for conv in ("conv1", "branch2a", "branch1") for stat in ("sums", "sumsq", "count")}
    assert set(runs[0]) - set(one_device_run[0]) == added  # the global statistics of each BN input


def test_every_nccl_collective_of_the_train_net_is_in_one_chain():
    """Batch-norm statistics, computed-param broadcasts and gradients: one fixed order of collectives."""
    with cuda_on_cpu():
        model = _parallelize(_conv_bn_net, [1, 0], gpu=True, combine=True, use_nccl=True)
    collectives = [op for op in model.net.Proto().ops if op.type.startswith("NCCL")]
    assert {op.type for op in collectives} == {"NCCLAllreduce", "NCCLBroadcast"}
    assert collectives[0].control_inputs == []
    for previous, op in zip(collectives, collectives[1:]):
        assert op.control_inputs == [previous.outputs[0]], op


def test_without_combine_the_statistics_are_per_device_and_training_differs(one_device_run):
    got = _train([0, 1], gpu=False, combine=False)[-1]
    expected = one_device_run[-1]
    assert not np.allclose(np.concatenate(got["conv1_bn"]), expected["conv1_bn"][0], atol=1e-3)
    assert not np.allclose(got["conv1_bn_rm"][0], expected["conv1_bn_rm"][0], atol=1e-3)
    assert not np.allclose(got["conv1_w"][0], expected["conv1_w"][0], atol=1e-3)


def test_gpu_replicas_with_host_side_ops_can_be_combined():
    """A GPU replica's CPU ops (here a copy to the host) run on CPU device 0 whatever the replica;
    interleaving goes by their blobs' scope (by device id, every replica's CPU op looked like device 0's)."""
    def forward(model: ModelHelper, loss_scale: float) -> list:
        losses = _tanh_bn_sqr(model, loss_scale)
        with DeviceScope(DeviceOption(CPU, 0)):
            model.net.CopyGPUToCPU("bn_out", "bn_out_host")
        return losses

    batch = np.random.default_rng(0).random((4, 1, 1, 1), dtype=np.float32)
    expected = (batch - batch.mean()) / np.sqrt(batch.var() + EPS)
    workspace.ResetWorkspace()
    with cuda_on_cpu():
        model = _parallelize(forward, [1, 0], gpu=True, combine=True)
        for d, part in ((1, batch[:2]), (0, batch[2:])):
            workspace.FeedBlob(f"gpu_{d}/data", np.arctanh(part))
        dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
    host = np.concatenate([workspace.FetchBlob(f"gpu_{d}/bn_out_host") for d in (1, 0)])
    np.testing.assert_allclose(host, expected, rtol=1e-4, atol=1e-4)


def test_replicas_that_differ_are_refused_and_the_model_is_left_unchanged():
    def forward(model: ModelHelper, loss_scale: float) -> list:
        h = brew.spatial_bn(model, "data", "bn", 1, is_test=False)
        if CurrentNameScope().startswith("cpu_1"):
            h = model.net.Tanh(h, "extra")
        return [model.net.SumElements(h, "loss")]

    model = ModelHelper(name="uneven")
    with pytest.raises(ParallelizeError, match=r"replicas differ at op index 1 \(device 0: SumElements, "
                                               r"device 1: Tanh\)"):
        _parallelize(forward, [0, 1], gpu=False, combine=True, model=model)
    assert model.net.Proto().ops == [] and model.params == []
