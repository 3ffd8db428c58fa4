"""The inter-device batch-norm pass on small hand-built, already interleaved nets.

The exact ops it emits are asserted, and the rewritten nets are run and compared with torch's batch
norm (and torch.autograd) over the concatenated batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphpar import workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.devices import cuda_on_cpu
from graphpar.errors import ParallelizeError
from graphpar.passes.analyze import analyze_operators
from graphpar.passes.common import DeviceLayout
from graphpar.passes.finish import chain_collectives
from graphpar.passes.inter_device_bn import inter_device_batch_norm
from tests.passes.helpers import cpu, gpu, layout, reducer, summary

EPS = 1e-3


def _bn(lay: DeviceLayout, d: int, x: str = "x", out: str = "y", **args) -> OperatorDef:
    s = lambda n: lay.scoped(d, n)  # noqa: E731
    return OperatorDef("SpatialBN", [s(x), s(f"{out}_s"), s(f"{out}_b"), s(f"{out}_rm"), s(f"{out}_riv")],
                       [s(out), s(f"{out}_rm"), s(f"{out}_riv"), s(f"{out}_sm"), s(f"{out}_siv")],
                       {"epsilon": EPS, "momentum": 0.9, **args}, lay.option(d))


def _bn_grad(lay: DeviceLayout, d: int, x: str = "x", out: str = "y") -> OperatorDef:
    s = lambda n: lay.scoped(d, n)  # noqa: E731
    return OperatorDef("SpatialBNGradient",
                       [s(x), s(f"{out}_s"), s(f"{out}_grad"), s(f"{out}_sm"), s(f"{out}_siv")],
                       [s("x_grad"), s(f"{out}_s_grad"), s(f"{out}_b_grad")],
                       {"epsilon": EPS, "momentum": 0.9}, lay.option(d), is_gradient_op=True)


def _nccl(blobs: list[str], control: list[str]) -> tuple:
    return ("NCCLAllreduce", blobs, blobs, gpu(3), "", control)


def _bn_net(lay: DeviceLayout) -> NetDef:
    """One batch-norm layer, forward and backward, interleaved over the devices."""
    return NetDef("bn", [_bn(lay, d) for d in lay.devices] + [_bn_grad(lay, d) for d in lay.devices])


def test_exact_ops_on_two_cpu_devices():
    lay = layout([0, 1])
    net = inter_device_batch_norm(_bn_net(lay), reducer(lay))
    assert summary(net.ops[:8]) == [
        ("ChannelStats", ["cpu_0/x"], ["cpu_0/x_sums", "cpu_0/x_sumsq", "cpu_0/x_count"], cpu(0), "", []),
        ("ChannelStats", ["cpu_1/x"], ["cpu_1/x_sums", "cpu_1/x_sumsq", "cpu_1/x_count"], cpu(1), "", []),
        ("Sum", ["cpu_0/x_sums", "cpu_1/x_sums"], ["cpu_0/x_sums"], cpu(0), "dpm", []),
        ("Copy", ["cpu_0/x_sums"], ["cpu_1/x_sums"], cpu(1), "", []),
        ("Sum", ["cpu_0/x_sumsq", "cpu_1/x_sumsq"], ["cpu_0/x_sumsq"], cpu(0), "dpm", []),
        ("Copy", ["cpu_0/x_sumsq"], ["cpu_1/x_sumsq"], cpu(1), "", []),
        ("Sum", ["cpu_0/x_count", "cpu_1/x_count"], ["cpu_0/x_count"], cpu(0), "dpm", []),
        ("Copy", ["cpu_0/x_count"], ["cpu_1/x_count"], cpu(1), "", []),
    ]
    assert [op.type for op in net.ops[8:10]] == ["SpatialBN", "SpatialBN"]
    bn0, bn1 = net.ops[8], net.ops[9]
    assert bn0.inputs[5:] == ["cpu_0/x_sums", "cpu_0/x_sumsq", "cpu_0/x_count"]
    assert bn1.inputs[5:] == ["cpu_1/x_sums", "cpu_1/x_sumsq", "cpu_1/x_count"]
    assert bn0.args["num_batches"] == bn1.args["num_batches"] == 2
    assert summary(net.ops[10:16]) == [
        ("ChannelBackpropStats", ["cpu_0/x", "cpu_0/y_sm", "cpu_0/y_siv", "cpu_0/y_grad"],
         ["cpu_0/y_s_grad", "cpu_0/y_b_grad"], cpu(0), "", []),
        ("ChannelBackpropStats", ["cpu_1/x", "cpu_1/y_sm", "cpu_1/y_siv", "cpu_1/y_grad"],
         ["cpu_1/y_s_grad", "cpu_1/y_b_grad"], cpu(1), "", []),
        ("Sum", ["cpu_0/y_s_grad", "cpu_1/y_s_grad"], ["cpu_0/y_s_grad"], cpu(0), "dpm", []),
        ("Copy", ["cpu_0/y_s_grad"], ["cpu_1/y_s_grad"], cpu(1), "", []),
        ("Sum", ["cpu_0/y_b_grad", "cpu_1/y_b_grad"], ["cpu_0/y_b_grad"], cpu(0), "dpm", []),
        ("Copy", ["cpu_0/y_b_grad"], ["cpu_1/y_b_grad"], cpu(1), "", []),
    ]
    grad0, grad1 = net.ops[16:18]
    assert grad0.inputs == ["cpu_0/x", "cpu_0/y_s", "cpu_0/y_grad", "cpu_0/y_sm", "cpu_0/y_siv",
                            "cpu_0/y_s_grad", "cpu_0/y_b_grad", "cpu_0/x_count"]  # the forward's global count
    assert grad0.outputs == ["cpu_0/x_grad", "cpu_0/y_s_grad", "cpu_0/y_b_grad"]  # in place over inputs 5, 6
    assert grad1.inputs[5:] == ["cpu_1/y_s_grad", "cpu_1/y_b_grad", "cpu_1/x_count"]
    assert grad1.args["num_batches"] == 2
    assert len(net.ops) == 18
    validate_net(net)
    analyze_operators([net], lay)  # every non-collective op stays in its replica


def test_exact_ops_on_logical_cuda_devices_with_nccl_chained_in_program_order():
    lay = layout([3, 1], gpu=True)
    net = inter_device_batch_norm(_bn_net(lay), reducer(lay, use_nccl=True))
    chain_collectives(net.ops)
    assert summary(net.ops) == [
        ("ChannelStats", ["gpu_3/x"], ["gpu_3/x_sums", "gpu_3/x_sumsq", "gpu_3/x_count"], gpu(3), "", []),
        ("ChannelStats", ["gpu_1/x"], ["gpu_1/x_sums", "gpu_1/x_sumsq", "gpu_1/x_count"], gpu(1), "", []),
        _nccl(["gpu_3/x_sums", "gpu_1/x_sums"], []),
        _nccl(["gpu_3/x_sumsq", "gpu_1/x_sumsq"], ["gpu_3/x_sums"]),
        _nccl(["gpu_3/x_count", "gpu_1/x_count"], ["gpu_3/x_sumsq"]),
        *summary(net.ops[5:7]),
        ("ChannelBackpropStats", ["gpu_3/x", "gpu_3/y_sm", "gpu_3/y_siv", "gpu_3/y_grad"],
         ["gpu_3/y_s_grad", "gpu_3/y_b_grad"], gpu(3), "", []),
        ("ChannelBackpropStats", ["gpu_1/x", "gpu_1/y_sm", "gpu_1/y_siv", "gpu_1/y_grad"],
         ["gpu_1/y_s_grad", "gpu_1/y_b_grad"], gpu(1), "", []),
        _nccl(["gpu_3/y_s_grad", "gpu_1/y_s_grad"], ["gpu_3/x_count"]),  # chained across groups too
        _nccl(["gpu_3/y_b_grad", "gpu_1/y_b_grad"], ["gpu_3/y_s_grad"]),
        *summary(net.ops[11:]),
    ]
    assert [(op.type, op.device_option) for op in net.ops[5:7] + net.ops[11:]] == [
        ("SpatialBN", gpu(3)), ("SpatialBN", gpu(1)),
        ("SpatialBNGradient", gpu(3)), ("SpatialBNGradient", gpu(1))]
    validate_net(net)
    analyze_operators([net], lay)


def test_without_nccl_cuda_uses_sums_and_copies_peers_without_p2p_to_the_root_first():
    lay = layout([0, 1], gpu=True)
    net = inter_device_batch_norm(_bn_net(lay), reducer(lay, peer_access=lambda root, peer: False))
    assert summary(net.ops[2:5]) == [
        ("Copy", ["gpu_1/x_sums"], ["gpu_0/x_sums_gpu1_copy"], gpu(0), "", []),
        ("Sum", ["gpu_0/x_sums", "gpu_0/x_sums_gpu1_copy"], ["gpu_0/x_sums"], gpu(0), "dpm", []),
        ("Copy", ["gpu_0/x_sums"], ["gpu_1/x_sums"], gpu(1), "", []),
    ]
    assert "cpu_0" not in str(net)  # no detour through the host (Caffe2's GPU variant went via cpu_0)


def test_four_devices_reduce_each_statistic_as_a_tree():
    lay = layout([4, 5, 6, 7])
    net = inter_device_batch_norm(NetDef("bn", [_bn(lay, d) for d in lay.devices]), reducer(lay))
    types = [op.type for op in net.ops]
    assert types == ["ChannelStats"] * 4 + (["Sum"] * 3 + ["Copy"] * 3) * 3 + ["SpatialBN"] * 4
    assert [(op.inputs, op.outputs[0]) for op in net.ops[4:7]] == [
        (["cpu_4/x_sums", "cpu_5/x_sums"], "cpu_4/x_sums"),
        (["cpu_6/x_sums", "cpu_7/x_sums"], "cpu_6/x_sums"),
        (["cpu_4/x_sums", "cpu_6/x_sums"], "cpu_4/x_sums")]


def test_consecutive_groups_on_one_input_get_fresh_statistics_names():
    lay = layout([0, 1])
    ops = [_bn(lay, d, out="a") for d in lay.devices] + [_bn(lay, d, out="b") for d in lay.devices]
    net = inter_device_batch_norm(NetDef("two", ops), reducer(lay))
    stats = [op.outputs for op in net.ops if op.type == "ChannelStats"]
    assert stats == [["cpu_0/x_sums", "cpu_0/x_sumsq", "cpu_0/x_count"],
                     ["cpu_1/x_sums", "cpu_1/x_sumsq", "cpu_1/x_count"],
                     ["cpu_0/x_sums_1", "cpu_0/x_sumsq_1", "cpu_0/x_count_1"],
                     ["cpu_1/x_sums_1", "cpu_1/x_sumsq_1", "cpu_1/x_count_1"]]
    bns = [op for op in net.ops if op.type == "SpatialBN"]
    assert [op.inputs[5:] for op in bns] == stats
    assert [op.type for op in net.ops].count("Sum") == 6


def test_test_mode_combined_and_single_device_nets_are_left_alone():
    lay = layout([0, 1])
    ops = [_bn(lay, d, is_test=True) for d in lay.devices]
    for op in ops:
        op.outputs = op.outputs[:1]
    net = NetDef("eval", ops)
    assert summary(inter_device_batch_norm(net, reducer(lay)).ops) == summary(ops)
    combined = inter_device_batch_norm(_bn_net(lay), reducer(lay))
    again = summary(combined.ops)
    assert summary(inter_device_batch_norm(combined, reducer(lay)).ops) == again  # idempotent
    single = layout([2])
    net = NetDef("one", [_bn(single, 2)])
    assert [op.type for op in inter_device_batch_norm(net, reducer(single)).ops] == ["SpatialBN"]


def test_an_incomplete_or_misordered_group_is_refused():
    lay = layout([0, 1])
    net = NetDef("fwd", [_bn(lay, 0), OperatorDef("Relu", ["cpu_1/x"], ["cpu_1/r"], device_option=cpu(1))])
    with pytest.raises(ParallelizeError, match=r"net 'fwd' op #0 starts a group of SpatialBN ops, expected "
                                               r"one per device \[0, 1\] .*\('Relu', 1\)\].*interleave_ops"):
        inter_device_batch_norm(net, reducer(lay))
    swapped = NetDef("swapped", [_bn(lay, 1), _bn(lay, 0)])
    with pytest.raises(ParallelizeError, match=r"\[\('SpatialBN', 1\), \('SpatialBN', 0\)\]"):
        inter_device_batch_norm(swapped, reducer(lay))


# ---- numerics: the rewritten net equals batch norm over the concatenated batch --------------------


def _feed_and_run(net: NetDef, lay: DeviceLayout, xs, dys, scale, bias) -> dict[str, np.ndarray]:
    for d, x, dy in zip(lay.devices, xs, dys):
        for name, value in (("x", x), ("y_grad", dy), ("y_s", scale), ("y_b", bias),
                            ("y_rm", torch.zeros_like(scale)), ("y_riv", torch.ones_like(scale))):
            workspace.FeedBlob(lay.scoped(d, name), value)
    workspace.RunNetOnce(net)
    names = ["y", "x_grad", "y_s_grad", "y_b_grad", "y_rm", "y_riv"]
    return {n: [workspace.FetchBlob(lay.scoped(d, n)) for d in lay.devices] for n in names}


@pytest.mark.parametrize(("devices", "gpu", "use_nccl", "sizes"), [
    ([0, 1], False, False, (3, 3)), ([3, 1, 2], False, False, (3, 3, 3)), ([4, 5, 6, 7], True, False, (3,) * 4),
    ([2, 0], True, True, (3, 3)),
    ([0, 1], False, False, (2, 6)), ([3, 1, 2], False, False, (1, 5, 2)), ([2, 0], True, True, (6, 2))])
def test_rewritten_net_equals_batch_norm_over_the_concatenated_batch(devices, gpu, use_nccl, sizes):
    """Equal and unequal per-device batches (a 2 + 6 split): the statistics are weighted by the real counts."""
    lay = layout(devices, gpu=gpu)
    net = inter_device_batch_norm(_bn_net(lay), reducer(lay, use_nccl=use_nccl))
    gen = torch.Generator().manual_seed(len(devices))
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    xs = [rand(n, 3, 2, 3) * (i + 1) + i for i, n in enumerate(sizes)]  # per-device batches differ a lot
    dys = [rand(x.shape) for x in xs]
    scale, bias = rand(3).abs() + 0.5, rand(3)
    with cuda_on_cpu(gpu):
        got = _feed_and_run(net, lay, xs, dys, scale, bias)

    x = torch.cat(xs).requires_grad_()
    w, b = scale.clone().requires_grad_(), bias.clone().requires_grad_()
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=EPS)
    y.backward(torch.cat(dys))
    def close(actual: np.ndarray, expected: torch.Tensor) -> None:
        np.testing.assert_allclose(actual, expected.detach().numpy(), rtol=1e-10, atol=1e-12)

    close(np.concatenate(got["y"]), y)
    close(np.concatenate(got["x_grad"]), x.grad)
    for k in range(len(devices)):  # each device's share of the parameter gradients, summed later
        close(got["y_s_grad"][k] * len(devices), w.grad)
        close(got["y_b_grad"][k] * len(devices), b.grad)
        close(got["y_rm"][k], rm)
        close(got["y_riv"][k], rv)
