"""Channels-last activations (`Parallelize(channels_last=True)`) and `order="NHWC"` models, end to end."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from graphpar import brew, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.models import resnet18
from graphpar.passes.channels_last import rewrite_channels_last

RESNET = functools.partial(resnet18, num_classes=3, width=4)


def test_one_conversion_before_the_first_conv_and_none_between_convs():
    net = NetDef("t", [
        OperatorDef("Conv", ["x", "w"], ["c1"], {"kernel": 3}),
        OperatorDef("SpatialBN", ["c1", "s", "b", "rm", "rv"], ["y", "rm", "rv", "sm", "sv"]),
        OperatorDef("Relu", ["y"], ["y"]),
        OperatorDef("Conv", ["y", "w2"], ["c2"], {"kernel": 1}),
        OperatorDef("Sum", ["c2", "y"], ["s2"]),
        OperatorDef("Conv", ["s2", "w3"], ["c3"], {"kernel": 1}),
        OperatorDef("Conv", ["x", "w4"], ["c4"], {"kernel": 1}),  # x again: its conversion is reused
        OperatorDef("FC", ["c4", "fw", "fb"], ["f"]),
        OperatorDef("Reshape", ["f"], ["r", "old"], {"shape": [2, 2, 1, 1]}),
        OperatorDef("Conv", ["r", "w5"], ["c5"], {"kernel": 1}),  # FC's output is not channels-last
        OperatorDef("Conv", ["c5", "w6"], ["c6"], {"kernel": 1, "order": "NHWC"}),  # NHWC: left alone
    ])
    rewrite_channels_last(net, taken={"x_cl"})
    assert [(op.type, op.inputs[0]) for op in net.ops] == [
        ("ChannelsLast", "x"), ("Conv", "x_cl_1"), ("SpatialBN", "c1"), ("Relu", "y"), ("Conv", "y"),
        ("Sum", "c2"), ("Conv", "s2"), ("Conv", "x_cl_1"), ("FC", "c4"), ("Reshape", "f"),
        ("ChannelsLast", "r"), ("Conv", "r_cl"), ("Conv", "c5")]


def _train(devices, steps=2, keep=False, **kwargs):
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="cl")
    dpm.Parallelize(model, lambda m: None, RESNET, devices=list(devices), cpu_device=True,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9), **kwargs)
    rng = np.random.default_rng(0)
    workspace.get_workspace().keep_all = keep
    try:
        for step in range(steps):
            for d in devices:
                workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((4, 3, 32, 32), dtype=np.float32))
                workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 4).astype(np.int32))
            if step == 0:
                dpm.RunInitNet(model)
            dpm.RunNet(model, 1)
    finally:
        workspace.get_workspace().keep_all = False
    return model


@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_every_activation_stays_channels_last_and_training_equals_nchw(compute_dtype):
    """On the CPU: after a run that keeps every blob, each 4-D activation and activation gradient of the
    train net is stored channels-last, and a step on 2 devices equals the NCHW run to a stated
    tolerance: the oneDNN kernels of the two layouts sum in other orders (fp32: 5e-4 on params of
    magnitude ~1, measured 1.5e-4, as batch norm over 4 values per device amplifies fp32 rounding;
    bf16: 3e-2, bf16's 2^-8 amplified the same way)."""
    nchw = _train([0, 1], steps=1, compute_dtype=compute_dtype)
    reference = {p: workspace.FetchTensor(p).clone() for p in nchw.GetParams()}
    model = _train([0, 1], steps=1, keep=True, compute_dtype=compute_dtype, channels_last=True)
    net = model.net.Proto()
    assert sum(op.type == "ChannelsLast" for op in net.ops) == 2  # the data of each replica, once
    state = {b for op in model.param_init_net.Proto().ops for b in op.outputs}  # params, momentum, ...
    state |= {str(g) for g in model.param_to_grad.values()}
    state |= {op.inputs[0] for op in net.ops if op.type == "ChannelsLast"}  # the data (cast), before conversion
    written = {b for op in net.ops for b in op.outputs} - state
    checked = 0
    for name in sorted(written):
        tensor = workspace.FetchTensor(name) if workspace.HasBlob(name) else None
        if tensor is not None and tensor.dim() == 4 and tensor.is_floating_point() and tensor.shape[1] > 1 \
                and tensor.shape[2] * tensor.shape[3] > 1 and "_w_bf16" not in name:  # filters: any format
            assert tensor.is_contiguous(memory_format=torch.channels_last), name
            checked += 1
    assert checked >= 90  # every activation and activation gradient with more than one pixel
    tolerance = 5e-4 if compute_dtype is None else 3e-2
    worst = max(float((workspace.FetchTensor(name) - value).abs().max()) for name, value in reference.items())
    assert worst <= tolerance, worst


def _nhwc_forward(order: str):
    def forward(model, loss_scale):
        with brew.arg_scope([brew.conv, brew.spatial_bn, brew.max_pool, brew.average_pool], order=order):
            h = brew.conv(model, "data", "conv", dim_in=3, dim_out=4, kernel=3, pad=1)
            h = brew.spatial_bn(model, h, "bn", dim_in=4, epsilon=1e-5, momentum=0.9)
            h = brew.relu(model, h, h)
            h = brew.max_pool(model, h, "pool", kernel=2, stride=2)
            h = brew.average_pool(model, h, "gap", global_pooling=True)
        pred = brew.fc(model, model.net.Flatten(h, "flat"), "pred", dim_in=4, dim_out=3)
        _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]
    return forward


@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_an_nhwc_model_trains_data_parallel_like_the_nchw_model(compute_dtype):
    """The same model in NHWC (filters [M, kh, kw, C], NHWC data) and NCHW, same initial values, two
    steps on 2 devices: bit-identical params (NHWC ops run the NCHW kernels on permuted tensors)."""
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((2, 3, 8, 8), dtype=np.float32), rng.integers(0, 3, 2).astype(np.int32))
               for _ in range(4)]
    results, start = {}, {}
    for order in ("NCHW", "NHWC"):
        workspace.ResetWorkspace()
        model = model_helper.ModelHelper(name=f"m_{order}")
        dpm.Parallelize(model, lambda m: None, _nhwc_forward(order), devices=[0, 1], cpu_device=True,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                        compute_dtype=compute_dtype)
        for step in range(2):
            for k, d in enumerate((0, 1)):
                x, y = batches[2 * step + k]
                workspace.FeedBlob(f"cpu_{d}/data", x if order == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
                workspace.FeedBlob(f"cpu_{d}/label", y)
            if step == 0:
                dpm.RunInitNet(model)
                if order == "NHWC":  # start from the NCHW run's initial values
                    for d in (0, 1):
                        for name, value in start.items():
                            value = value.transpose(0, 2, 3, 1) if value.ndim == 4 else value
                            workspace.FeedBlob(f"cpu_{d}/{name}", np.ascontiguousarray(value))
                else:
                    start.update({p.split("/")[1]: workspace.FetchBlob(p) for p in model.GetParams("cpu_0/")})
            dpm.RunNet(model, 1)
        results[order] = {p.split("/")[1]: workspace.FetchBlob(p) for p in model.GetParams("cpu_1/")}
    for name, value in results["NCHW"].items():
        got = results["NHWC"][name]
        np.testing.assert_array_equal(got.transpose(0, 3, 1, 2) if got.ndim == 4 else got, value, err_msg=name)
        assert not np.array_equal(value, start[name]) or name == "bn_b"


@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_conv_filters_and_their_momentum_are_channels_last_from_init_on(compute_dtype):
    """As eager's `module.to(memory_format=torch.channels_last)`: every 4-D filter (read through a
    cast in bf16) and its momentum is channels-last after the init net and stays so through the
    updates, so no Conv converts it and the update sees one layout; other params are as before."""
    model = _train([0, 1], steps=2, compute_dtype=compute_dtype, channels_last=True)
    filters = [p for p in map(str, model.GetParams()) if workspace.FetchTensor(p).dim() == 4]
    assert len(filters) >= 2 * 8  # ResNet-18's convs (and its shortcut convs) on both replicas
    for name in filters:
        for blob in (name, f"{name}_momentum"):
            tensor = workspace.FetchTensor(blob)
            assert tensor.is_contiguous(memory_format=torch.channels_last), blob
            assert tensor.shape[2] * tensor.shape[3] == 1 or not tensor.is_contiguous(), blob  # 1x1: both
    init = model.param_init_net.Proto()
    assert sorted(op.inputs[0] for op in init.ops if op.type == "ChannelsLast") == sorted(filters)
    assert all(workspace.FetchTensor(str(p)).is_contiguous() for p in model.GetParams()
               if workspace.FetchTensor(str(p)).dim() != 4)
