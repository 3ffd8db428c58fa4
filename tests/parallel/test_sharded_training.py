"""Sharded optimizer state (ZeRO stages 1 and 2) trains exactly as the unsharded run.

Every comparison here is bit for bit: on one process the sharded run adds every gradient element in
the order the unsharded all-reduce adds it (the Sum tree over device positions, or the NCCL
reference's list order), and element-wise updates give the same bits on a part as on the whole
(tests/ops/test_elementwise.py). The MLP's params have 30, 5, 15 and 3 elements: none divides by 4,
and the last is smaller than 4 devices (one replica owns an empty part). Runs with other orders of
summation (one device on the whole batch; gloo's ring across processes) are compared to a float
tolerance in tests/multihost/test_training.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from graphpar import brew, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.dataflow import dataflow
from graphpar.core.naming import shard_name
from graphpar.devices import cuda_on_cpu
from graphpar.models.common import softmax_loss

STEPS = 2
BATCH = 12  # divisible by 2, 3 and 4 devices
LR = 0.125

OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda m: optimizer.build_sgd(m, LR),
    "momentum": lambda m: optimizer.build_sgd(m, LR, momentum=0.9),
    "nesterov": lambda m: optimizer.build_sgd(m, LR, momentum=0.9, nesterov=True),
    "weight_decay": lambda m: optimizer.build_sgd(m, LR, momentum=0.5, weight_decay=2.0 ** -7),
    "adam": lambda m: optimizer.build_adam(m, 0.01),
    "adagrad": lambda m: optimizer.build_adagrad(m, 0.1),
}
STAGES = {"stage1": {"shard_optimizer_state": True}, "stage2": {"shard_gradients": True}}


def mlp(model: Any, loss_scale: float) -> list:
    h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=5)
    h = brew.relu(model, h, h)
    return softmax_loss(model, brew.fc(model, h, "pred", dim_in=5, dim_out=3), "label", loss_scale)


def cnn(model: Any, loss_scale: float) -> list:
    h = brew.conv(model, "data", "conv1", dim_in=2, dim_out=3, kernel=3, pad=1, no_bias=True)
    h = brew.spatial_bn(model, h, "bn1", dim_in=3, epsilon=1e-5, momentum=0.9)
    h = brew.relu(model, h, h)
    return softmax_loss(model, brew.fc(model, h, "pred", dim_in=3 * 4 * 4, dim_out=3), "label", loss_scale)


def batch(step: int, cnn_input: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + step)
    shape = (2, 4, 4) if cnn_input else (6,)
    return rng.randn(BATCH, *shape).astype(np.float32), rng.randint(0, 3, BATCH).astype(np.int32)


def train(opt: Callable[[Any], Any], devices: int, forward: Callable = mlp, steps: int = STEPS,
          gpu: bool = False, **options: Any) -> dict[str, np.ndarray]:
    """Every replica's params and computed params after each step, and (whole, gathered) the first
    device's optimizer state after the last one; from a fresh workspace with a fixed seed."""
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="sharded")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=opt, devices=list(range(devices)), cpu_device=not gpu, **options)
    prefix = "gpu" if gpu else "cpu"

    def feed(k: int) -> None:
        x, y = batch(k, forward in (cnn, loud_cnn))
        for d, rows in enumerate(np.split(np.arange(BATCH), devices)):
            workspace.FeedBlob(f"{prefix}_{d}/data", x[rows])
            workspace.FeedBlob(f"{prefix}_{d}/label", y[rows])

    feed(0)
    dpm.RunInitNet(model)
    if getattr(model, "_accumulate_net", None) is not None:
        workspace.CreateNet(model._accumulate_net)
    seen: dict[str, np.ndarray] = {}
    for step in range(steps):
        for micro in range(1, options.get("accumulate_gradients", 1)):  # the micro-batches before the last
            feed(100 * step + micro)
            workspace.RunNet(model._accumulate_net)
        feed(step)
        dpm.RunNet(model, 1)
        blobs = [str(p) for p in model.GetParams()] + [str(p) for p in model.GetComputedParams()]
        seen.update({f"{step}/{b}": workspace.FetchBlob(b) for b in blobs})
    seen.update({f"ckpt/{b}": workspace.FetchBlob(b) for b in dpm.GetCheckpointParams(model)})
    seen["skipped"] = np.array(dpm.skipped_steps(model))
    return seen


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_updates_equal_the_unsharded_run_bit_for_bit(name):
    """Both stages on 4 devices: a Sum tree, uneven parts and an empty one."""
    want = train(OPTIMIZERS[name], 4)
    for options in STAGES.values():
        assert_identical(train(OPTIMIZERS[name], 4, **options), want)


def test_three_devices_sum_flat_and_still_equal_the_unsharded_run():
    want = train(OPTIMIZERS["adam"], 3, steps=3)
    for options in STAGES.values():
        assert_identical(train(OPTIMIZERS["adam"], 3, steps=3, **options), want)


def test_each_replica_holds_its_part_of_the_state_and_of_the_summed_gradients():
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="parts")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp,
                    optimizer_builder_fun=OPTIMIZERS["adam"], devices=[0, 1, 2, 3], cpu_device=True,
                    shard_gradients=True)
    x, y = batch(0)
    for d in range(4):
        workspace.FeedBlob(f"cpu_{d}/data", x[3 * d:3 * d + 3])
        workspace.FeedBlob(f"cpu_{d}/label", y[3 * d:3 * d + 3])
    net = model.net.Proto()
    assert set(net.external_inputs) == set(dataflow(net).loads)  # nor declares the whole state as read
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    sizes = {"fc1_w": [8, 8, 7, 7], "fc1_b": [2, 1, 1, 1], "pred_w": [4, 4, 4, 3], "pred_b": [1, 1, 1, 0]}
    for param, parts in sizes.items():
        for d, size in enumerate(parts):
            for blob in (f"{param}_first_moment", f"{param}_second_moment", f"{param}_grad"):
                assert workspace.FetchBlob(shard_name(f"cpu_{d}/{blob}")).shape == (size,)
            assert not workspace.HasBlob(f"cpu_{d}/{param}_first_moment")
    state = [b for b in workspace.Blobs() if b.endswith("moment_shard")]
    assert sum(workspace.FetchBlob(b).size for b in state) == 2 * (30 + 5 + 15 + 3)  # 1/N each, no padding


COMPOSED = {  # options under which sharded runs must still equal unsharded ones
    "buckets": ({"gradient_bucket_bytes": 64, "first_bucket_bytes": 64}, ("stage1",)),
    "bf16": ({"compute_dtype": "bfloat16"}, ("stage1", "stage2")),
    "accumulate": ({"accumulate_gradients": 2, "optimize_gradient_memory": True,
                    "dynamic_memory_management": True}, ("stage1", "stage2")),
    "clip_and_lars": ({}, ("stage1",)),
}


@pytest.mark.parametrize("case", sorted(COMPOSED))
def test_sharding_composes_with_other_options(case):
    options, stages = COMPOSED[case]
    opt = OPTIMIZERS["momentum"]
    if case == "clip_and_lars":
        opt = lambda m: optimizer.build_sgd(m, LR, momentum=0.9, max_gradient_norm=0.5, lars=0.25)  # noqa: E731
    want = train(opt, 2, **options)
    for stage in stages:
        assert_identical(train(opt, 2, **options, **STAGES[stage]), want)


def loud_cnn(model: Any, loss_scale: float) -> list:
    """`cnn` with its loss times 8: under a loss scale of 2**127 its gradient is 2**129, inf in float32."""
    return cnn(model, 8 * loss_scale)


def test_batch_norm_across_devices_and_loss_scaling_with_a_skipped_step():
    """combine_spatial_bn on a CNN; a dynamic loss scale that overflows at first so steps are skipped
    everywhere, then backs off."""
    options = {"combine_spatial_bn": True, "loss_scale": {"init_scale": 2.0 ** 127, "growth_interval": 2}}
    want = train(OPTIMIZERS["adam"], 2, forward=loud_cnn, steps=4, **options)
    assert 0 < want["skipped"] < 4
    for stage in STAGES.values():
        assert_identical(train(OPTIMIZERS["adam"], 2, forward=loud_cnn, steps=4, **options, **stage), want)


def test_nccl_reducer_on_cuda_replicas_equals_its_unsharded_run():
    with cuda_on_cpu():
        want = train(OPTIMIZERS["nesterov"], 4, gpu=True, use_nccl=True)
        for stage in STAGES.values():
            assert_identical(train(OPTIMIZERS["nesterov"], 4, gpu=True, use_nccl=True, **stage), want)
