"""Mixed-precision training end to end on the CPU (bfloat16 runs there): N devices against one device on
the concatenated batch, and bf16 training against fp32 training over 50 steps.

Tolerances, and why: a replica computes its Conv/FC weight gradients in bfloat16 (8-bit mantissa) and
rounds them to bf16 before the fp32 all-reduce sums them, while one device rounds the gradient of the
whole batch once; the two differ by about 2^-8 of a gradient per step (fp32 differs by an ulp of fp32,
~2^-24). So N devices match one device to a few 1e-3 after three SGD steps, far below the step itself.
Over 50 steps bf16 losses stay within the stated distance of fp32's.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.models import lenet, resnet18

CNN = functools.partial(lenet, image_size=16, channels=(4, 8), hidden=16)
RESNET = functools.partial(resnet18, num_classes=3, width=2)


def _train(forward, devices, compute_dtype, steps, shape, classes, lr=0.1, batch=8, batches=None, **kwargs):
    """Train with one global batch per step split evenly over `devices`; the per-step losses (summed
    over replicas: the loss of the whole batch) and the first device's params."""
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="mp")
    dpm.Parallelize(model, lambda m: None, forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, lr, momentum=0.9),
                    devices=list(devices), cpu_device=True, compute_dtype=compute_dtype, **kwargs)
    rng = np.random.default_rng(0)
    count = batches or steps
    xs = rng.standard_normal((count, batch, *shape), dtype=np.float32)
    ys = rng.integers(0, classes, (count, batch)).astype(np.int32)
    k, losses = batch // len(devices), []
    for step in range(steps):
        for i, d in enumerate(devices):
            workspace.FeedBlob(f"cpu_{d}/data", xs[step % count, i * k:(i + 1) * k])
            workspace.FeedBlob(f"cpu_{d}/label", ys[step % count, i * k:(i + 1) * k])
        if step == 0:
            dpm.RunInitNet(model)
            start = {p: workspace.FetchBlob(p) for p in model.GetParams(f"cpu_{devices[0]}/")}
        dpm.RunNet(model, 1)
        losses.append(sum(float(workspace.FetchBlob(f"cpu_{d}/scaled_loss")) for d in devices))
    params = {p.split("/")[1]: (start[p], workspace.FetchBlob(p)) for p in model.GetParams(f"cpu_{devices[0]}/")}
    return np.array(losses), params


def _compare_devices(forward, shape, classes, tolerance, steps, **kwargs):
    _, one = _train(forward, [0], "bfloat16", steps, shape, classes, **kwargs)
    _, two = _train(forward, [0, 1], "bfloat16", steps, shape, classes, **kwargs)
    moved = max(float(np.abs(after - before).max()) for before, after in one.values())
    for name, (_, after) in one.items():
        np.testing.assert_allclose(two[name][1], after, rtol=0, atol=tolerance, err_msg=name)
    assert moved > 20 * tolerance  # the training moved the params far more than the two runs differ


def test_two_devices_in_bf16_equal_one_device_on_the_concatenated_batch_cnn():
    _compare_devices(CNN, (1, 16, 16), 10, tolerance=5e-3, steps=3)


@pytest.mark.slow
def test_two_devices_in_bf16_equal_one_device_resnet18_with_combined_batch_norm():
    """Batch norm over the whole batch (combine_spatial_bn), its statistics fp32 from bf16 activations.
    One step: later steps of this 2-channel batch-norm stack amplify the 2^-8 differences, as they amplify
    bf16's against fp32's (eager torch.autocast on a width-2 conv+BN stack: gradients 100% apart)."""
    _compare_devices(RESNET, (3, 8, 8), 3, tolerance=5e-3, steps=1, lr=0.05, combine_spatial_bn=True)


def test_bf16_uses_fp32_masters_and_moves_them_by_small_steps():
    """Updates smaller than bf16's resolution of the param still land in the fp32 master."""
    _, params = _train(CNN, [0], "bfloat16", 2, (1, 16, 16), 10, lr=1e-4)
    before, after = params["fc3_w"]
    changed = after != before
    assert changed.mean() > 0.5
    assert (after[changed].astype(np.float32) != torch.tensor(after[changed]).bfloat16().float().numpy()).any()


@pytest.mark.slow
@pytest.mark.parametrize("forward, shape, classes, batch, per_step, last10, learnt", [
    (CNN, (1, 16, 16), 10, 8, 0.15, 0.05, 0.4),  # measured: 0.067, 0.017; both at 0.32 of the first loss
    # ResNet-18 of width 8, batches of 32: over seeds 0-5 the means of the last 10 were 0.004-0.07 apart
    # and at most 0.11 of the first loss; the per-step losses differ by up to 0.34 (batch norm over few
    # values amplifies bf16's rounding), so no per-step bound. (Width 4 with batches of 8 passed for seed
    # 0 only: with seed 1 bf16 ended at 0.70 of the first loss, and in one whole-suite run it reached NaN.)
    (functools.partial(resnet18, num_classes=3, width=8), (3, 8, 8), 3, 32, None, 0.15, 0.25),
])
def test_bf16_training_tracks_fp32_over_50_steps(forward, shape, classes, batch, per_step, last10, learnt):
    """The same 4 batches cycled for 50 steps (lr 0.01, momentum 0.9): each bf16 loss within `per_step`
    of fp32's, the means of the last 10 within `last10`, and both learn (under `learnt` x the first loss)."""
    fp32, _ = _train(forward, [0], None, 50, shape, classes, lr=0.01, batch=batch, batches=4)
    bf16, _ = _train(forward, [0], "bfloat16", 50, shape, classes, lr=0.01, batch=batch, batches=4)
    if per_step is not None:
        assert np.abs(bf16 - fp32).max() <= per_step, np.abs(bf16 - fp32).max()
    assert abs(bf16[-10:].mean() - fp32[-10:].mean()) <= last10, (bf16[-10:].mean(), fp32[-10:].mean())
    assert bf16[-10:].mean() < learnt * bf16[0] and fp32[-10:].mean() < learnt * fp32[0]


@pytest.mark.parametrize("options", [{}, {"gradient_bucket_bytes": 4096}])
def test_allreduce_dtype_sums_bf16_gradients_and_updates_fp32_masters(options):
    """allreduce_dtype="bfloat16": every collective sums bf16 copies (half the bytes), the sums are cast
    back, and training matches the fp32 all-reduce to bf16's rounding of the gradients (2^-8)."""
    from graphpar.core.shapes import infer_specs

    _, fp32 = _train(CNN, [0, 1], None, 2, (1, 16, 16), 10, **options)
    _, low = _train(CNN, [0, 1], None, 2, (1, 16, 16), 10, allreduce_dtype="bfloat16", **options)
    net = workspace.get_workspace().nets
    model_net = next(plan.netdef for plan in net.values() if plan.netdef.name.startswith("mp"))
    specs = infer_specs(model_net, workspace.get_workspace().blobs)
    reduced = [op for op in model_net.ops if op.type == "Sum" and len({b.split("/")[0] for b in op.inputs}) > 1]
    assert reduced and all(specs[b].dtype == torch.bfloat16 for op in reduced for b in op.inputs)
    moved = max(float(np.abs(after - before).max()) for before, after in fp32.values())
    for name, (_, after) in fp32.items():
        assert low[name][1].dtype == np.float32
        np.testing.assert_allclose(low[name][1], after, rtol=0, atol=2e-3, err_msg=name)
    assert moved > 20 * 2e-3


@pytest.mark.parametrize("kwargs, message", [
    ({"allreduce_dtype": "int8"}, "allreduce_dtype='int8'"),
    ({"allreduce_dtype": "bfloat16", "rendezvous": {"shard_id": 0, "num_shards": 2, "engine": "GLOO",
                                                     "kv_handler": None}}, "not supported with a rendezvous"),
])
def test_bad_allreduce_dtype_raises_before_the_model_changes(kwargs, message):
    from graphpar.errors import ParallelizeError

    model = model_helper.ModelHelper(name="bad_allreduce_dtype")
    with pytest.raises(ParallelizeError, match=message):
        dpm.Parallelize(model, lambda m: None, CNN, optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                        devices=[0], cpu_device=True, **kwargs)
    assert not model.net.Proto().ops


def test_bf16_with_nccl_on_logical_gpus_all_reduces_bf16_and_trains_like_the_tree():
    """The NCCL branch (through a CPU stand-in for torch.cuda.nccl) on logical CUDA devices: compute and
    all-reduce in bf16, the same params as the Sum tree's to bf16 rounding."""
    from graphpar.devices import cuda_on_cpu
    from graphpar.ops.collective import nccl_backend
    from tests.fake_nccl import FakeNccl

    def train(**kwargs):
        workspace.ResetWorkspace()
        model = model_helper.ModelHelper(name="nccl_bf16")
        dpm.Parallelize(model, lambda m: None, CNN, devices=[0, 1], cpu_device=False,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                        compute_dtype="bfloat16", allreduce_dtype="bfloat16", **kwargs)
        rng = np.random.default_rng(0)
        for step in range(2):
            for d in (0, 1):
                workspace.FeedBlob(f"gpu_{d}/data", rng.standard_normal((4, 1, 16, 16), dtype=np.float32))
                workspace.FeedBlob(f"gpu_{d}/label", rng.integers(0, 10, 4).astype(np.int32))
            if step == 0:
                dpm.RunInitNet(model)
            dpm.RunNet(model, 1)
        return {p: workspace.FetchBlob(p) for p in model.GetParams("gpu_1/")}

    fake = FakeNccl()
    with cuda_on_cpu(), nccl_backend(fake):
        tree, nccl = train(), train(use_nccl=True)
    assert fake.calls["all_reduce"] >= 2 * 8
    for name, value in tree.items():
        np.testing.assert_allclose(nccl[name], value, rtol=0, atol=1e-2, err_msg=name)
