"""Caffe2's trainer precision flags: `--dtype float16 --float16_compute` (PseudoFP16 params, fp32 masters,
multi-precision SGD, a loss scale) and graphpar's `--dtype bfloat16` run two iterations on logical
CUDA devices placed on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.devices import cuda_on_cpu
from graphpar.examples import resnet50_trainer

TINY = ["--num_gpus", "2", "--batch_size", "4", "--image_size", "32", "--num_labels", "10", "--epoch_size", "8",
        "--width", "4", "--num_layers", "18", "--num_epochs", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("flags, param_dtype, conv_dtype, steps, scale", [
    (["--dtype", "float16", "--float16_compute", "--loss_scale", "8"], torch.float16, torch.float16, 2, 8.0),
    # the dynamic scale starts at 2**16: this tiny net's fp16 gradients overflow there and at 2**15, so
    # both steps are skipped and the scale halves twice
    (["--dtype", "float16"], torch.float16, torch.float16, 0, 2.0 ** 14),
    (["--dtype", "bfloat16"], torch.float32, torch.bfloat16, 2, None),
])
def test_precision_flags_train_two_iterations_on_logical_gpus(tmp_path, monkeypatch, flags, param_dtype, conv_dtype,
                                                             steps, scale):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(resnet50_trainer, "num_cuda_devices", lambda: 2)
    with cuda_on_cpu():
        assert resnet50_trainer.main([*TINY, *flags]) == 0
    assert workspace.FetchTensor("gpu_1/conv1_w").dtype == param_dtype
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == steps
    if steps:
        assert workspace.FetchTensor("gpu_1/res2_0_branch2a").dtype == conv_dtype
    if scale is not None:
        assert workspace.FetchBlob("gpu_0/_loss_scale") == workspace.FetchBlob("gpu_1/_loss_scale") == np.float32(scale)
    assert workspace.FetchTensor("gpu_1/pred_w_fp32" if param_dtype == torch.float16 else "gpu_1/pred_w").dtype \
        == torch.float32
    assert workspace.FetchTensor("gpu_0/conv1_bn_rm").dtype == torch.float32  # BN running stats stay fp32
    for name in ("conv1_w", "pred_b"):
        a, b = workspace.FetchTensor(f"gpu_0/{name}"), workspace.FetchTensor(f"gpu_1/{name}")
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)


@pytest.mark.parametrize("flags, message", [(["--float16_compute"], "needs --dtype float16"),
                                            (["--dtype", "float16", "--loss_scale", "0"],
                                             "argument --loss_scale: must be a finite number > 0, got '0'"),
                                            (["--loss_scale", "8"], "--loss_scale needs")])
def test_precision_flag_misuse_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        resnet50_trainer.parse_args(flags)
    assert message in capsys.readouterr().err
