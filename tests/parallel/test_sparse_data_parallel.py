"""Sparse gradients under Parallelize: Caffe2's sparse tests ported, and N devices == 1 device."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import brew, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core import CPU, BlobReference, DeviceOption, DeviceScope, GradientSlice, NameScope
from graphpar.devices import cuda_on_cpu
from graphpar.model_helper import Initializer

V = 2000  # Caffe2 used 10000 rows


def _equiv_sparse_run(devices: list[int], cpu_indices: bool, gpu: bool) -> tuple[np.ndarray, np.ndarray]:
    """Caffe2's SparseDataParallelModelTest.test_equiv_sparse: a 16-wide embedding table, 16 lookups per
    example flattened into an FC; SparseMomentumSGDUpdate for the table, WeightedSum for the FC."""
    prefix = "gpu" if gpu else "cpu"
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name=f"sparse{len(devices)}")
    cpu = DeviceOption(CPU)
    with DeviceScope(cpu), NameScope("cpu"):
        it = model.param_init_net.ConstantFill([], "ITER", shape=[1], value=0, dtype="int64")
        lr = model.net.LearningRate([model.net.Iter(it, it)], "LR", base_lr=-0.1, policy="fixed")
        vecs = model.param_init_net.UniformFill([], "vecs", shape=[V, 16])
        if cpu_indices:
            model.params.append(vecs)
        one_cpu = model.param_init_net.ConstantFill([], "ONE_CPU", shape=[1], value=1.0)

    def model_build_fun(model, loss_scale):
        if cpu_indices:
            with DeviceScope(cpu):
                gathered_cpu = model.net.Gather([vecs, "indices"], "gathered_cpu")
            gathered = model.net.CopyCPUToGPU(gathered_cpu, "gathered") if gpu else gathered_cpu
        else:
            copy = model.param_init_net.CopyCPUToGPU if gpu else model.param_init_net.Copy
            gpu_vecs = copy(vecs, "gpuvecs")
            model.params.append(gpu_vecs)
            gathered = model.net.Gather([gpu_vecs, "indices"], "gathered")
        flattened = model.net.Flatten(gathered, "flattened")
        fc = brew.fc(model, flattened, "fc", 16 * 16, 1, ("ConstantFill", {}), ("ConstantFill", {}))
        sigm = model.net.Sigmoid(model.net.FlattenToVec(fc, "fc_fl"), "sigm")
        loss = model.net.AveragedLoss(model.net.SquaredL2Distance([sigm, "label"], "sq"), "loss")
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    def param_update_fun(model):
        one = model.param_init_net.ConstantFill([], "ONE", shape=[1], value=1.0)
        rate = model.net.CopyCPUToGPU(lr, "LR") if gpu else model.net.Copy(lr, "LR")
        for param in model.GetParams():
            grad = model.param_to_grad[param]
            if not isinstance(grad, GradientSlice):
                model.net.WeightedSum([param, one, grad, rate], param)
                continue
            momentum = model.param_init_net.ConstantFill([param], f"{dpm.stripBlobName(param)}_momentum",
                                                         value=0.0)
            positive = model.net.Negative(rate, "LR_positive")
            model.net.SparseMomentumSGDUpdate([grad.values, momentum, positive, param, grad.indices],
                                              [grad.values, momentum, param], momentum=0.1, nesterov=0)

    with cuda_on_cpu(gpu):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=model_build_fun,
                        param_update_builder_fun=param_update_fun, devices=devices, cpu_device=not gpu)
        if cpu_indices:
            grad = model.param_to_grad[vecs]
            with DeviceScope(cpu), NameScope("cpu"):
                model.net.ScatterWeightedSum([vecs, one_cpu, grad.indices, grad.values, lr], vecs)
        else:
            with DeviceScope(cpu):
                model.net.Copy(f"{prefix}_{devices[0]}/gpuvecs", vecs)
        np.random.seed(2603)
        batch = 64
        for i in range(10):
            full_indices = np.random.permutation(V)[:batch * 16].reshape(batch, 16)
            full_labels = full_indices[:, 0] % 2
            per = batch // len(devices)
            for j, d in enumerate(devices):
                workspace.FeedBlob(f"{prefix}_{d}/indices", full_indices[j * per:(j + 1) * per].astype(np.int32))
                workspace.FeedBlob(f"{prefix}_{d}/label", full_labels[j * per:(j + 1) * per].astype(np.float32))
            if i == 0:
                dpm.RunInitNet(model)
                orig = np.random.rand(V, 16).astype(np.float32)
                workspace.FeedBlob("cpu/vecs", orig)
                if not cpu_indices:
                    for d in devices:
                        workspace.FeedBlob(f"{prefix}_{d}/gpuvecs", orig)
                dpm.CreateNet(model, overwrite=True)
            dpm.RunNet(model, 1)
            if not cpu_indices and len(devices) > 1:  # the fed indices are left as they were
                assert workspace.FetchBlob(f"{prefix}_{devices[0]}/indices").shape == (per, 16)
        table = workspace.FetchBlob("cpu/vecs")
        assert not np.allclose(table, orig)
        return table, workspace.FetchBlob(f"{prefix}_{devices[0]}/fc_w")


@pytest.mark.slow
@pytest.mark.parametrize(("cpu_indices", "gpu"), [(True, False), (True, True), (False, False), (False, True)])
def test_equiv_sparse(cpu_indices, gpu):
    """1 device == 2 == 4 devices (Caffe2 ran 1, 2, 4, 8 GPUs; indices on the CPU, then on the device)."""
    table, fc_w = _equiv_sparse_run([0], cpu_indices, gpu)
    for devices in ([0, 1], [0, 1, 2, 3]):
        other_table, other_fc_w = _equiv_sparse_run(devices, cpu_indices, gpu)
        np.testing.assert_allclose(other_table, table, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other_fc_w, fc_w, rtol=1e-5, atol=1e-6)


def _shared_indices_model(model, loss_scale):
    """Two embedding tables looked up with one `indices` blob, a third table that is not a param."""
    gathered = []
    for k, width in enumerate((4, 4, 4)):
        table = model.create_param(f"emb_{k}", [50, width], Initializer("GaussianFill", std=0.1)) if k < 2 else \
            model.param_init_net.GaussianFill([], f"emb_{k}", shape=[50, width], std=0.1)
        gathered.append(model.net.Gather([table, "indices"], f"gathered_{k}"))
    both = model.net.Add([model.net.Mul([gathered[0], gathered[2]], "product"), gathered[1]], "summed")
    pred = brew.fc(model, both, "pred", 4, 3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def test_sparse_shared_indices():
    """Caffe2's test_sparse_shared_indices_gpu: slices sharing one indices blob concatenate it once, and
    every replica's combined indices match its combined values."""
    devices = [0, 1, 2]
    model = model_helper.ModelHelper(name="shared_indices")
    with cuda_on_cpu():
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_shared_indices_model,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=devices)
        rng = np.random.default_rng(2603)
        for _ in range(2):
            for d in devices:
                workspace.FeedBlob(f"gpu_{d}/indices", rng.permutation(50)[:8].astype(np.int64))
                workspace.FeedBlob(f"gpu_{d}/label", rng.integers(0, 3, 8).astype(np.int32))
            if not workspace.HasBlob("gpu_0/emb_0"):
                dpm.RunInitNet(model)
            dpm.RunNet(model, 1)
    concats = [op for op in model.net.Proto().ops if op.type == "Concat"]
    assert [op.outputs[0] for op in concats] == ["gpu_0/indices_concat", "gpu_0/gathered_1_grad_concat",
                                                 "gpu_0/gathered_0_grad_concat"]  # reverse creation order
    for d in devices:
        for k in (0, 1):
            grad = model.param_to_grad[BlobReference(f"gpu_{d}/emb_{k}")]
            assert grad == GradientSlice(f"gpu_{d}/indices_concat", f"gpu_{d}/gathered_{k}_grad_concat")
            assert len(workspace.FetchBlob(grad.indices)) == len(workspace.FetchBlob(grad.values)) == 24
        assert workspace.FetchBlob(f"gpu_{d}/indices").shape == (8,)
    assert list(model._device_grouped_blobs["indices:gathered_0_grad"]) == devices
