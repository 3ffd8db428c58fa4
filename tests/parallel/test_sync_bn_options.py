"""SyncBatchNorm's options on brew.spatial_bn, against torch's BatchNorm2d on the whole batch (the
reference SyncBatchNorm equals): affine=False, track_running_stats=False, momentum=None (the cumulative
moving average with num_batches_tracked), on one device and combined over devices (combine_spatial_bn),
and statistics synced over this shard's devices only (combine_spatial_bn="shard")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.errors import ParallelizeError
from graphpar.model_helper import ModelHelper

C = 3


def _batches(steps: int, n: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [(rng.normal(size=(n, C, 4, 4)) * (1 + k) + k).astype(np.float32) for k in range(steps)]


def _build(devices: list[int], options: dict, combine, training: bool = True, name: str = "bn") -> ModelHelper:
    def forward(model, loss_scale):
        h = brew.spatial_bn(model, "data", "bn", dim_in=C, epsilon=1e-5, is_test=not training, **options)
        pred = brew.fc(model, h, "pred", dim_in=C * 16, dim_out=2)
        _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    model = ModelHelper(name=name, init_params=training)
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=(lambda m: optimizer.build_sgd(m, 0.0)) if training else None,
                    devices=devices, cpu_device=True, combine_spatial_bn=combine)
    return model


def _feed(x: np.ndarray, devices: list[int]) -> None:
    for k, d in enumerate(devices):
        rows = slice(k * len(x) // len(devices), (k + 1) * len(x) // len(devices))
        workspace.FeedBlob(f"cpu_{d}/data", x[rows])
        workspace.FeedBlob(f"cpu_{d}/label", np.zeros(len(x[rows]), np.int32))


@pytest.mark.parametrize("devices, combine", [([0], False), ([0, 1], True), ([0, 1, 2, 3], True)])
@pytest.mark.parametrize("options", [dict(affine=False, momentum=None), dict(momentum=None),
                                     dict(affine=False, track_running_stats=False)])
def test_options_match_torch_batch_norm_on_the_whole_batch(devices, combine, options) -> None:
    workspace.ResetWorkspace()
    model = _build(devices, options, combine)
    reference = torch.nn.BatchNorm2d(C, eps=1e-5, affine=options.get("affine", True), momentum=None
                                     if "momentum" in options else 0.1,
                                     track_running_stats=options.get("track_running_stats", True))
    batches = _batches(3)
    _feed(batches[0], devices)
    dpm.RunInitNet(model)
    for x in batches:
        _feed(x, devices)
        dpm.RunNet(model, 1)
        expected = reference.train()(torch.from_numpy(x)).detach().numpy()
        got = np.concatenate([workspace.FetchBlob(f"cpu_{d}/bn") for d in devices])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    tracked = options.get("track_running_stats", True)
    computed = {str(p).split("/")[1] for p in model.GetComputedParams() if str(p).startswith("cpu_0/")}
    params = {str(p).split("/")[1] for p in model.GetParams() if str(p).startswith("cpu_0/")}
    assert ({"bn_s", "bn_b"} <= params) == options.get("affine", True)
    assert ({"bn_rm", "bn_riv"} <= computed) == tracked
    if tracked:
        for d in devices:
            np.testing.assert_allclose(workspace.FetchBlob(f"cpu_{d}/bn_rm"), reference.running_mean, rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(workspace.FetchBlob(f"cpu_{d}/bn_riv"), reference.running_var, rtol=1e-5)
            assert workspace.FetchBlob(f"cpu_{d}/bn_nbt")[0] == reference.num_batches_tracked.item() == 3
    else:  # evaluation normalises with the batch's statistics, as torch's eval() without running stats
        test = _build(devices, options, False, training=False, name="bn_test")
        x = _batches(4)[3]
        _feed(x, devices)
        dpm.RunInitNet(test)
        dpm.RunNet(test, 1)
        expected = np.concatenate([reference.eval()(torch.from_numpy(x[k * 8 // len(devices):(k + 1) * 8 // len(
            devices)])).detach().numpy() for k in range(len(devices))])
        got = np.concatenate([workspace.FetchBlob(f"cpu_{d}/bn") for d in devices])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_a_bad_combine_spatial_bn_is_refused() -> None:
    workspace.ResetWorkspace()
    with pytest.raises(ParallelizeError, match="combine_spatial_bn must be True, False, 'shard' or groups"):
        _build([0, 1], {}, "all")
