"""Parallelize end to end: N devices train exactly like one device (eager PyTorch) on the whole batch."""

from __future__ import annotations

import functools
import gc
import os
import re
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphpar import brew, checkpoint, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core import CPU, CUDA, BlobReference, CurrentNameScope, DeviceOption, DeviceScope, Net
from graphpar.core.schema import validate_net
from graphpar.devices import cuda_on_cpu, num_cuda_devices
from graphpar.errors import MissingBlobError, ParallelizeError
from graphpar.models import lenet, mlp
from graphpar.models.common import softmax_loss
from graphpar.ops.collective import nccl_backend
from tests.fake_gpus import fake_gpus
from tests.fake_nccl import FakeNccl

MLP = functools.partial(mlp, dim_in=6, hidden=(5,), num_classes=3)
MLP_PARAMS = ["fc1_w", "fc1_b", "pred_w", "pred_b"]
CNN = functools.partial(lenet, channels=(2, 3), hidden=4, num_classes=3, image_size=16)
CNN_PARAMS = ["conv1_w", "conv1_b", "conv2_w", "conv2_b", "fc3_w", "fc3_b", "pred_w", "pred_b"]


def sgd(momentum: float = 0.9, lr: float = 0.1, **kwargs):
    return lambda model: optimizer.build_sgd(model, lr, momentum=momentum, **kwargs)


def batches(steps: int, size: int, shape: tuple[int, ...], seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, *shape), dtype=np.float32), rng.integers(0, 3, size).astype(np.int32))
            for _ in range(steps)]


def feed(model, x: np.ndarray, y: np.ndarray) -> None:
    """Device i of model._devices gets the i-th contiguous chunk of the batch."""
    n = len(model._devices)
    for i, (xs, ys) in enumerate(zip(np.split(x, n), np.split(y, n))):
        d = model._devices[i]
        workspace.FeedBlob(f"{model._device_prefix}_{d}/data", xs)
        workspace.FeedBlob(f"{model._device_prefix}_{d}/label", ys)


def fetch_params(model, names: list[str], device: int | None = None) -> dict[str, np.ndarray]:
    device = model._devices[0] if device is None else device
    return {n: workspace.FetchBlob(f"{model._device_prefix}_{device}/{n}") for n in names}


def assert_replicas_identical(model, names: list[str]) -> None:
    first = fetch_params(model, names)
    for d in model._devices[1:]:
        for name, value in fetch_params(model, names, d).items():
            np.testing.assert_array_equal(value, first[name], err_msg=f"{name} on device {d}")


def train(forward, names, devices, data, cpu_device=True, check_replicas=False, **options):
    """Parallelize, init, then one step per batch; return (model, initial params, final params)."""
    model = model_helper.ModelHelper(name="train")
    options.setdefault("optimizer_builder_fun", sgd())
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    devices=devices, cpu_device=cpu_device, **options)
    initial = None
    for x, y in data:
        feed(model, x, y)
        if initial is None:
            dpm.RunInitNet(model)
            initial = fetch_params(model, names)
            if check_replicas:
                assert_replicas_identical(model, names)
        dpm.RunNet(model, 1)
        if check_replicas:
            assert_replicas_identical(model, names)
    return model, initial, fetch_params(model, names)


def torch_train(step_fn, params: dict[str, np.ndarray], data, lr=0.1, momentum=0.9) -> dict[str, np.ndarray]:
    """Eager PyTorch SGD (torch.optim.SGD) on the whole batch, from the same initial params."""
    tensors = {n: torch.tensor(v, requires_grad=True) for n, v in params.items()}
    opt = torch.optim.SGD(list(tensors.values()), lr=lr, momentum=momentum)
    for x, y in data:
        opt.zero_grad()
        logits = step_fn(tensors, torch.tensor(x))
        F.cross_entropy(logits, torch.tensor(y).long()).backward()
        opt.step()
    return {n: t.detach().numpy() for n, t in tensors.items()}


def mlp_logits(p, x):
    h = F.relu(F.linear(x, p["fc1_w"], p["fc1_b"]))
    return F.linear(h, p["pred_w"], p["pred_b"])


def cnn_logits(p, x):
    h = F.max_pool2d(F.conv2d(x, p["conv1_w"], p["conv1_b"]), 2, 2)
    h = F.max_pool2d(F.conv2d(h, p["conv2_w"], p["conv2_b"]), 2, 2)
    h = F.relu(F.linear(h.flatten(1), p["fc3_w"], p["fc3_b"]))
    return F.linear(h, p["pred_w"], p["pred_b"])


def assert_params_close(actual, expected, rtol=1e-4, atol=1e-5):
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


# ---- numerical equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [[0], [0, 1], [2, 3, 4], [1, 2, 3, 4], [3, 4, 5, 6, 7], list(range(8)),
                                     list(range(2, 18))])
def test_mlp_on_n_devices_equals_eager_pytorch_on_the_whole_batch(devices):
    data = batches(3, 2 * len(devices), (6,))
    _, initial, final = train(MLP, MLP_PARAMS, devices, data, check_replicas=True)
    assert_params_close(final, torch_train(mlp_logits, initial, data))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [[0], [1, 2], [4, 5, 6]])
def test_small_cnn_on_n_devices_equals_eager_pytorch(devices):
    data = batches(2, 2 * len(devices), (1, 16, 16))
    _, initial, final = train(CNN, CNN_PARAMS, devices, data, check_replicas=True)
    assert_params_close(final, torch_train(cnn_logits, initial, data))


@pytest.mark.parametrize("use_nccl", [False, True, "fake NCCL"])
def test_simulated_cuda_replicas_train_like_eager_pytorch(use_nccl):
    """"fake NCCL" runs the collectives' NCCL branch through a CPU stand-in for torch.cuda.nccl."""
    devices = [1, 2, 3, 4]
    data = batches(2, 8, (6,))
    fake = FakeNccl()
    with cuda_on_cpu(), nccl_backend(fake if use_nccl == "fake NCCL" else None):
        model, initial, final = train(MLP, MLP_PARAMS, devices, data, cpu_device=False,
                                      use_nccl=bool(use_nccl), check_replicas=True)
    assert fake.calls["all_reduce"] == (4 * len(data) if use_nccl == "fake NCCL" else 0)
    assert model._device_prefix == "gpu"
    ops = model.net.Proto().ops
    assert {op.device_option for op in ops if op.inputs and op.inputs[0].startswith("gpu_3/")} >= {
        DeviceOption(CUDA, 3)}
    assert dpm.GetLearningRateBlobNames(model) == [f"SgdOptimizer_{model._optimizer._instance_num}_lr_gpu{d}"
                                                   for d in devices]
    reduce_type = "NCCLAllreduce" if use_nccl else "Sum"
    assert sum(op.type == reduce_type for op in ops) == (4 if use_nccl else 12)
    assert_params_close(final, torch_train(mlp_logits, initial, data))


@pytest.mark.cuda
def test_real_cuda_devices_train_like_eager_pytorch():
    devices = list(range(min(num_cuda_devices(), 4)))
    data = batches(2, 2 * len(devices), (6,))
    model, initial, final = train(MLP, MLP_PARAMS, devices, data, cpu_device=False, check_replicas=True)
    assert workspace.FetchTensor(f"gpu_{devices[-1]}/fc1_w").is_cuda
    assert_params_close(final, torch_train(mlp_logits, initial, data))


def test_per_device_update_builder_trains_like_the_optimizer_builder():
    """GetLearningRateBlobNames works without an optimizer object (Caffe2 raised AttributeError/TypeError)."""
    def update(model):
        it = brew.iter(model, "ITER")
        lr = model.net.LearningRate([it], "LR", base_lr=-0.1, policy="fixed")
        one = model.param_init_net.ConstantFill([], "ONE", shape=[1], value=1.0)
        for param in model.GetParams():
            model.net.WeightedSum([param, one, model.param_to_grad[param], lr], param)

    data = batches(3, 6, (6,))
    model, initial, final = train(MLP, MLP_PARAMS, [1, 2, 3], data, param_update_builder_fun=update,
                                  optimizer_builder_fun=None, check_replicas=True)
    assert_params_close(final, torch_train(mlp_logits, initial, data, momentum=0.0))
    assert dpm.GetLearningRateBlobNames(model) == ["cpu_1/LR", "cpu_2/LR", "cpu_3/LR"]
    assert workspace.FetchBlob("cpu_3/ITER").tolist() == [3]


# ---- the all-reduce the net gets ---------------------------------------------------------------------


def _dpm_sums(model) -> list[tuple[list[str], str]]:
    return [(op.inputs, op.outputs[0]) for op in model.net.Proto().ops if op.type == "Sum" and op.name == "dpm"]


def _parallelized(devices, forward=MLP, **options) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="m")
    options.setdefault("optimizer_builder_fun", sgd())
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward, devices=devices,
                    cpu_device=True, **options)
    return model


PAIRS = {
    3: [(0, 1, 2)],
    4: [(0, 1), (2, 3), (0, 2)],
    8: [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (4, 6), (0, 4)],
    16: [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15), (0, 2), (4, 6), (8, 10),
         (12, 14), (0, 4), (8, 12), (0, 8)],
}


@pytest.mark.parametrize("count", [3, 4, 8, 16])
def test_gradients_are_summed_in_reverse_creation_order_by_the_exact_tree(count):
    devices = [d + 5 for d in range(count)]
    model = _parallelized(devices, cpu_update_once=False)  # the reducer's copies back, as built
    expected = []
    for grad in ["pred_b_grad", "pred_w_grad", "fc1_b_grad", "fc1_w_grad"]:
        for positions in PAIRS[count]:
            blobs = [f"cpu_{devices[p]}/{grad}" for p in positions]
            expected.append((blobs, blobs[0]))
    assert _dpm_sums(model) == expected
    ops = model.net.Proto().ops
    first_sum = next(i for i, op in enumerate(ops) if op.name == "dpm")
    copies = [(op.inputs, op.outputs) for op in ops[first_sum:] if op.type == "Copy"]
    assert copies[:count - 1] == [(["cpu_5/pred_b_grad"], [f"cpu_{d}/pred_b_grad"]) for d in devices[1:]]
    assert len(copies) == 4 * (count - 1)


def test_train_net_settings_and_initial_sync():
    model = _parallelized([0, 1], net_type="simple", num_threads_per_device=3)
    proto = model.net.Proto()
    assert (proto.type, proto.num_workers) == ("simple", 6)
    assert proto.args["first_iter_only_one_worker"] == 1
    init_ops = model.param_init_net.Proto().ops
    synced = [(op.inputs[0], op.outputs[0]) for op in init_ops if op.type == "Copy"]
    assert synced == [(f"cpu_0/{n}", f"cpu_1/{n}") for n in
                      MLP_PARAMS + [f"{p}_momentum" for p in MLP_PARAMS]]
    assert init_ops[-len(synced):] == [op for op in init_ops if op.type == "Copy"]
    validate_net(proto)
    validate_net(model.param_init_net.Proto())


def _bn_forward(model, loss_scale):
    bn = brew.spatial_bn(model, "data", "bn", dim_in=2, epsilon=1e-5, momentum=0.5)
    pred = brew.fc(model, bn, "pred", dim_in=2 * 3 * 3, dim_out=3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def test_batch_norm_running_stats_are_copied_from_the_first_device():
    (x, y), = batches(1, 4, (2, 3, 3))
    for broadcast in (True, False):
        workspace.ResetWorkspace()
        model, _, _ = train(_bn_forward, ["bn_s"], [0, 1], [(x, y)], broadcast_computed_params=broadcast)
        first_half = torch.tensor(x[:2])
        expected = 0.5 * first_half.mean(dim=(0, 2, 3))
        np.testing.assert_allclose(workspace.FetchBlob("cpu_0/bn_rm"), expected.numpy(), rtol=1e-5, atol=1e-6)
        second = workspace.FetchBlob("cpu_1/bn_rm")
        if broadcast:
            np.testing.assert_array_equal(second, workspace.FetchBlob("cpu_0/bn_rm"))
        else:
            np.testing.assert_allclose(second, 0.5 * x[2:].mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gpu", [False, True])
def test_batch_norm_running_stats_can_be_averaged_over_the_devices(gpu):
    """average_computed_params: after a step every replica holds the mean of what each replica computed
    on its own share of the batch (measured with broadcast_computed_params=False), whatever
    broadcast_computed_params says; the ops sit where the broadcast would, before the gradients'."""
    devices, stats = [1, 2, 3], ["bn_rm", "bn_riv"]
    data = batches(1, 6, (2, 3, 3))
    with cuda_on_cpu():
        model, _, _ = train(_bn_forward, stats, devices, data, cpu_device=not gpu, broadcast_computed_params=False)
        own = [fetch_params(model, stats, d) for d in devices]
        workspace.ResetWorkspace()
        model, _, _ = train(_bn_forward, stats, devices, data, cpu_device=not gpu, average_computed_params=True)
        for d in devices:
            for name, value in fetch_params(model, stats, d).items():
                expected = np.mean([o[name] for o in own], axis=0)
                np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7, err_msg=f"{name} on {d}")
    ops = model.net.Proto().ops
    prefix = model._device_prefix
    scales = [i for i, op in enumerate(ops) if op.type == "Scale" and op.outputs[0].endswith(("/bn_rm", "/bn_riv"))]
    assert [ops[i].outputs[0] for i in scales] == [f"{prefix}_{d}/{n}" for n in stats for d in devices]
    first_grad_sum = next(i for i, op in enumerate(ops) if op.name == "dpm" and op.outputs[0].endswith("_grad"))
    assert max(scales) < first_grad_sum


# ---- gradient bucketing -------------------------------------------------------------------------------

# The MLP's gradients in reverse creation order: pred_b 12 bytes, pred_w 60, fc1_b 20, fc1_w 120; these
# limits make three buckets, each closing once it holds its limit: [pred_b] (the small first one),
# [pred_w, fc1_b], [fc1_w].
BUCKETS = dict(gradient_bucket_bytes=80, first_bucket_bytes=12)


@pytest.mark.parametrize("devices", [[0, 1], [2, 3, 4], [1, 2, 3, 4], list(range(8))])
def test_bucketed_all_reduce_trains_exactly_like_the_per_gradient_one_and_eager_pytorch(devices):
    data = batches(2, 2 * len(devices), (6,))
    _, initial, bucketed = train(MLP, MLP_PARAMS, devices, data, check_replicas=True, **BUCKETS)
    workspace.ResetWorkspace()
    _, _, plain = train(MLP, MLP_PARAMS, devices, data)
    for name in MLP_PARAMS:  # the same additions in the same order
        np.testing.assert_array_equal(bucketed[name], plain[name], err_msg=name)
    assert_params_close(bucketed, torch_train(mlp_logits, initial, data))


@pytest.mark.parametrize("use_nccl", [False, True])
def test_bucketed_simulated_cuda_replicas_train_like_eager_pytorch(use_nccl):
    devices = [1, 2, 3, 4]
    data = batches(2, 8, (6,))
    with cuda_on_cpu():
        model, initial, final = train(MLP, MLP_PARAMS, devices, data, cpu_device=False, use_nccl=use_nccl,
                                      check_replicas=True, **BUCKETS)
    ops = model.net.Proto().ops
    reduced = [op.inputs[0] for op in ops if op.type == "NCCLAllreduce" or op.name == "dpm"]
    roots = [1] if use_nccl else [1, 3, 1]  # one NCCLAllreduce, or the Sum tree over 4 devices
    assert reduced == [f"gpu_{d}/{g}" for g in ("pred_b_grad", "_bucket_1", "fc1_w_grad") for d in roots]
    assert_params_close(final, torch_train(mlp_logits, initial, data))


def test_bucketing_sizes_a_param_that_a_non_fill_op_creates():
    """fc1_w is a Copy of a fill: shape inference sizes it, and training is unchanged."""
    devices, data = [0, 1], batches(2, 4, (6,))
    _, initial, bucketed = train(_param_copied_in_init, MLP_PARAMS, devices, data, check_replicas=True, **BUCKETS)
    assert_params_close(bucketed, torch_train(mlp_logits, initial, data))


def test_bucketing_replaces_only_the_all_reduce_and_leaves_the_updates_alone():
    def ops_of(model):  # the optimizers' instance numbers differ
        rename = functools.partial(re.sub, r"SgdOptimizer_\d+", "SgdOptimizer")
        return [(op.type, [rename(b) for b in op.inputs], [rename(b) for b in op.outputs])
                for op in model.net.Proto().ops]

    plain = ops_of(_parallelized([3, 5], cpu_update_once=False))
    model = _parallelized([3, 5], cpu_update_once=False, **BUCKETS)
    bucketed = ops_of(model)
    start = next(i for i, op in enumerate(plain) if op[0] == "Sum" and op[2] == ["cpu_3/pred_b_grad"])
    end = start + 8  # Sum + Copy per gradient
    assert bucketed[:start] == plain[:start] and bucketed[-(len(plain) - end):] == plain[end:]

    def flatten(d):
        return [("FlattenToVec", [f"cpu_{d}/pred_w_grad"], [f"cpu_{d}/pred_w_grad_flat"]),
                ("FlattenToVec", [f"cpu_{d}/fc1_b_grad"], [f"cpu_{d}/fc1_b_grad_flat"]),
                ("Concat", [f"cpu_{d}/pred_w_grad_flat", f"cpu_{d}/fc1_b_grad_flat"],
                 [f"cpu_{d}/_bucket_1", f"cpu_{d}/_bucket_1_split_info"])]

    def unflatten(d):
        return [("Split", [f"cpu_{d}/_bucket_1"], [f"cpu_{d}/pred_w_grad_flat", f"cpu_{d}/fc1_b_grad_flat"]),
                ("Reshape", [f"cpu_{d}/pred_w_grad_flat"], [f"cpu_{d}/pred_w_grad", f"cpu_{d}/pred_w_grad_old_shape"]),
                ("Reshape", [f"cpu_{d}/fc1_b_grad_flat"], [f"cpu_{d}/fc1_b_grad", f"cpu_{d}/fc1_b_grad_old_shape"])]

    def reduce(blob):
        return [("Sum", [f"cpu_3/{blob}", f"cpu_5/{blob}"], [f"cpu_3/{blob}"]),
                ("Copy", [f"cpu_3/{blob}"], [f"cpu_5/{blob}"])]

    assert bucketed[start:len(bucketed) - (len(plain) - end)] == [
        *reduce("pred_b_grad"), *flatten(3), *flatten(5), *reduce("_bucket_1"), *unflatten(3), *unflatten(5),
        *reduce("fc1_w_grad")]
    split = next(op for op in model.net.Proto().ops if op.type == "Split")
    assert split.args == {"axis": 0, "split": [15, 5]}


def test_bucketing_with_a_shared_model_trains_like_eager_pytorch():
    data = batches(2, 6, (6,))
    model, initial, final = train(MLP, MLP_PARAMS, [0, 1, 2], data, shared_model=True, **BUCKETS)
    assert sum(op.type == "Split" for op in model.net.Proto().ops) == 1
    assert_params_close(final, torch_train(mlp_logits, initial, data))


# ---- checkpoints ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_resume_on_another_device_count_equals_the_uninterrupted_run(tmp_path):
    data = batches(6, 6, (6,))
    lr_schedule = sgd(lr=0.2, policy="step", stepsize=2, gamma=0.5)
    _, _, uninterrupted = train(MLP, MLP_PARAMS, [0, 1], data, optimizer_builder_fun=lr_schedule)

    workspace.SwitchWorkspace("first_half", True)
    first, _, _ = train(MLP, MLP_PARAMS, [0, 1], data[:3], optimizer_builder_fun=lr_schedule)
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, dpm.GetCheckpointParams(first))

    workspace.SwitchWorkspace("second_half", True)
    resumed = model_helper.ModelHelper(name="resumed")
    dpm.Parallelize(resumed, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP,
                    optimizer_builder_fun=lr_schedule, devices=[0, 1, 2], cpu_device=True)
    feed(resumed, *data[3])
    dpm.RunInitNet(resumed)
    loaded = checkpoint.load(path)
    assert "optimizer_iteration" in loaded  # unscoped: Caffe2's FinalizeAfterCheckpoint raised on it
    dpm.FinalizeAfterCheckpoint(resumed, blobs=loaded)
    for x, y in data[3:]:
        feed(resumed, x, y)
        dpm.RunNet(resumed, 1)
        assert_replicas_identical(resumed, MLP_PARAMS)
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [6]
    assert_params_close(fetch_params(resumed, MLP_PARAMS), uninterrupted, rtol=1e-5, atol=1e-6)


def test_finalize_after_checkpoint_broadcasts_loaded_values_and_is_built_once():
    """Unscoped names are accepted (Caffe2's stripBlobName raised ValueError on optimizer_iteration)."""
    model, _, _ = train(MLP, MLP_PARAMS, [1, 2, 3], batches(1, 3, (6,)))
    new = np.arange(15, dtype=np.float32).reshape(3, 5)
    workspace.FeedBlob("cpu_1/pred_w", new)
    dpm.FinalizeAfterCheckpoint(model, blobs=["pred_w", "optimizer_iteration"])
    net = model._checkpoint_net
    for d in (2, 3):
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{d}/pred_w"), new)
    workspace.FeedBlob("cpu_1/pred_w", new + 1)
    dpm.FinalizeAfterCheckpoint(model, blobs=["ignored: built once"])
    assert model._checkpoint_net is net
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_3/pred_w"), new + 1)
    assert [op.outputs[0] for op in net.Proto().ops] == ["cpu_2/pred_w", "cpu_3/pred_w"]


def test_finalize_refuses_blobs_of_other_devices_and_builds_nothing():
    """E.g. a checkpoint saved on devices [0, 1] loaded for replicas [1, 2]: cpu_0/... would go unused."""
    model, _, _ = train(MLP, MLP_PARAMS, [1, 2], batches(1, 2, (6,)))
    with pytest.raises(ParallelizeError, match="saved with other devices"):
        dpm.FinalizeAfterCheckpoint(model, blobs=["cpu_0/pred_w", "optimizer_iteration"])
    assert getattr(model, "_checkpoint_net", None) is None


def test_finalize_defaults_to_every_synced_blob():
    model, _, _ = train(MLP, MLP_PARAMS, [0, 1], batches(1, 2, (6,)))
    workspace.FeedBlob("cpu_0/fc1_b_momentum", np.full(5, 3.0, np.float32))
    dpm.FinalizeAfterCheckpoint(model)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_1/fc1_b_momentum"), np.full(5, 3.0, np.float32))
    synced = {op.outputs[0] for op in model._checkpoint_net.Proto().ops}
    assert synced == {f"cpu_1/{p}{s}" for p in MLP_PARAMS for s in ("", "_momentum")}


# ---- Caffe2's data_parallel_model_test, ported --------------------------------------------------


def _equiv_run(devices: list[int], gpu: bool = False) -> np.ndarray:
    """Caffe2's test_equiv model: FC 16->1 (zeros), Sigmoid, L2 loss; clipping, LR injection; on CPU
    also a shared model and combine_spatial_bn (interleaved replicas; the model has no batch norm).
    `gpu` runs on logical CUDA devices placed on the CPU (Caffe2 needed that many GPUs)."""
    def add_model(model, loss_scale):
        fc = brew.fc(model, "data", "fc", dim_in=16, dim_out=1, weight_init=("ConstantFill", {}),
                     bias_init=("ConstantFill", {}))
        sigm = model.net.Sigmoid(model.net.FlattenToVec(fc, "fc_fl"), "sigm")
        loss = model.net.AveragedLoss(model.net.SquaredL2Distance([sigm, "label"], "sq"), "loss")
        model.param_init_net.UniformFill([], "sync_num", shape=[1])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    workspace.ResetWorkspace()
    prefix = "gpu" if gpu else "cpu"
    model = model_helper.ModelHelper(name=f"test{len(devices)}")
    with cuda_on_cpu(gpu):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_model,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(
                            m, 0.1, policy="fixed", max_gradient_norm=5.0, allow_lr_injection=True),
                        devices=devices, cpu_device=not gpu, shared_model=not gpu, combine_spatial_bn=not gpu)
        dpm.AddBlobSync(model, ["sync_num"])
        assert len(dpm.GetLearningRateBlobNames(model)) > 0
        np.random.seed(2603)
        batch = 64
        for i in range(10):
            data = np.random.rand(batch, 16).astype(np.float32)
            label = np.round(data[:, 0]).astype(np.float32)
            for j, d in enumerate(devices):
                part = slice(j * batch // len(devices), (j + 1) * batch // len(devices))
                workspace.FeedBlob(f"{prefix}_{d}/data", data[part])
                workspace.FeedBlob(f"{prefix}_{d}/label", label[part])
            if i == 0:
                dpm.RunInitNet(model)
            workspace.FeedBlob(f"{prefix}_{devices[0]}/sync_num", np.array([i * 2], np.float32))
            dpm.RunNet(model, 1)
            for d in devices:
                assert abs(workspace.FetchBlob(f"{prefix}_{d}/sync_num")[0] - i * 2) < 0.01
    return workspace.FetchBlob(f"{prefix}_{devices[0]}/fc_w")


@pytest.mark.slow
@pytest.mark.parametrize("gpu", [False, True])
def test_equiv(gpu):
    """Caffe2's test_equiv with 1, 2, 4, 8, 16 devices, on CPU and on (logical) CUDA devices."""
    reference = _equiv_run([0], gpu)
    assert np.abs(reference).sum() > 0
    for count in (2, 4, 8, 16):
        np.testing.assert_allclose(_equiv_run(list(range(count)), gpu), reference, rtol=1e-5, atol=1e-8)


def _conv_stack(model, dim_out: int = 10):
    """Caffe2's checkpoint-test trunk (shrunk): NHWC->NCHW, conv 7x7/2, BN, Relu, max-pool, FC."""
    model.net.NHWC2NCHW("data", "data_nchw")
    brew.conv(model, "data_nchw", "conv1", 3, 8, weight_init=("MSRAFill", {}), kernel=7, stride=2, pad=3)
    brew.spatial_bn(model, "conv1", "conv1_spatbn_relu", 8, epsilon=1e-3, is_test=False)
    brew.relu(model, "conv1_spatbn_relu", "conv1_spatbn_relu")
    brew.max_pool(model, "conv1_spatbn_relu", "pool1", kernel=3, stride=2)
    return brew.fc(model, "pool1", "fc", dim_in=8 * 3 * 3, dim_out=dim_out)


def test_checkpoint_params():
    def add_model(model, loss_scale):
        fc = _conv_stack(model, dim_out=100)
        sigm = model.net.Sigmoid(fc, "fc_sigm")
        softmax = model.net.Softmax(sigm, "softmax")
        xent = model.net.LabelCrossEntropy([softmax, "label"], "xent")
        loss = model.net.AveragedLoss(xent, "loss")
        model.param_init_net.ConstantFill([], "fc_w", shape=(100, 8 * 3 * 3))  # a duplicate init op
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    model = model_helper.ModelHelper(name="test_checkpoint_params")
    dpm.Parallelize_CPU(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_model,
                        optimizer_builder_fun=sgd(), devices=[1, 2, 3])
    params = dpm.GetCheckpointParams(model)
    for p in model.GetParams("cpu_1/"):
        assert p in params and p + "_momentum" in params
    for p in model.GetParams("cpu_2/"):
        assert p not in params
    assert "cpu_1/fc_w_momentum" in params
    computed = model.GetComputedParams("")
    assert len(computed) == 6
    for c in computed:
        assert (c in params) == c.startswith("cpu_1/")
    assert "cpu_1/data" not in params and "optimizer_iteration" in params


def test_net_conversion_and_append_net():
    other = model_helper.ModelHelper(name="other")
    fc1 = brew.fc(other, "data", "other_fc1", dim_in=3 * 16 * 16, dim_out=10)
    fc2 = brew.fc(other, fc1, "other_fc2", dim_in=10, dim_out=10)
    brew.fc(other, fc2, "other_fc3", dim_in=10, dim_out=10)

    def add_input(model):
        model.net.UniformFill([], ["data"], shape=[4, 16, 16, 3])
        model.net.UniformFill([], ["label"], shape=[4])

    def add_model(model, loss_scale):
        _conv_stack(model)
        model.net.AppendNet(dpm.ConvertNetForDevice(other.net))
        model.param_init_net.AppendNet(dpm.ConvertNetForDevice(other.param_init_net))
        sigm = model.net.Sigmoid("fc", "fc_sigm")
        softmax = model.net.Softmax(sigm, "softmax")
        return [model.net.AveragedLoss(softmax, "loss")]

    model = model_helper.ModelHelper(name="test_net_conversion")
    dpm.Parallelize_CPU(model, input_builder_fun=add_input, forward_pass_builder_fun=add_model,
                        optimizer_builder_fun=sgd(), devices=list(range(4)))
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    appended = [op for op in model.net.Proto().ops if op.outputs[:1] == ["cpu_3/other_fc3"]]  # CheckFinite has none
    assert [(op.inputs, op.device_option) for op in appended] == [
        (["cpu_3/other_fc2", "cpu_3/other_fc3_w", "cpu_3/other_fc3_b"], DeviceOption(CPU, 3))]
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_3/other_fc1_w"), workspace.FetchBlob("cpu_0/other_fc1_w"))


def test_device_scope_check():
    with DeviceScope(DeviceOption(CUDA, 0)), pytest.raises(ParallelizeError, match="without a device scope"):
        dpm.Parallelize_GPU(None, None, None)


@pytest.mark.parametrize("training", [False, True])
def test_net_transformer_function(training):
    def add_input(model):
        model.param_init_net.UniformFill([], ["data"], shape=[32, 8])

    def add_model(model, loss_scale):
        return [brew.fc(model, "data", "fc1", dim_in=8, dim_out=8)]

    transform = mock.Mock()
    model = model_helper.ModelHelper(name="r", init_params=training)
    dpm.Parallelize_CPU(model, input_builder_fun=add_input, forward_pass_builder_fun=add_model,
                        net_transformer_fun=transform, devices=[1, 2, 3],
                        optimizer_builder_fun=sgd(0.0) if training else None)
    transform.assert_called_once_with(model, 3, "cpu", CPU)


# ---- misuse: a clear error, and the model is left exactly as it was -------------------------------


def _state(model) -> tuple:
    return (sorted(vars(model)), str(model.net), str(model.param_init_net), list(model.params),
            list(model._computed_params), dict(model.param_to_grad), model.net.Proto().type)


def _cross_read(model, loss_scale):
    losses = MLP(model, loss_scale)
    if CurrentNameScope() == "cpu_1/":
        model.net.Add([BlobReference("cpu_0/fc1"), "fc1"], "mixed")
    return losses


def _duplicate(model, loss_scale):
    losses = MLP(model, loss_scale)
    model.params.append(model.params[-1])
    return losses


def _param_copied_in_init(model, loss_scale):
    """fc1_w is created by a Copy in param_init_net: its size is not in any op's arguments."""
    losses = MLP(model, loss_scale)
    fill = next(op for op in model.param_init_net.Proto().ops if op.outputs == [f"{CurrentNameScope()}fc1_w"])
    fill.outputs = [f"{CurrentNameScope()}fc1_w_init"]
    model.param_init_net.Copy("fc1_w_init", "fc1_w")
    return losses


def _param_shaped_by_values(model, loss_scale):
    """fc1_w is filled to the shape a blob holds: shape inference cannot know its size."""
    losses = MLP(model, loss_scale)
    init = model.param_init_net.Proto()
    fill = next(op for op in init.ops if op.outputs == [f"{CurrentNameScope()}fc1_w"])
    init.ops.remove(fill)
    shape = model.param_init_net.GivenTensorInt64Fill([], "fc1_w_shape", values=fill.args["shape"], shape=[2])
    model.param_init_net.GaussianFill(shape, "fc1_w", input_as_shape=1)
    return losses


def _external_params(model, loss_scale):
    model.init_params = False  # params get no init op: they cannot be synced or trained
    return MLP(model, loss_scale)


MISUSES = {
    "duplicate params": (dict(forward_pass_builder_fun=_duplicate), ParallelizeError, "Duplicate entries"),
    "builder returns a blob, not a list": (
        dict(forward_pass_builder_fun=lambda m, s: MLP(m, s)[0]), ParallelizeError, "list of loss blobs"),
    "builder returns names, not blobs": (
        dict(forward_pass_builder_fun=lambda m, s: [str(b) for b in MLP(m, s)]), ParallelizeError,
        "list of loss blobs"),
    "both update builders": (dict(param_update_builder_fun=lambda m: None), ParallelizeError, "only one of"),
    "param not created in param_init_net": (
        dict(forward_pass_builder_fun=_external_params), ParallelizeError, "not instantiated in param_init_net"),
    "cross-device read": (dict(forward_pass_builder_fun=_cross_read), ParallelizeError,
                          "touches 'cpu_0/fc1'"),
    "nonexistent CUDA device": (dict(cpu_device=False, devices=[0, 99]), ParallelizeError, "do not exist"),
    "shared model on CUDA": (dict(cpu_device=False, shared_model=True), ParallelizeError, "only supported on CPU"),
    "duplicate device ids": (dict(devices=[1, 1]), ParallelizeError, "unique"),
    "no devices": (dict(devices=[]), ParallelizeError, r"no devices \(devices is empty\)"),
    "non-int device ids": (dict(devices=["0"]), TypeError, "int device ids"),
    "bad net type": (dict(net_type="async"), ParallelizeError, "net_type"),
    "rendezvous without shard_id": (dict(rendezvous={"num_shards": 2, "kv_handler": "store"}), ParallelizeError,
                                    "rendezvous needs shard_id"),
    "rendezvous with an unknown key": (dict(rendezvous={"shard_id": 0, "num_shards": 2, "kv_handler": "s",
                                                        "kv_handle": "s"}), ParallelizeError,
                                       r"unknown rendezvous key\(s\) \['kv_handle'\]"),
    "rendezvous with a bad engine": (dict(rendezvous={"shard_id": 0, "num_shards": 2, "kv_handler": "s",
                                                      "engine": "MPI"}), ParallelizeError, "engine"),
    "rendezvous with shard_id out of range": (dict(rendezvous={"shard_id": 2, "num_shards": 2, "kv_handler": "s"}),
                                              ParallelizeError, "0 <= shard_id < num_shards"),
    "rendezvous with a bad kv_handler": (dict(rendezvous={"shard_id": 0, "num_shards": 2, "kv_handler": 3}),
                                         ParallelizeError, "kv_handler"),
    "rendezvous with shared_model": (dict(rendezvous={"shard_id": 0, "num_shards": 2, "kv_handler": "s"},
                                          shared_model=True), ParallelizeError, "shared_model across shards"),
    "zero concurrent distributed ops": (dict(max_concurrent_distributed_ops=0), ParallelizeError,
                                        "max_concurrent_distributed_ops must be an int >= 1"),
    "negative bucket bytes": (dict(gradient_bucket_bytes=-1), ParallelizeError, "gradient_bucket_bytes must be >= 0"),
    "negative first bucket": (dict(gradient_bucket_bytes=64, first_bucket_bytes=-1), ParallelizeError,
                              "first_bucket_bytes must be >= 1"),
    "float bucket bytes": (dict(gradient_bucket_bytes=1.5), TypeError, "gradient_bucket_bytes must be an int"),
    "bool bucket bytes": (dict(gradient_bucket_bytes=True), TypeError, "gradient_bucket_bytes must be an int"),
    "str first bucket": (dict(first_bucket_bytes="1MB"), TypeError, "first_bucket_bytes must be an int"),
    "bucketing a param of unknown size": (
        dict(forward_pass_builder_fun=_param_shaped_by_values, gradient_bucket_bytes=64), ParallelizeError,
        "size of param 'cpu_0/fc1_w', but shape inference .* depends on tensor values"),
    "builder not callable": (dict(input_builder_fun=None), TypeError, "input_builder_fun must be a function"),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_misuse_raises_and_leaves_the_model_unchanged(case):
    options, error, message = MISUSES[case]
    model = model_helper.ModelHelper(name="misuse")
    model.param_init_net.ConstantFill([], "shared_table", shape=[2])  # state from before Parallelize
    model.AddParameter(BlobReference("shared_table"))
    net, before = model.net, _state(model)
    kwargs = dict(input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP, devices=[0, 1],
                  cpu_device=True, optimizer_builder_fun=sgd())
    with pytest.raises(error, match=message):
        dpm.Parallelize(model, **{**kwargs, **options})
    assert _state(model) == before and model.net is net
    model.init_params = True
    dpm.Parallelize(model, **kwargs)  # the model is still usable
    assert model._grad_names == [f"{p}_grad" for p in MLP_PARAMS] and "shared_table" in model.params


def test_a_cpu_device_scope_is_allowed_and_cpu_devices_default_to_the_core_count():
    with DeviceScope(DeviceOption(CPU, 0)):
        model = _parallelized(None)
    assert model._devices == list(range(os.cpu_count() or 1))


@pytest.mark.skipif(num_cuda_devices() > 0, reason="checks the error on machines without CUDA")
def test_cuda_devices_default_to_none_without_a_gpu(monkeypatch):
    fake_gpus(monkeypatch, 0)  # a machine without GPUs, whatever this one has
    with pytest.raises(ParallelizeError, match="no devices"):
        dpm.Parallelize(model_helper.ModelHelper(name="g"), lambda m: None, MLP, optimizer_builder_fun=sgd())


def test_the_garbage_collector_is_left_as_it_was():
    """Parallelize pauses the collector while building, but keeps the caller's setting."""
    assert gc.isenabled()
    _parallelized([0, 1])
    assert gc.isenabled()
    gc.disable()
    try:
        _parallelized([0, 1])
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ParallelizeError):
        _parallelized([0, 1], forward=lambda m, scale: "not a list")  # a failed build restores it too
    assert gc.isenabled()


def test_parallelizing_twice_and_non_models_are_refused():
    model = _parallelized([0, 1])
    with pytest.raises(ParallelizeError, match="already parallelized"):
        dpm.Parallelize(model, lambda m: None, MLP, devices=[0, 1], cpu_device=True)
    with pytest.raises(TypeError, match="ModelHelper"):
        dpm.Parallelize(object(), lambda m: None, MLP, devices=[0], cpu_device=True)


def test_helpers_of_models_that_were_not_parallelized_raise():
    model = model_helper.ModelHelper(name="plain")
    for call in (dpm.RunInitNet, lambda m: dpm.RunNet(m, 1), dpm.GetCheckpointParams, dpm.GetDevices,
                 lambda m: dpm.AddBlobSync(m, ["x"]), dpm.FinalizeAfterCheckpoint,
                 lambda m: dpm.AddDistributedBlobSync(m, ["x"]),
                 lambda m: dpm.OptimizeGradientMemory(m, {}, [], False)):
        with pytest.raises(ParallelizeError, match="not parallelized"):
            call(model)


# ---- the rest of the API --------------------------------------------------------------------------


def test_builders_run_in_order_with_their_scopes():
    calls = []

    def record(what):
        return lambda model: calls.append((what, CurrentNameScope(), model.gradient_ops_added))

    def forward(model, loss_scale):
        calls.append(("forward", CurrentNameScope(), loss_scale))
        return MLP(model, loss_scale)

    def build_optimizer(model):
        calls.append(("optimizer", CurrentNameScope(), model.gradient_ops_added))
        return optimizer.build_sgd(model, 0.1)

    model = model_helper.ModelHelper(name="order")
    dpm.Parallelize(model, input_builder_fun=record("input"), forward_pass_builder_fun=forward,
                    optimizer_builder_fun=build_optimizer, post_sync_builder_fun=record("post_sync"),
                    pre_grad_net_transformer_fun=record("pre_grad"), devices=[3, 7], cpu_device=True)
    assert calls == [("input", "cpu_3/", False), ("forward", "cpu_3/", 0.5), ("input", "cpu_7/", False),
                     ("forward", "cpu_7/", 0.5), ("pre_grad", "", False), ("optimizer", "", True),
                     ("post_sync", "cpu_3/", True), ("post_sync", "cpu_7/", True)]
    assert isinstance(model._optimizer, optimizer.SgdOptimizer)
    assert dpm.GetDevices(model) == [3, 7] and model.GetDevices() == [3, 7]


def test_forward_only_models_get_net_lists_and_share_the_trained_params():
    """Caffe2 gave forward-only models no net lists, so RunInitNet/RunNet failed on them."""
    (x, y), = batches(1, 4, (6,))
    trained, _, _ = train(MLP, MLP_PARAMS, [0, 1], [(x, y)])
    test = model_helper.ModelHelper(name="test", init_params=False)
    dpm.Parallelize(test, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP, devices=[0, 1],
                    cpu_device=True)
    assert test._data_parallel_model_nets == [test.net] and not test.param_init_net.Proto().ops
    feed(test, x, y)
    dpm.RunInitNet(test)
    dpm.RunNet(test, 1)
    params = {n: torch.tensor(v) for n, v in fetch_params(trained, MLP_PARAMS).items()}
    expected = F.softmax(mlp_logits(params, torch.tensor(x)), dim=1).numpy()
    softmax = np.concatenate([workspace.FetchBlob(f"cpu_{d}/softmax") for d in (0, 1)])
    np.testing.assert_allclose(softmax, expected, rtol=1e-5, atol=1e-6)
    assert not [op for op in test.net.Proto().ops if op.is_gradient_op or op.type == "Copy"]


def test_forward_only_model_with_init_params_warns(caplog):
    with caplog.at_level("WARNING", logger="graphpar.data_parallel_model"):
        _parallelized([0, 1], optimizer_builder_fun=None)
    assert "init_params=False" in caplog.text


def test_run_net_runs_the_net_num_iterations_times():
    """Caffe2 also ran its barrier net once per iteration; graphpar has no barrier net on one host."""
    model, _, _ = train(MLP, MLP_PARAMS, [0, 1], batches(1, 2, (6,)))
    dpm.RunNet(model, 3)
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [4]


def test_pre_existing_params_are_not_replicated_and_need_no_gradient():
    """Caffe2 raised KeyError for a pre-existing param without a gradient and dropped the first
    len(non_data_params) grouped entries by position; graphpar filters by name."""
    model = model_helper.ModelHelper(name="pre")
    model.param_init_net.ConstantFill([], "table", shape=[3], value=1.0)
    model.AddParameter(BlobReference("table"))
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP,
                    optimizer_builder_fun=sgd(), devices=[0, 1], cpu_device=True)
    assert "table" not in model._device_grouped_blobs and model._param_names == MLP_PARAMS


def test_add_blob_sync_appends_copies_and_needs_unprefixed_names():
    model = _parallelized([2, 4, 6])
    before = len(model.net.Proto().ops)
    dpm.AddBlobSync(model, ["stat"])
    added = model.net.Proto().ops[before:]
    assert [(op.type, op.inputs, op.outputs) for op in added] == [
        ("Copy", ["cpu_2/stat"], ["cpu_4/stat"]), ("Copy", ["cpu_2/stat"], ["cpu_6/stat"])]
    dpm.AddBlobSync(model, [])
    other = Net("other")
    dpm.AddBlobSync(model, ["x"], net=other)
    assert len(other.Proto().ops) == 2 and "cpu_2/x" in other.Proto().external_inputs
    with pytest.raises(ParallelizeError, match="unprefixed"):
        dpm.AddBlobSync(model, ["cpu_2/stat"])


def test_convert_net_for_device_prefixes_every_blob():
    net = Net("plain")
    net.FC(["x", "w", "b"], "y")
    net.Proto().ops[0].control_inputs = ["c"]
    net.AddExternalOutput("y")
    with DeviceScope(DeviceOption(CUDA, 2)):
        converted = dpm.ConvertNetForDevice(net)
    proto = converted.Proto()
    op = proto.ops[0]
    assert (op.inputs, op.outputs, op.control_inputs) == (["gpu_2/x", "gpu_2/w", "gpu_2/b"], ["gpu_2/y"],
                                                           ["gpu_2/c"])
    assert op.device_option == DeviceOption(CUDA, 2)
    assert proto.external_inputs == ["gpu_2/x", "gpu_2/w", "gpu_2/b"] and proto.external_outputs == ["gpu_2/y"]
    assert net.Proto().ops[0].inputs == ["x", "w", "b"]
    cpu_op = dpm.ConvertNetForDevice(net.Proto(), DeviceOption(CPU, 1)).Proto().ops[0]
    assert cpu_op.outputs == ["cpu_1/y"]
    with pytest.raises(ValueError, match="needs a device"):
        dpm.ConvertNetForDevice(net)
    with pytest.raises(TypeError, match="must be a DeviceOption, got 1"):
        dpm.ConvertNetForDevice(net, 1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_extract_predictor_net_gives_an_unscoped_forward_net(interleaved):
    """Interleaved replicas (combine_spatial_bn) put the other replicas' ops between the first one's;
    they must not be extracted too."""
    def forward(model, loss_scale):
        h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=5)
        pred = brew.fc(model, brew.relu(model, h, h), "pred", dim_in=5, dim_out=3)
        model.net.Softmax(pred, "prob")
        return softmax_loss(model, pred, "label", loss_scale)

    model, _, _ = train(forward, MLP_PARAMS, [1, 2], batches(1, 2, (6,)), combine_spatial_bn=interleaved)
    predictor, params = dpm.ExtractPredictorNet(model, ["data"], ["prob"], DeviceOption(CPU, 0))
    ops = predictor.Proto().ops
    assert [op.type for op in ops] == ["FC", "Relu", "FC", "Softmax"]
    assert params == MLP_PARAMS
    assert all("/" not in b for op in ops for b in (*op.inputs, *op.outputs))
    for name in params:
        workspace.FeedBlob(name, workspace.FetchBlob(f"cpu_1/{name}"))
    x = np.ones((2, 6), np.float32)
    workspace.FeedBlob("data", x)
    workspace.RunNetOnce(predictor)
    expected = F.softmax(mlp_logits({n: torch.tensor(workspace.FetchBlob(n)) for n in MLP_PARAMS},
                                    torch.tensor(x)), dim=1)
    np.testing.assert_allclose(workspace.FetchBlob("prob"), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_run_init_net_of_an_init_params_false_model_without_its_params_points_to_inference(caplog):
    """In a fresh workspace nothing creates such a model's params (issue 35 item 4): the error says
    what init_params=False is for and where predicting from a checkpoint is explained."""
    def forward(model, loss_scale):
        return softmax_loss(model, brew.fc(model, "data", "pred", dim_in=6, dim_out=3), "label", loss_scale)

    model = model_helper.ModelHelper(name="predict_only", init_params=False)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward, devices=[0, 1],
                    cpu_device=True)
    for d in (0, 1):
        workspace.FeedBlob(f"cpu_{d}/data", np.ones((2, 6), np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", np.zeros(2, np.int32))
    before = sorted(workspace.Blobs())
    with pytest.raises(MissingBlobError, match=r"RunInitNet\('predict_only'\): its params do not exist "
                                               r"\('cpu_0/pred_w', 'cpu_0/pred_b', 'cpu_1/pred_w' \.\.\.\), and the model "
                                               r"was built with init_params=False.*\(docs/inference.md\)"):
        dpm.RunInitNet(model)
    assert sorted(workspace.Blobs()) == before
    with caplog.at_level("WARNING"):
        dpm.Parallelize(model_helper.ModelHelper(name="eval_with_init"), input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=forward, devices=[0], cpu_device=True)
    assert "in this workspace" in caplog.text and "docs/inference.md" in caplog.text


def test_strip_blob_name_is_exported():
    assert dpm.stripBlobName("gpu_3/a/b") == "a/b" and dpm.stripBlobName("optimizer_iteration") == "optimizer_iteration"
