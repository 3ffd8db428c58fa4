"""Parallelize_BMUF: Caffe2's test_parallelize_bmuf, and BMUF against a NumPy reference over blocks."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import brew, checkpoint, model_helper, workspace
from graphpar import data_parallel_model as dpm
from graphpar.devices import cuda_on_cpu
from graphpar.errors import ParallelizeError
from graphpar.ops.collective import nccl_backend
from tests.fake_nccl import FakeNccl


def _model(model, loss_scale, init=("ConstantFill", {})):
    """Caffe2's BMUF test model: FC 16->1, Sigmoid, L2 distance to the label, averaged and scaled."""
    fc = brew.fc(model, "data", "fc", dim_in=16, dim_out=1, weight_init=init, bias_init=init)
    sigm = model.net.Sigmoid(model.net.FlattenToVec(fc, "fc_fl"), "sigm")
    loss = model.net.AveragedLoss(model.net.SquaredL2Distance([sigm, "label"], "sq"), "loss")
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _random_model(model, loss_scale):
    return _model(model, loss_scale, ("GaussianFill", {"std": 0.5}))


def _sgd_update(model, lr=0.1):
    """Caffe2's per-device update: Iter, LearningRate(-lr, fixed), WeightedSum."""
    it = brew.iter(model, "ITER")
    rate = model.net.LearningRate([it], "LR", base_lr=-lr, policy="fixed")
    one = model.param_init_net.ConstantFill([], "ONE", shape=[1], value=1.0)
    for param in model.GetParams():
        model.net.WeightedSum([param, one, model.param_to_grad[param], rate], param)


def _momentum_update(model, lr=0.1):
    """Local momentum SGD (its momentum buffers are what reset_momentum_sgd zeroes)."""
    it = brew.iter(model, "ITER")
    rate = model.net.LearningRate([it], "LR", base_lr=lr, policy="fixed")
    for param in model.GetParams():
        mom = model.param_init_net.ConstantFill([param], f"{dpm.stripBlobName(param)}_momentum", value=0.0)
        grad = model.param_to_grad[param]
        model.net.MomentumSGDUpdate([grad, mom, rate, param], [grad, mom, param], momentum=0.9)


def _feed(devices, prefix, seed=26, batch=64):
    rng = np.random.default_rng(seed)
    data = rng.random((batch, 16)).astype(np.float32)
    label = np.round(data[:, 0]).astype(np.float32)
    per = batch // len(devices)
    for j, d in enumerate(devices):
        workspace.FeedBlob(f"{prefix}_{d}/data", data[j * per:(j + 1) * per])
        workspace.FeedBlob(f"{prefix}_{d}/label", label[j * per:(j + 1) * per])
    return data, label


def _fetch(name):
    return workspace.FetchBlob(name).copy()


@pytest.mark.parametrize("cpu_device", [True, False])
def test_parallelize_bmuf(cpu_device):
    """Caffe2's ParallelizeBMUFTest.test_parallelize_bmuf: the momentum and param equations hold exactly."""
    prefix, devices = ("cpu" if cpu_device else "gpu"), [0, 1]
    model = model_helper.ModelHelper(name="test")
    with cuda_on_cpu(not cpu_device):
        np.random.seed(26)
        for _ in range(10):
            _feed(devices, prefix, seed=np.random.randint(1 << 30))
        dpm.Parallelize_BMUF(model, lambda m: None, _model, _sgd_update, devices=devices, cpu_device=cpu_device)
        dpm.RunInitNet(model)
        assert list(model._device_grouped_blobs) == ["fc_w", "fc_b"]
        assert _fetch(f"{prefix}_0/fc_b_v") == 0
        np.testing.assert_equal(_fetch(f"{prefix}_0/fc_w_v"), np.zeros((1, 16), np.float32))

        dpm.RunNet(model, 1)
        v_b_, v_w_ = _fetch(f"{prefix}_0/fc_b_v"), _fetch(f"{prefix}_0/fc_w_v")
        workspace.RunNetOnce(model.net)
        b_0_, w_0_ = _fetch(f"{prefix}_0/fc_b"), _fetch(f"{prefix}_0/fc_w")
        b_1_, w_1_ = _fetch(f"{prefix}_1/fc_b"), _fetch(f"{prefix}_1/fc_w")
        b_g_, w_g_ = _fetch(f"{prefix}_0/fc_b_g"), _fetch(f"{prefix}_0/fc_w_g")
        workspace.RunNetOnce(model._global_model_param_updates_net)

        v_b, v_w = _fetch(f"{prefix}_0/fc_b_v"), _fetch(f"{prefix}_0/fc_w_v")
        w_g, b_g = _fetch(f"{prefix}_0/fc_w_g"), _fetch(f"{prefix}_0/fc_b_g")
        w_0, b_0 = _fetch(f"{prefix}_0/fc_w"), _fetch(f"{prefix}_0/fc_b")
        w_1, b_1 = _fetch(f"{prefix}_1/fc_w"), _fetch(f"{prefix}_1/fc_b")
    assert np.abs(v_w).sum() > 0
    np.testing.assert_equal(v_b, 0.5 * v_b_ + ((b_0_ + b_1_) / 2 - b_g_))
    np.testing.assert_equal(v_w, 0.5 * v_w_ + ((w_0_ + w_1_) / 2 - w_g_))
    np.testing.assert_equal(w_g, w_0)
    np.testing.assert_equal(w_g, w_1)
    np.testing.assert_equal(b_g, b_0)
    np.testing.assert_equal(b_g, b_1)
    np.testing.assert_equal(w_0, w_g_ + v_w)
    np.testing.assert_equal(b_0, b_g_ + v_b)


def _local_step(p, x, y, lr, n):
    """One SGD step of one replica on the FC-Sigmoid-L2 model, in float64 (loss scaled by 1/n)."""
    w, b = p
    z = x @ w.T + b
    s = 1.0 / (1.0 + np.exp(-z[:, 0]))
    dz = (s - y) * s * (1 - s) / len(y) / n  # d/dz of mean(0.5 (s - y)^2) / n
    return w - lr * (dz @ x)[None, :], b - lr * dz.sum(keepdims=True)


def _reference(p0, chunks, blocks, steps, lr, bm, blr, nesterov, warmup, max_norm, master):
    """BMUF in NumPy: `warmup` local steps and a broadcast of replica `master`, then `blocks` blocks."""
    n = len(chunks)
    reps = [tuple(a.astype(np.float64) for a in p0) for _ in range(n)]
    for _ in range(warmup):
        reps = [_local_step(r, *c, lr, n) for r, c in zip(reps, chunks)]
    if warmup:
        reps = [reps[master]] * n
    g = [a.copy() for a in reps[master]]
    v = [np.zeros_like(a) for a in g]
    prev = [np.zeros_like(a) for a in g]
    for _ in range(blocks):
        for _ in range(steps):
            reps = [_local_step(r, *c, lr, n) for r, c in zip(reps, chunks)]
        d = [sum(r[k] for r in reps) / n - g[k] for k in range(2)]
        if max_norm is not None:
            norm = np.sqrt(sum((x ** 2).sum() for x in d))
            d = [x * min(1.0, max_norm / norm) for x in d]
        v = [bm * v[k] + blr * d[k] for k in range(2)]
        if nesterov:
            g = [g[k] + v[k] - bm * (v[k] - prev[k]) for k in range(2)]
            prev = [a.copy() for a in v]
        else:
            g = [g[k] + v[k] for k in range(2)]
        reps = [tuple(a.copy() for a in g)] * n
    return g


@pytest.mark.parametrize(("devices", "gpu", "options"), [
    ([0, 1, 2], False, {"nesterov": True, "block_momentum": 0.6, "block_learning_rate": 0.9,
                        "warmup_iterations": 2}),
    ([1, 2], True, {"nesterov": False, "master_device": 2, "warmup_iterations": 1}),
    ([0, 1], False, {"nesterov": True, "max_gradient_norm": 0.02, "optimize_gradient_memory": True}),
])
def test_bmuf_matches_a_numpy_reference_over_several_blocks(devices, gpu, options):
    prefix, lr, steps, blocks = ("gpu" if gpu else "cpu"), 0.5, 3, 4
    model = model_helper.ModelHelper(name="bmuf")
    with cuda_on_cpu(gpu):
        data, label = _feed(devices, prefix, seed=5, batch=12)
        dpm.Parallelize_BMUF(model, lambda m: None, _random_model, lambda m: _sgd_update(m, lr),
                             devices=devices, cpu_device=not gpu, **options)
        dpm.RunInitNet(model)
        p0 = (_fetch(f"{prefix}_{devices[-1]}/fc_w"), _fetch(f"{prefix}_{devices[-1]}/fc_b"))
        if options.get("warmup_iterations"):
            dpm.RunWarmup(model)
        for _ in range(blocks):
            dpm.RunNet(model, steps)
        master = options.get("master_device", devices[0])
        got = [_fetch(f"{prefix}_{master}/fc_{k}_g") for k in "wb"]
        replicas = [[_fetch(f"{prefix}_{d}/fc_{k}") for k in "wb"] for d in devices]
    chunks = list(zip(np.split(data.astype(np.float64), len(devices)), np.split(label.astype(np.float64),
                                                                               len(devices))))
    bm = options.get("block_momentum", 1 - 1 / len(devices))
    expected = _reference(p0, chunks, blocks, steps, lr, bm, options.get("block_learning_rate", 1.0),
                          options["nesterov"], options.get("warmup_iterations", 0), options.get("max_gradient_norm"),
                          devices.index(master))
    for k in range(2):
        assert np.abs(expected[k] - p0[k]).max() > 1e-3
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-4, atol=1e-6)
        for replica in replicas:
            np.testing.assert_array_equal(replica[k], got[k])


def test_replicas_start_identical_and_reset_momentum_zeroes_local_momenta():
    model = model_helper.ModelHelper(name="bmuf_momentum")
    _feed([0, 1], "cpu")
    dpm.Parallelize_CPU_BMUF(model, lambda m: None, _random_model, _momentum_update, devices=[0, 1],
                             reset_momentum_sgd=True, add_blobs_to_sync=["ITER"])
    dpm.RunInitNet(model)
    for name in ("fc_w", "fc_b"):
        np.testing.assert_array_equal(_fetch(f"cpu_1/{name}"), _fetch(f"cpu_0/{name}"))
        np.testing.assert_array_equal(_fetch(f"cpu_0/{name}_g"), _fetch(f"cpu_0/{name}"))
    dpm.RunNet(model, 2)
    for d in (0, 1):
        assert not _fetch(f"cpu_{d}/fc_w_momentum").any()
    assert [op.type for op in model._global_model_param_updates_net.Proto().ops].count("Scale") == 2 * 3 + 4


def test_bmuf_errors_leave_the_model_unchanged():
    model = model_helper.ModelHelper(name="bmuf_bad_args")
    bad = [({"block_momentum": 1.0}, ParallelizeError, "block_momentum"),
           ({"block_learning_rate": 0}, ParallelizeError, "block_learning_rate"),
           ({"master_device": 5}, ParallelizeError, "master_device 5"),
           ({"warmup_iterations": 0}, ParallelizeError, "warmup_iterations"),
           ({"block_momentum": "x"}, TypeError, "block_momentum"),
           ({"add_blobs_to_sync": ["cpu_0/x"]}, ParallelizeError, "unprefixed"),
           ({"rendezvous": {"kv_handler": "s", "shard_id": 0}}, ParallelizeError, "rendezvous needs num_shards"),
           ({"max_concurrent_distributed_ops": 0}, ParallelizeError, "max_concurrent_distributed_ops")]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            dpm.Parallelize_CPU_BMUF(model, lambda m: None, _model, _sgd_update, devices=[0, 1], **kwargs)
        assert not model.net.Proto().ops and model._parallel is None
    dpm.Parallelize_CPU_BMUF(model, lambda m: None, _model, _sgd_update, devices=[0, 1])
    with pytest.raises(ParallelizeError, match="warmup_iterations"):
        dpm.RunWarmup(model)


def _bmuf_run(use_nccl):
    model = model_helper.ModelHelper(name="bmuf_nccl")
    with cuda_on_cpu():
        _feed([0, 1], "gpu", seed=5, batch=12)
        dpm.Parallelize_GPU_BMUF(model, lambda m: None, _random_model, _sgd_update, devices=[0, 1],
                                 master_device=1, nesterov=True, use_nccl=use_nccl)
        dpm.RunInitNet(model)
        dpm.RunNet(model, 2)
        dpm.RunNet(model, 2)
        return [_fetch(f"gpu_{d}/fc_w") for d in (0, 1)], model


def test_use_nccl_gives_the_same_global_model():
    fake = FakeNccl()
    with nccl_backend(fake):
        (w0, w1), model = _bmuf_run(True)
    types = [op.type for op in model._global_model_param_updates_net.Proto().ops]
    assert "NCCLAllreduce" in types and "NCCLBroadcast" in types
    assert fake.calls["all_reduce"] == 4 and fake.calls["broadcast"] >= 4
    workspace.ResetWorkspace()
    (r0, r1), _ = _bmuf_run(False)
    np.testing.assert_array_equal(w0, w1)
    np.testing.assert_allclose(w1, r1, rtol=1e-6, atol=1e-7)


def _bmuf_model(name):
    model = model_helper.ModelHelper(name=name)
    dpm.Parallelize_CPU_BMUF(model, lambda m: None, _random_model, _momentum_update, devices=[0, 1],
                             nesterov=True, reset_momentum_sgd=True)
    return model


def test_resumed_bmuf_equals_uninterrupted(tmp_path):
    """The checkpoint holds the first replica's state and the master's global model; the local momenta
    are reset after each global update, so every replica's state equals the first's there."""
    _feed([0, 1], "cpu", seed=3, batch=12)
    model = _bmuf_model("bmuf_run")
    dpm.RunInitNet(model)
    dpm.RunNet(model, 2)
    names = dpm.GetCheckpointParams(model)
    assert {"cpu_0/fc_w_g", "cpu_0/fc_w_v", "cpu_0/fc_w_prev", "cpu_0/fc_w_momentum"} <= names
    checkpoint.save(str(tmp_path / "ckpt"), names)
    for _ in range(2):
        dpm.RunNet(model, 2)
    uninterrupted = {b: _fetch(b) for b in names}

    workspace.ResetWorkspace()
    _feed([0, 1], "cpu", seed=3, batch=12)
    resumed = _bmuf_model("bmuf_resumed")
    dpm.RunInitNet(resumed)
    checkpoint.load(str(tmp_path / "ckpt"))
    dpm.FinalizeAfterCheckpoint(resumed)
    for _ in range(2):
        dpm.RunNet(resumed, 2)
    for b, value in uninterrupted.items():
        np.testing.assert_array_equal(_fetch(b), value, err_msg=b)


def _all_blobs():
    return {name: workspace.FetchBlob(name).copy() for name in workspace.Blobs()}


def _assert_blobs_equal(before, ignore=()):
    after = _all_blobs()
    for name, value in before.items():
        if name not in ignore:
            np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_run_net_zero_iterations_moves_nothing():
    """Issue 23 item 12: RunNet(model, 0) ran the global update with no local step, moving the params."""
    model = model_helper.ModelHelper(name="bmuf_zero")
    _feed([0, 1], "cpu")
    dpm.Parallelize_CPU_BMUF(model, lambda m: None, _random_model, _momentum_update, devices=[0, 1],
                             nesterov=True)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)  # g, v and the params differ from their initial values now
    before = _all_blobs()
    dpm.RunNet(model, 0)
    _assert_blobs_equal(before)
    dpm.RunNet(model, 1)
    assert not np.array_equal(_fetch("cpu_0/fc_w"), before["cpu_0/fc_w"])


def test_check_finite_loss_keeps_a_nan_replica_from_poisoning_the_others_and_the_global_model():
    """Issue 23 item 13: a NaN batch on one replica made every replica and the global model NaN."""
    from graphpar.errors import OperatorError

    model = model_helper.ModelHelper(name="bmuf_finite")
    _feed([0, 1], "cpu")
    dpm.Parallelize_CPU_BMUF(model, lambda m: None, _random_model, _momentum_update, devices=[0, 1],
                             check_finite_loss=True)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    workspace.FeedBlob("cpu_1/data", np.full((32, 16), np.nan, np.float32))
    workspace.FeedBlob("cpu_0/data", _fetch("cpu_0/data"))
    before = _all_blobs()
    with pytest.raises(OperatorError, match="cpu_1/scaled_loss"):
        dpm.RunNet(model, 1)
    transient = set(before) - set(workspace.Blobs())  # intermediates a failed run drops
    _assert_blobs_equal(before, ignore=transient)
    for name in ("cpu_0/fc_w", "cpu_1/fc_w", "cpu_0/fc_w_g", "cpu_0/fc_w_v"):
        assert np.isfinite(_fetch(name)).all(), name
    _feed([0, 1], "cpu", seed=3)
    dpm.RunNet(model, 1)  # a good batch trains on
    assert np.isfinite(_fetch("cpu_0/fc_w_g")).all()
